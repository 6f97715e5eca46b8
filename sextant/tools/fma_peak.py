"""This CPU's measured fp32 FMA peak: what a GEMM's GFLOP/s are compared with; and, where the CPU
has AVX-512-BF16, its bf16 pair-dot peak (``vdpbf16ps``: 2 multiply-adds per f32 lane), or where
it has AMX, its tile peak (``tdpbf16ps``: 16×16×32 multiply-adds), what a bf16 GEMM's are
compared with.

A loop of independent fused multiply-adds on the widest vectors LLVM targets here (:func:`chains`
of them: more than any core's FMA latency × throughput, so the units never wait, and few enough
to stay in registers), JIT-compiled through llvmlite
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


def chains(lanes: int) -> int:
    """Independent accumulator chains: 16 in AVX-512's 32 zmm registers, 12 in AVX2's 16 ymm
    (with the two operands). 16 chains on AVX2 spilled two accumulators a trip, whose store-to-load
    round trip then set the pace: a Zen 3 core measured 51 GFLOP/s against 96 with 12 chains (8 to
    14 gave 88–96; MKL's own GEMMs ran at 99–130 GFLOP/s on 2 cores, past the spilled "peak")."""
    return 16 if lanes >= 16 else 12


@dataclass(frozen=True)
class Peak:
    lanes: int  # fp32 lanes per vector
    one_core: float  # GFLOP/s
    all_cores: float  # GFLOP/s, every core at once
    cores: int
    kind: str = "fma"  # "fma": fp32 FMA; "bf16 dot": vdpbf16ps; "amx": tdpbf16ps

    def __str__(self) -> str:
        what = {"fma": "fp32 FMA", "bf16 dot": "bf16 pair-dot (vdpbf16ps)", "amx": "bf16 AMX tile (tdpbf16ps)"}
        unit = "16×16×32 tiles" if self.kind == "amx" else f"{self.lanes}-lane vectors"
        return (f"{what[self.kind]} peak (measured): {self.one_core:.0f} GFLOP/s on one core, {self.all_cores:.0f} "
                f"on {self.cores} cores ({unit})")


def _ir(lanes: int, kind: str = "fma") -> str:
    n = chains(lanes)
    vec = f"<{lanes} x float>"
    init = f"<{', '.join(['float 1.0'] * lanes)}>"
    phis = "\n".join(f"  %a{c} = phi {vec} [ {init}, %entry ], [ %b{c}, %loop ]" for c in range(n))
    if kind == "fma":
        decl, op, arg = f"{vec} @llvm.fma.v{lanes}f32({vec}, {vec}, {vec})", f"@llvm.fma.v{lanes}f32", vec
    else:  # the same registers read as 2·lanes bf16 values
        arg = f"<{2 * lanes} x bfloat>"
        op = f"@llvm.x86.avx512bf16.dpbf16ps.{32 * lanes}"
        decl = f"{vec} {op}({vec}, {arg}, {arg})"
    fmas = "\n".join(f"  %b{c} = call {vec} {op}({vec} %a{c}, {arg} %x, {arg} %y)" for c in range(n))
    sums = [f"%b{c}" for c in range(n)]
    adds = []
    while len(sums) > 1:
        k = len(adds)
        adds.append(f"  %s{k} = fadd {vec} {sums[0]}, {sums[1]}")
        sums = sums[2:] + [f"%s{k}"]
    entry = (f"  %x = load {arg}, ptr %io, align 4\n  %py = getelementptr {vec}, ptr %io, i64 1\n"
             f"  %y = load {arg}, ptr %py, align 4")
    done = "\n".join([*adds, f"  store {vec} {sums[0]}, ptr %io, align 4"])
    return _loop_function(f"declare {decl}", entry, f"{phis}\n{fmas}", done)


def _loop_function(decls: str, entry: str, body: str, done: str) -> str:
    """``void @fma_loop(i64 %n, ptr %io)``: ``entry``, then ``body`` run ``n`` times (its phis
    refer to ``%entry`` and ``%loop``), then ``done``."""
    return f"""
{decls}

define void @fma_loop(i64 %n, ptr %io) {{
entry:
{entry}
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %loop ]
{body}
  %i1 = add i64 %i, 1
  %more = icmp ult i64 %i1, %n
  br i1 %more, label %loop, label %done
done:
{done}
  ret void
}}
"""


AMX_ACCS = 4  # accumulator tiles (the GEMM's 2×2), each fed by one of two A and two B tiles held in registers


def _amx_ir() -> str:
    """``n`` trips of four independent ``tdpbf16ps`` on tiles loaded once (the GEMM's 2×2 micro-tile
    with its operands in registers: the instruction's own rate, no memory)."""
    shape = "i16 16, i16 64"
    loads = "\n".join(f"  %p{t} = getelementptr i8, ptr %io, i64 {1024 * t}\n"
                      f"  %t{t} = call x86_amx @llvm.x86.tileloadd64.internal({shape}, ptr %p{t}, i64 64)"
                      for t in range(4))  # %t0, %t1: A; %t2, %t3: B
    zeros = "\n".join(f"  %z{c} = call x86_amx @llvm.x86.tilezero.internal({shape})" for c in range(AMX_ACCS))
    phis = "\n".join(f"  %c{c} = phi x86_amx [ %z{c}, %entry ], [ %d{c}, %loop ]" for c in range(AMX_ACCS))
    dots = "\n".join(f"  %d{c} = call x86_amx @llvm.x86.tdpbf16ps.internal({shape}, i16 64, x86_amx %c{c}, "
                      f"x86_amx %t{c // 2}, x86_amx %t{2 + c % 2})" for c in range(AMX_ACCS))
    stores = "\n".join(f"  %q{c} = getelementptr i8, ptr %io, i64 {4096 + 1024 * c}\n"
                       f"  call void @llvm.x86.tilestored64.internal({shape}, ptr %q{c}, i64 64, x86_amx %d{c})"
                       for c in range(AMX_ACCS))
    decls = "\n".join(["declare x86_amx @llvm.x86.tilezero.internal(i16, i16)",
                        "declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)",
                        "declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)",
                        "declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)"])
    return _loop_function(decls, f"{loads}\n{zeros}", f"{phis}\n{dots}", stores)


@cache
def _kernel(kind: str = "fma") -> tuple[object, object, int]:
    import llvmlite.binding as llvm

    from sextant.codegen.llvm_cpu import host_target_machine
    from sextant.host import host_vector_bytes

    lanes = host_vector_bytes() // 4
    tm = host_target_machine()
    mod = llvm.parse_assembly(_amx_ir() if kind == "amx" else _ir(lanes, kind))
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    fn = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(engine.get_function_address("fma_loop"))
    return engine, fn, lanes


def _run(threads: int, iters: int, kind: str) -> float:
    """Seconds for ``threads`` threads to run ``iters`` loop trips each, at once."""
    _, fn, lanes = _kernel(kind)
    if kind == "amx":  # four operand tiles, four result tiles (bf16 pairs of 1.0 and a tiny value)
        bufs = [(ctypes.c_float * 2048)(*([1.0000001] * 2048)) for _ in range(threads)]
    else:
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
def measure(cores: int | None = None, seconds: float = 0.3, kind: str = "fma") -> Peak:
    """The best of five timed runs on one core and on ``cores`` (default: all) at once. ``kind``
    "bf16 dot" needs AVX-512-BF16 (:func:`sextant.host.host_pair_dot`), "amx" AMX
    (:func:`sextant.host.host_amx`, which also obtains Linux's grant)."""
    if kind == "amx":
        from sextant.host import host_amx

        if not host_amx():
            raise RuntimeError("this CPU has no AMX tiles (or Linux did not grant them): no AMX peak to measure")
    _, _, lanes = _kernel(kind)
    cores = cores or os.cpu_count() or 1
    per_op = {"fma": 2 * lanes, "bf16 dot": 4 * lanes, "amx": 16 * 16 * 32 * 2}[kind]
    flops_per_trip = per_op * (AMX_ACCS if kind == "amx" else chains(lanes))
    trial = 20_000 if kind == "amx" else 200_000
    per_trip = _run(1, trial, kind) / trial
    iters = max(trial, int(seconds / per_trip))

    def best(threads: int) -> float:
        return max(threads * iters * flops_per_trip / _run(threads, iters, kind) for _ in range(5)) / 1e9

    return Peak(lanes, best(1), best(cores), cores, kind)


if __name__ == "__main__":
    from sextant.host import host_amx, host_pair_dot

    print(measure())
    if host_pair_dot():
        print(measure(kind="bf16 dot"))
    if host_amx():
        print(measure(kind="amx"))
