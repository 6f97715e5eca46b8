"""TMA tensor maps for the CUDA runtime: encoded by the driver, passed by value to the kernels.

A Hopper kernel's ``TmaLoad`` statements name their source as a :class:`~sextant.kernel.wgmma.TensorMap`
(buffer, matrix shape, row stride, box, swizzle); the NVPTX lowering gives each distinct one a
128-byte ``__grid_constant__`` parameter after the buffers and sizes. Here each is encoded with
``cuTensorMapEncodeTiled`` at the address its buffer has for the launch — once for weights and
arena temporaries, again whenever a per-call input or output moves (the runner re-encodes it
with the launch's other rebound parameters; a CUDA graph node gets the new bytes with its update).
Out-of-bounds elements are filled with zeros (``CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE``), which the
GEMM relies on at ragged edges.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from sextant.graph.dtypes import DType
from sextant.kernel.ir import Kernel
from sextant.kernel.wgmma import TensorMap, kernel_tensor_maps

MAP_BYTES = 128
_DTYPES = {DType.f16: "FLOAT16", DType.bf16: "BFLOAT16", DType.f32: "FLOAT32", DType.i32: "INT32",
           DType.i64: "INT64"}
_SWIZZLES = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}


@dataclass(frozen=True)
class MapSlot:
    """Tensor map ``index`` of a kernel: ``spec``, whose source is the kernel's parameter ``param``."""

    index: int
    spec: TensorMap
    param: int
    dtype: DType


def kernel_map_slots(kernel: Kernel) -> list[MapSlot]:
    """The tensor-map parameters of ``kernel``, in parameter order, with the buffer each reads."""
    names = [p.name for p in kernel.params]
    return [MapSlot(i, tm, names.index(tm.src), kernel.params[names.index(tm.src)].dtype)
            for i, tm in enumerate(kernel_tensor_maps(kernel.body))]


def encode(driver: Any, slot: MapSlot, address: int) -> bytes:
    """The 128 bytes of ``slot``'s tensor map over a source at device ``address`` (``driver``: the
    runtime's checked call wrapper around ``cuda.bindings.driver``)."""
    m, spec = driver.m, slot.spec
    (rows, cols), (box_rows, box_cols) = spec.shape, spec.box
    size = slot.dtype.itemsize
    u64 = lambda xs: [m.cuuint64_t(x) for x in xs]
    u32 = lambda xs: [m.cuuint32_t(x) for x in xs]
    outer = spec.outer_dims[::-1]  # innermost dimension first, as the driver takes them
    dims = [cols, rows, *(n for n, _ in outer)]
    strides = [spec.stride * size, *(k * size for _, k in outer)]  # bytes, from the second dimension on
    tmap = driver("cuTensorMapEncodeTiled",
                  getattr(m.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_DTYPES[slot.dtype]}"), spec.rank,
                  address, u64(dims), u64(strides), u32([box_cols, box_rows] + [1] * len(outer)),
                  u32([1] * spec.rank),
                  m.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                  getattr(m.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{_SWIZZLES[spec.swizzle]}"),
                  m.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  m.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                  what=f"encoding the tensor map of {spec.src} ({rows}x{cols}, box {box_rows}x{box_cols})")
    words = [int(w) for w in tmap.opaque]
    return struct.pack(f"<{len(words)}Q", *words)[:MAP_BYTES].ljust(MAP_BYTES, b"\0")
