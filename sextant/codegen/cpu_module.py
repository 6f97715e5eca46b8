"""Running JIT-compiled kernels on the CPU: ctypes calls spread over a pool of threads.

What the CPU code generator returns (``llvm_cpu.compile_kernels``) and the counting and
race-checking builds run; the runtime's runners launch it. It lived in ``runtime/`` until
2026-12, which made codegen import upwards.

A kernel function is ``void NAME(i8** args, i32 block_begin, i32 block_end)``. ctypes drops
the GIL around the call, so block ranges handed to a thread pool run truly in parallel. The
compiled code keeps all scratch on its own stack (or heap), so any number of Python threads
may launch kernels of one module at once.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sextant.errors import SextantError
from sextant.graph.symbolic import substitute
from sextant.host import host_amx
from sextant.kernel.ir import Const, For, If, Kernel, Stmt, TileMatmul, iter_stmts
from sextant.kernel.sizes import check_binding

KernelFn = Callable[[ctypes.Array, int, int], None]
_CFUNC = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_int32)
# estimated statement executions (``estimate_work``) below which a launch is not split over threads:
# PARALLEL_WORK for the native executor's workers, which meet at spin barriers; POOL_WORK for a launch
# handed to this module's thread pool from Python, which costs ~50 µs (a submit, a wake-up and a
# future per worker; measured on a 2-core EPYC: the MLP example's 8x128x128 matmul, estimated at
# 164k, runs in 8.6 µs inline and 69 µs split) — about what 1M estimated statements take
PARALLEL_WORK = 32_768
POOL_WORK = 1_000_000
CHUNKS_PER_WORKER = 2  # block ranges per worker thread (a little slack for uneven blocks)
_CORES = os.cpu_count() or 1  # read once: os.cpu_count() reads /sys, ~6 µs (it was read at every launch)

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


class LaunchError(SextantError, ValueError):
    """A launch's buffers do not match the kernel's parameters."""


def workers() -> int:
    """Threads a launch may use (``SEXTANT_CPU_THREADS`` overrides the core count)."""
    env = os.environ.get("SEXTANT_CPU_THREADS")
    return max(1, int(env)) if env else _CORES


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="sextant-cpu")
        return _pool


def _forget_pool_in_child() -> None:
    """A forked child inherits the pool object but none of its threads (and maybe a held lock): work
    submitted to it would wait forever. The child builds its own pool on first use."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def estimate_work(kernel: Kernel) -> int:
    """Rough statement executions per launch (constant loop trip counts, 16 for the others):
    only used to decide whether a launch is worth spreading over threads."""

    def stmts(body: Sequence[Stmt]) -> int:
        total = 0
        for s in body:
            if isinstance(s, For):
                trips = 16
                if isinstance(s.start, Const) and isinstance(s.stop, Const) and s.step:
                    trips = max(0, len(range(int(s.start.value), int(s.stop.value), s.step)))
                total += 1 + trips * stmts(s.body)
            elif isinstance(s, If):
                total += 1 + max(stmts(s.then), stmts(s.orelse))
            elif isinstance(s, TileMatmul):  # as its expansion: a pair dot per row, strip and pair of K
                total += s.rows * s.col_tiles * s.k // 2
            else:
                total += 1
        return total

    return stmts(kernel.body) * kernel.threads_per_block * kernel.num_blocks


