"""What this machine's CPU can do, asked of LLVM once per process.

The schedules (``schedule/target.py``) size register tiles and choose instructions by these
facts, and the CPU code generator (``codegen/llvm_cpu.py``) compiles for them, so both read
them here rather than one importing the other. The CPU model changes between machines (AVX2,
AVX-512, AVX-512-BF16, AMX behind a hypervisor or not): features are detected, never inferred
from the CPU's name (LLVM has called an AMX-capable Xeon ``rocketlake``).
"""

from __future__ import annotations

import functools


@functools.cache
def host_cpu_features() -> frozenset[str]:
    """The CPU's features as LLVM names them (``avx512f``, ``avx512bf16``, ``amx-bf16``, ...)."""
    import llvmlite.binding as llvm

    flat = llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))


def host_vector_bytes() -> int:
    """The widest vectors LLVM uses on this CPU at O3: 64 bytes with AVX-512, else 32 (AVX2)."""
    return 64 if "avx512f" in host_cpu_features() else 32


def host_pair_dot() -> bool:
    """Whether the CPU has a bf16 pair dot product into f32 (AVX-512-BF16's ``vdpbf16ps``)."""
    return {"avx512bf16", "avx512f"} <= host_cpu_features()
