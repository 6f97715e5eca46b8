"""ONNX element types ↔ sextant's six dtypes, and TensorProto → torch tensor."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sextant.graph.dtypes import DType

# TensorProto.DataType numbers (onnx.TensorProto.FLOAT = 1, ...), kept here so the table reads plainly
_FROM_ONNX = {1: DType.f32, 10: DType.f16, 16: DType.bf16, 6: DType.i32, 7: DType.i64, 9: DType.bool}
_TO_ONNX = {v: k for k, v in _FROM_ONNX.items()}


def onnx_type_name(elem_type: int) -> str:
    import onnx

    try:
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return f"type {elem_type}"


def from_onnx(elem_type: int) -> DType | None:
    """sextant's dtype for an ONNX element type, or None when sextant has no such type."""
    return _FROM_ONNX.get(elem_type)


def to_onnx(dtype: DType) -> int:
    return _TO_ONNX[dtype]


def unsupported_dtype(elem_type: int) -> str:
    names = ", ".join(onnx_type_name(t) for t in _FROM_ONNX)
    return f"element type {onnx_type_name(elem_type)} is not supported by sextant (supported: {names})"


def tensor_from_proto(proto: Any) -> torch.Tensor:
    """An initializer or Constant value as a torch tensor (bf16 through its bit pattern)."""
    from onnx import numpy_helper

    arr = numpy_helper.to_array(proto)
    if proto.data_type == 16:  # bfloat16: numpy has no such type; reinterpret the 16-bit patterns
        bits = np.asarray(arr).view(np.uint16).astype(np.int32).astype(np.int16)
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))


def from_numpy(a: Any) -> torch.Tensor:
    """An array a caller (or onnx's numpy_helper) gave, as a CPU tensor that owns or safely shares its
    memory: 0-d stays 0-d, ml_dtypes' bfloat16 becomes float32 (torch cannot read it)."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        a = a.astype(np.float32)
    return torch.from_numpy(a if a.flags.writeable and a.flags.c_contiguous else a.copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A result for a numpy caller (bf16 results come back as float32: numpy has no bfloat16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()
