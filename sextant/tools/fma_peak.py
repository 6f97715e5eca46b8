"""This CPU's measured fp32 FMA peak: what a GEMM's GFLOP/s are compared with.

A loop of independent fused multiply-adds on the widest vectors LLVM targets here (16 chains, more
than any core's FMA latency × throughput, so the units never wait), JIT-compiled through llvmlite
for the host, timed on one thread and on every core at once (ctypes releases the GIL, so the
threads run in parallel). Measured rather than computed from a data sheet: the clock under load,
AVX-512 frequency offsets and a VM's share of the cores are all in the figure.

    python -m sextant.tools.fma_peak
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from functools import cache

CHAINS = 16


@dataclass(frozen=True)
class Peak:
    lanes: int  # fp32 lanes per vector
    one_core: float  # GFLOP/s
    all_cores: float  # GFLOP/s, every core at once
    cores: int

    def __str__(self) -> str:
        return (f"fp32 FMA peak (measured): {self.one_core:.0f} GFLOP/s on one core, {self.all_cores:.0f} on "
                f"{self.cores} cores ({self.lanes}-lane vectors)")


def _ir(lanes: int) -> str:
    vec = f"<{lanes} x float>"
    init = f"<{', '.join(['float 1.0'] * lanes)}>"
    phis = "\n".join(f"  %a{c} = phi {vec} [ {init}, %entry ], [ %b{c}, %loop ]" for c in range(CHAINS))
    fmas = "\n".join(f"  %b{c} = call {vec} @llvm.fma.v{lanes}f32({vec} %a{c}, {vec} %x, {vec} %y)"
                     for c in range(CHAINS))
    sums = [f"%b{c}" for c in range(CHAINS)]
    adds = []
    while len(sums) > 1:
        k = len(adds)
        adds.append(f"  %s{k} = fadd {vec} {sums[0]}, {sums[1]}")
        sums = sums[2:] + [f"%s{k}"]
    return f"""
declare {vec} @llvm.fma.v{lanes}f32({vec}, {vec}, {vec})

define void @fma_loop(i64 %n, ptr %io) {{
entry:
  %x = load {vec}, ptr %io, align 4
  %py = getelementptr {vec}, ptr %io, i64 1
  %y = load {vec}, ptr %py, align 4
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %loop ]
{phis}
{fmas}
  %i1 = add i64 %i, 1
  %more = icmp ult i64 %i1, %n
  br i1 %more, label %loop, label %done
done:
{chr(10).join(adds)}
  store {vec} {sums[0]}, ptr %io, align 4
  ret void
}}
"""


@cache
def _kernel() -> tuple[object, object, int]:
    import llvmlite.binding as llvm

    from sextant.codegen.llvm_cpu import host_target_machine
    from sextant.schedule.target import host_vector_bytes

    lanes = host_vector_bytes() // 4
    tm = host_target_machine()
    mod = llvm.parse_assembly(_ir(lanes))
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(engine.get_function_address("fma_loop"))
    return engine, fn, lanes


def _run(threads: int, iters: int) -> float:
    """Seconds for ``threads`` threads to run ``iters`` loop trips each, at once."""
    _, fn, lanes = _kernel()
    bufs = [(ctypes.c_float * (2 * lanes))(*([1.0000001] * lanes + [1e-9] * lanes)) for _ in range(threads)]
    start = threading.Barrier(threads + 1)

    def work(buf: ctypes.Array) -> None:
        start.wait()
        fn(iters, ctypes.addressof(buf))  # type: ignore[operator]

    pool = [threading.Thread(target=work, args=(b,)) for b in bufs]
    for t in pool:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


@cache
def measure(cores: int | None = None, seconds: float = 0.3) -> Peak:
    """The best of five timed runs on one core and on ``cores`` (default: all) at once."""
    _, _, lanes = _kernel()
    cores = cores or os.cpu_count() or 1
    flops_per_trip = 2 * CHAINS * lanes
    trial = 200_000
    per_trip = _run(1, trial) / trial
    iters = max(trial, int(seconds / per_trip))

    def best(threads: int) -> float:
        return max(threads * iters * flops_per_trip / _run(threads, iters) for _ in range(5)) / 1e9

    return Peak(lanes, best(1), best(cores), cores)


if __name__ == "__main__":
    print(measure())
