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


@functools.cache
def host_amx() -> bool:
    """Whether this process may run AMX bf16 tiles: the CPU has them (``amx-tile``, ``amx-bf16``)
    and Linux granted the process their register state. The grant is asked for here, once per
    process (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``): without it the first tile
    instruction is a SIGILL. oneDNN asks too once torch has used AMX, which can hide a missing
    request, so sextant never relies on it."""
    if not {"amx-tile", "amx-bf16"} <= host_cpu_features():
        return False
    return _request_amx_state()


def _request_amx_state() -> bool:
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0:
        return True
    import os
    import warnings

    err = ctypes.get_errno()
    warnings.warn(f"this CPU has AMX tiles but Linux refused this process their state (arch_prctl: "
                  f"{os.strerror(err)}, errno {err}); bf16 GEMMs take the vector path", RuntimeWarning, stacklevel=2)
    return False
