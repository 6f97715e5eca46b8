"""Target descriptions: the facts about a machine that a schedule's mapping depends on.

The kernel IR is the same for every target; a schedule reads these numbers to choose how a
fused group is mapped onto blocks, threads and loops.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from sextant.host import host_amx, host_pair_dot, host_vector_bytes
from sextant.kernel.devices import max_shared_bytes
from sextant.schedule.tuning import NO_TILES, TileTable


@dataclass(frozen=True)
class TargetDesc:
    name: str
    cores: int  # CPU cores, or streaming multiprocessors
    warp: int  # SIMT width; 1 on the CPU (a "thread" is a loop iteration)
    shared_bytes: int  # shared memory a block may use (on GPUs past 48 KiB it is dynamic, opted into)
    vector_bytes: int  # widest load/store
    max_threads: int  # threads per block
    is_gpu: bool = False
    tf32: bool = False  # f32 matmuls may use tf32 tensor cores (torch.backends.cuda.matmul.allow_tf32)
    pair_dot: bool = False  # bf16 GEMMs on weights multiply pairs of K into f32 (kernel.ir.PairDot; AVX-512-BF16)
    amx: bool = False  # bf16 GEMMs on weights run on AMX tiles (kernel.ir.TileMatmul; schedule/cpu_amx.py)
    tiles: TileTable = NO_TILES  # measured GEMM/conv tile choices (schedule/tuning.py; tools/tune.py)

    @property
    def vector_width_f32(self) -> int:
        return self.vector_bytes // 4


def cpu_target(cores: int | None = None, vector_bytes: int | None = None, pair_dot: bool | None = None,
               amx: bool | None = None) -> TargetDesc:
    """This machine's CPU (the CPU target JIT-compiles for the host): one thread per block, blocks
    spread over the cores, the host's vector width, its bf16 dot-product instruction and matrix
    tiles. Each can be pinned, e.g. for reproducible docs; a pinned ``pair_dot`` or ``amx`` on a
    CPU without the instruction still runs (``codegen/cpu_matrix.py`` computes the same sums lane
    by lane, ``kernel/tiles.py`` expands tile matmuls into pair dots)."""
    return TargetDesc("cpu", cores=cores or os.cpu_count() or 1, warp=1, shared_bytes=1 << 20,
                      vector_bytes=vector_bytes or host_vector_bytes(), max_threads=1,
                      pair_dot=host_pair_dot() if pair_dot is None else pair_dot,
                      amx=host_amx() if amx is None else amx)


def sm90_target() -> TargetDesc:
    """NVIDIA Hopper (H100/H200): 132 SMs, warps of 32, 227 KiB of shared memory per block."""
    return TargetDesc("sm_90", cores=132, warp=32, shared_bytes=max_shared_bytes(90), vector_bytes=16,
                      max_threads=1024, is_gpu=True)


# SMs of the data-centre part of each architecture (A100, A10-class, L40, H100/H200 SXM, B200): the
# elementwise mapping sizes its vector choice by them.
_SMS = {80: 108, 86: 84, 89: 142, 90: 132, 100: 148}


def gpu_target(arch: str = "sm_90", tf32: bool = False, tiles: TileTable = NO_TILES) -> TargetDesc:
    """The GPU target for ``arch`` (``sm_80``, ``sm_90``, ``sm_90a``, ...): the same mappings, with the
    SM count of that generation's data-centre part (unknown architectures get Hopper's). ``tf32``:
    f32 matmuls may run on tf32 tensor cores (``schedule/gpu_tf32.py``); off, they are exact fp32.
    ``tiles``: measured tile choices that override the cost model's (``schedule/tuning.py``)."""
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    if not arch.startswith("sm_") or not digits:
        raise ValueError(f"unknown GPU architecture {arch!r}; expected e.g. 'sm_80' or 'sm_90'")
    base = sm90_target()
    shared = max_shared_bytes(int(digits))
    return TargetDesc(arch, cores=_SMS.get(int(digits), base.cores), warp=base.warp, shared_bytes=shared,
                      vector_bytes=base.vector_bytes, max_threads=base.max_threads, is_gpu=True, tf32=tf32,
                      tiles=tiles)



def sm_version(target: TargetDesc) -> int:
    """The compute capability of a GPU target as a number (``sm_90a`` → 90); 0 for the CPU."""
    m = re.match(r"sm_(\d+)", target.name)
    return int(m.group(1)) if m else 0
