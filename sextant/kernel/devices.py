"""Facts about GPU generations that both the scheduler and the PTX code generator need.

Below both in the pipeline, so neither imports the other for them (``codegen/llvm_nvptx.py``
used to import ``schedule/target.py`` for the shared-memory limit)."""

from __future__ import annotations

# Shared memory one block may use (CUDA's cudaDevAttrMaxSharedMemoryPerBlockOptin): 48 KiB
# static, the rest dynamic (codegen/llvm_nvptx.py switches a kernel over past 48 KiB).
_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def max_shared_bytes(sm: int) -> int:
    """The shared memory one block of compute capability ``sm`` (e.g. 90) may use, opted in."""
    return _SHARED.get(sm, 48 * 1024)