class CpuModule:
    """Compiled kernels of one LLVM module, callable by name."""

    def __init__(self, kernels: Sequence[Kernel], addresses: dict[str, int], *, keepalive: object = None,
                 llvm_ir: str | Callable[[], str] = "", optimized_ir: str | Callable[[], str] = ""):
        self.kernels = {k.name: k for k in kernels}
        self._llvm_ir = llvm_ir  # as generated (a callable: made when first asked for)
        self._optimized_ir = optimized_ir  # after O3 (likewise)
        self.cached_objects = 0  # kernels whose machine code came from the on-disk cache
        self._fns: dict[str, KernelFn] = {name: _CFUNC(addr) for name, addr in addresses.items()}
        self._work = {k.name: estimate_work(k) for k in kernels}
        self._keepalive = keepalive  # the execution engine owns the machine code
        if any(isinstance(s, TileMatmul) for k in kernels for s in iter_stmts(k.body)):
            host_amx()  # machine code from the object cache too: Linux grants AMX's state per process

    @property
    def llvm_ir(self) -> str:
        """The LLVM IR as generated from the kernel IR (for dumps and reports)."""
        if callable(self._llvm_ir):
            self._llvm_ir = self._llvm_ir()
        return self._llvm_ir

    @property
    def optimized_ir(self) -> str:
        """The LLVM IR after O3, as compiled (for dumps and reports)."""
        if callable(self._optimized_ir):
            self._optimized_ir = self._optimized_ir()
        return self._optimized_ir

    def __repr__(self) -> str:
        return f"CpuModule({len(self.kernels)} kernels: {', '.join(self.kernels)})"

    def launch(self, name: str, buffers: Sequence[torch.Tensor], grid_blocks: int | None = None, *,
               parallel: bool | None = None, sizes: Mapping[str, int] | None = None) -> None:
        """Run kernel ``name`` over blocks ``[0, grid_blocks)`` (default: its whole grid); ``sizes``:
        the values of its size arguments, for a kernel over symbolic sizes."""
        extra = {"sizes": sizes} if sizes else {}  # the checked and counting builds run static kernels only
        self.prepare(name, buffers, grid_blocks, parallel=parallel, **extra)()

    def prepare(self, name: str, buffers: Sequence[torch.Tensor], grid_blocks: int | None = None, *,
                parallel: bool | None = None, sizes: Mapping[str, int] | None = None) -> Callable[[], None]:
        """Check the buffers once and return a callable that launches with them (for timing)."""
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in buffers):
            raise LaunchError(f"kernel {name}: a meta tensor stands in for a buffer only in bind()")
        extra = {"sizes": sizes} if sizes else {}
        return self.bind(name, buffers, grid_blocks, parallel=parallel, **extra)[0]

    def bind(self, name: str, buffers: Sequence[torch.Tensor], grid_blocks: int | None = None, *,
             parallel: bool | None = None, sizes: Mapping[str, int] | None = None
             ) -> tuple[Callable[[], None], ctypes.Array]:
        """:meth:`prepare`'s launch and its argument array, whose entry ``i`` holds the address of
        buffer ``i`` (then the size arguments) and is read at every call. A buffer may be a ``meta``
        tensor, a stand-in checked for its dtype and size only, whose entry stays null: the caller
        writes there, before each call, the address of a contiguous CPU tensor of that dtype and
        size that overlaps no other buffer of the launch, and keeps the tensor alive while it runs
        (a runner's inputs and fresh outputs: the arguments are built once, not per call)."""
        if name not in self.kernels:
            raise LaunchError(f"no kernel named {name!r} in this module (it has {', '.join(self.kernels)})")
        kernel = self.kernels[name]
        values = dict(sizes or {})
        check_binding(kernel.sizes, values, f"kernel {name}")
        self._check(kernel, buffers, values)
        nblocks = kernel.num_blocks if grid_blocks is None else grid_blocks
        if not 0 <= nblocks <= kernel.num_blocks:
            raise LaunchError(f"kernel {name}: grid_blocks={nblocks} outside its grid of {kernel.num_blocks} blocks")
        args = (ctypes.c_void_p * max(1, len(buffers) + len(kernel.sizes)))(
            *[0 if t.is_meta else t.data_ptr() for t in buffers], *[values[s.name] for s in kernel.sizes])
        fn = self._fns[name]
        keep = tuple(buffers)  # the tensors must outlive every call
        nthreads = workers()
        if parallel is None:
            work = self._work[name] * nblocks // max(1, kernel.num_blocks)
            parallel = work >= POOL_WORK
        if not parallel or nthreads == 1 or nblocks < 2:
            def run_inline(args: ctypes.Array = args, keep: tuple = keep) -> None:
                if nblocks:
                    fn(args, 0, nblocks)
            return run_inline, args

        nchunks = min(nblocks, nthreads * CHUNKS_PER_WORKER)
        bounds = [nblocks * i // nchunks for i in range(nchunks + 1)]
        ranges = list(itertools.pairwise(bounds))

        def run_parallel(args: ctypes.Array = args, keep: tuple = keep) -> None:
            pool = _thread_pool()
            futures: list[Future] = [pool.submit(fn, args, lo, hi) for lo, hi in ranges[1:]]
            lo, hi = ranges[0]
            fn(args, lo, hi)  # this thread takes a share too
            for f in futures:
                f.result()

        return run_parallel, args

    @staticmethod
    def _check(kernel: Kernel, buffers: Sequence[torch.Tensor], sizes: Mapping[str, int] | None = None) -> None:
        if len(buffers) != len(kernel.params):
            raise LaunchError(f"kernel {kernel.name} takes {len(kernel.params)} buffers "
                              f"({', '.join(p.name for p in kernel.params)}), got {len(buffers)}")
        for p, t in zip(kernel.params, buffers):
            problem = None
            if not isinstance(t, torch.Tensor):
                problem = f"is a {type(t).__name__}, not a tensor"
            elif t.device.type not in ("cpu", "meta"):  # meta: a stand-in (bind)
                problem = f"is on {t.device}"
            elif t.dtype != p.dtype.torch:
                problem = f"has dtype {t.dtype}, expected {p.dtype.torch}"
            elif not t.is_contiguous():
                problem = "is not contiguous"
            elif t.numel() < substitute(p.size, sizes or {}):
                problem = f"has {t.numel()} elements, the kernel uses {substitute(p.size, sizes or {})}"
            if problem:
                raise LaunchError(f"kernel {kernel.name}: buffer {p.name} {problem}")
        # the code assumes distinct buffers (codegen's alias scopes): a written one may overlap none
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), p)
                 for p, t in zip(kernel.params, buffers) if not t.is_meta]
        for i, (lo, hi, p) in enumerate(spans):
            for lo2, hi2, q in spans[i + 1:]:
                if lo < hi2 and lo2 < hi and "out" in p.role + q.role:
                    raise LaunchError(f"kernel {kernel.name}: buffers {p.name} and {q.name} overlap in memory, "
                                      f"and one of them is written")
