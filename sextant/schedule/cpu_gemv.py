"""The CPU's matrix-vector mapping: a Linear layer on a few rows (a decode step), weights read in place.

A decode step of an LLM runs every Linear on ``M = batch · tokens`` rows — 1 to 4 — so the product
is a stream over the weight ``W[N, K]`` (torch's layout: row ``n`` is output ``n``'s weights,
contiguous along K) with a few FMAs per element: memory-bound. The GEMM mapping
(``cpu_gemm.py``) wants ``B = permute(W)`` as a row-major ``[K, N]`` copy made at compile time, and
at small M it reads that copy a 32-column strip at a time, a row of ``N·4`` bytes apart per k — a new
page per k for the LM head — and computes ``mr`` rows where one exists. Here instead:

* **No prepacked copy**: W is read where the module keeps it, row by row along K, so a step
  streams each weight once, contiguously, and the program holds no second copy of it
  (``cpu_panels`` does not lay out the operands this mapping takes).
* **Parallel over N**: a step takes ``R`` consecutive rows of W (:func:`gemv_tile`: 16 or 8); blocks
  take runs of steps, spread over the cores.
* **Dot products along K**: per step, ``acc[p, r] += A[p, k:k+L]·W[n0+r, k:k+L]`` for the ``M`` rows
  ``p`` of A and the ``R`` rows of W, ``L`` = one vector of lanes: an unrolled lane loop over a local
  accumulator array with constant indices, which the CPU lowering emits as vector FMAs kept in
  registers (``codegen/lanes.py``); each W load is one contiguous vector from a row base computed
  outside the lane loop, and feeds ``M`` FMAs. ``R`` rows are ``R`` streams in flight — what the
  measurements reward (a decode step is bound by memory, not by FMA chains). The block's rows of A
  are staged once into a local ``[M, K]`` buffer in the accumulator type, so an inlined prologue is
  computed once per block, not once per output.
* **Horizontal reduce** per output at the end: the lanes are folded in halves
  (``L → L/2 → … → 4``, vector adds), the last four summed — at constant indices, so LLVM keeps it in
  registers and shuffles several outputs at once — then the ``K mod L`` tail added. The summation
  order is not a sequential sum's (as with any vectorised reduction): results match eager within
  fp32 rounding.
* The group's epilogue (bias, activation, residual add, reshape) runs per element in a loop over
  the step's outputs (generated once, whatever ``M·R``), through ``kernels.store_epilogue``, as in
  the GEMM. Rows past N in the last step are read on row ``N-1`` and not stored.

Used when the group's rows M (batch dims folded) are at most ``GEMV_MAX_ROWS`` and B is a view
of a param that is contiguous along K (a Linear weight ``permute``, or its ``expand`` over batch
dims). Prefill-shaped products (M = prompt · batch) keep the GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.kernel.ir import Assign, Binary, Buffer, Cast, Const, Expr, For, If, Kernel, Load, Store, Var
from sextant.schedule.indexing import accum_dtype, c, delinearize, iadd, imin, imul
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc

# rows of A (batch folded) up to which a weight product is a GEMV: decode steps of batch 1 to 4. At 8 rows
# it measured 10/12/10 GB/s against the GEMM's 6/10/10 (see gemv_tile) — too close to move the docs'
# 6- and 8-row examples off the GEMM they explain; at 16 rows the GEMM wins
GEMV_MAX_ROWS = 4
MIN_BLOCK_ELEMENTS = 16384  # of W per block at least (64 KiB of f32): smaller products run on one core


def weight_rows(b: Node) -> Node | None:
    """The param ``W[N, K]`` when the matmul operand ``b`` (``[..., K, N]``) is ``permute(W)`` — a Linear
    weight, read along K contiguously — possibly reshaped or expanded over leading (batch) dims;
    else None."""
    inner = tuple(b.shape[-2:])
    while b.op in ("expand", "reshape") and b.inputs[0].type.rank >= 2 and tuple(b.inputs[0].shape[-2:]) == inner:
        b = b.inputs[0]
    if b.op != "permute":
        return None
    perm, r = tuple(b.attr("perm")), b.type.rank
    w = b.inputs[0]
    if perm != (*range(r - 2), r - 1, r - 2) or w.op != "param" or math.prod(w.shape[:-2]) != 1:
        return None
    return w


def gemv_rows(group: Group) -> int | None:
    """M of a matmul group with its batch dims folded, when static."""
    a = group.anchor.inputs[0]
    rows = math.prod(a.shape[:-1])
    return rows if isinstance(rows, int) else None


def uses_gemv(group: Group, target: TargetDesc) -> bool:
    """Whether the CPU maps this matmul group as a GEMV (and its weight operand is not prepacked)."""
    if target.is_gpu or group.kind != "matmul":
        return False
    a, b = group.anchor.inputs
    rows = gemv_rows(group)
    k, n = a.shape[-1], b.shape[-1]
    if rows is None or not 1 <= rows <= GEMV_MAX_ROWS or not isinstance(k, int) or not isinstance(n, int):
        return False
    return a.dtype.is_float and weight_rows(b) is not None


def gemv_tile(rows: int) -> int:
    """Rows of W per step: 16 for one or two rows of A, 8 for more — one vector of partial sums per
    output, so 16 accumulator vectors for one row of A, 32 for two to four (a few spill).

    What pays is the number of W rows read at once, not FMA chains: each is a stream the core keeps
    in flight. Measured on 2 Zen 4 cores (AVX-512; another engineer's jobs beside it, so ±20 %),
    GB/s of W read for 768→2048, 2048→768 and 768→32000 with DRAM-resident weights (interleaved
    runs, best of 25): M = 1, 4 W rows × 2 vectors of lanes 16/21/24, 8 rows 20/24/27, 16 rows
    23/25/24, 32 rows 22/21/22, the GEMM on prepacked weights 16/12/10; M = 2, 8 rows 26/20/16,
    16 rows 31/22/18, the GEMM 11/11/10; M = 4, 8 rows 14/19/15, 16 rows 14/17/15, the GEMM
    7/10/10; M = 8, 4 rows 9/14/10, 8 rows 10/12/10, the GEMM 6/10/10 (``GEMV_MAX_ROWS``)."""
    return 16 if rows <= 2 else 8


def gemv_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """``C[p, n] = Σ_k A[p, k]·W[n, k]`` for the ``M`` rows ``p`` of A (see the module docstring)."""
    from sextant.schedule.kernels import BID, setup_kernel, store_epilogue

    mm = group.anchor
    a, b = mm.inputs
    *batch, m, k = a.shape
    n = b.shape[-1]
    rows = math.prod(a.shape[:-1])
    e, params, _ = setup_kernel(group, stored)
    acc_t = accum_dtype(mm.dtype)
    lanes = max(4, target.vector_bytes // 4)  # one vector of partial sums per output
    nrows = min(gemv_tile(rows), n)
    k_main = k - k % lanes
    tiles = rows * nrows
    acc = Buffer("acc", acc_t, tiles * lanes, "local")
    red = Buffer("red", acc_t, tiles * lanes, "local")
    sums = Buffer("sums", acc_t, tiles, "local")
    arow = Buffer("arow", acc_t, max(1, rows * k), "local")

    steps = -(-n // nrows)  # groups of nrows outputs
    blocks = max(1, min(steps, 4 * target.cores, (n * k) // MIN_BLOCK_ELEMENTS))
    per = -(-steps // blocks)
    blocks = -(-steps // per)
    ragged = n % nrows != 0  # the last step's rows past N are computed on row N-1 and not stored

    def as_acc(v: Expr) -> Expr:
        return v if v.dtype == acc_t else Cast(v, acc_t)

    def loop(start: Expr, stop: Expr, body: Callable[[Var], None], prefix: str, step: int = 1,
             unroll: bool = False) -> None:
        v = e.var(prefix)
        with e.scope() as stmts:
            body(v)
        e.emit(For(v, start, stop, step, tuple(stmts), unroll))

    def row_index(p: Expr) -> tuple[Expr, ...]:
        """(batch..., i) of A's folded row ``p``."""
        return delinearize(p, (*batch, m)) if batch else (p,)

    zeros_b = tuple(c(0) for _ in batch)
    w = weight_rows(b)
    w_name = e.buffers.get(id(w)) if w is not None and id(b) not in stored else None

    def w_at(kk: Expr, row: Expr) -> Expr:
        return as_acc(e.value(b, (*zeros_b, kk, row)))

    def w_from(base: Expr, u: Expr, row: Expr, kk: Expr) -> Expr:
        """W[row, kk] where ``base`` is ``row·K + kk - u``: the lane loop's contiguous load then
        indexes a scalar register plus the lane (its address needs no vector index arithmetic)."""
        if w_name is None:  # B was stored in another layout for another kernel: read it as it is
            return w_at(kk, row)
        return as_acc(Load(w_name, iadd(base, u), w.dtype))

    def stage(p: Var) -> None:  # the block's rows of A, once, in the accumulator type
        loop(c(0), c(k), lambda kk: e.emit(Store("arow", iadd(imul(p, k), kk),
                                                 as_acc(e.value(a, (*row_index(p), kk))))), "ka")

    def step(s: Var) -> None:
        n0 = e.bind(imul(s, nrows), "n0")
        wrow = [e.bind(imin(iadd(n0, c(r)), c(n - 1)) if ragged and r else iadd(n0, c(r)), "wr")
                for r in range(nrows)]
        loop(c(0), c(tiles * lanes), lambda u: e.emit(Store("acc", u, Const(0.0, acc_t))), "u", unroll=True)

        def kstep(k0: Var) -> None:
            abase = [e.bind(iadd(c(p * k), k0), "ab") for p in range(rows)]
            wbase = [e.bind(iadd(imul(wrow[r], k), k0), "wb") for r in range(nrows)]

            def lane(u: Var) -> None:
                kk = iadd(k0, u)
                avals = [e.bind(Load("arow", iadd(abase[p], u), acc_t), "a") for p in range(rows)]
                for r in range(nrows):
                    wv = e.bind(w_from(wbase[r], u, wrow[r], kk), "w")
                    for p in range(rows):
                        slot = iadd(c((p * nrows + r) * lanes), u)
                        e.emit(Store("acc", slot, Binary("add", Load("acc", slot, acc_t),
                                                         Binary("mul", avals[p], wv, acc_t), acc_t)))

            loop(c(0), c(lanes), lane, "u", unroll=True)

        if k_main:
            loop(c(0), c(k_main), kstep, "k", step=lanes)
        # per output, its lanes folded in halves (16 → 8 → 4, vector adds) and the last four summed,
        # all at constant indices: LLVM keeps it in registers and shuffles several outputs at once
        loop(c(0), c(tiles * lanes), lambda u: e.emit(Store("red", u, Load("acc", u, acc_t))), "u", unroll=True)
        for t in range(tiles):
            half = lanes // 2
            while half >= 4:
                def fold(u: Var, t: int = t, half: int = half) -> None:
                    lo = iadd(c(t * lanes), u)
                    e.emit(Store("red", lo, Binary("add", Load("red", lo, acc_t),
                                                   Load("red", iadd(lo, c(half)), acc_t), acc_t)))

                loop(c(0), c(half), fold, "u", unroll=True)
                half //= 2
            q = [Load("red", c(t * lanes + j), acc_t) for j in range(4)]
            e.emit(Store("sums", c(t), Binary("add", Binary("add", q[0], q[1], acc_t),
                                               Binary("add", q[2], q[3], acc_t), acc_t)))

        def output(p: Var) -> None:  # the epilogue, generated once: a loop over the outputs
            def one(r: Var) -> None:
                sv = e.var("s", acc_t)
                e.emit(Assign(sv, Load("sums", iadd(imul(p, nrows), r), acc_t)))
                out_n = e.bind(iadd(n0, r), "nj")
                if k_main < k:  # the K mod lanes last terms
                    row = e.bind(imin(out_n, c(n - 1)), "wr") if ragged else out_n

                    def tail(kk: Var) -> None:
                        av = Load("arow", iadd(imul(p, k), kk), acc_t)
                        e.emit(Assign(sv, Binary("add", sv, Binary("mul", av, w_at(kk, row), acc_t), acc_t)))

                    loop(c(k_main), c(k), tail, "kt")

                def store() -> None:
                    e.regs[id(mm)] = e.bind(sv if acc_t == mm.dtype else Cast(sv, mm.dtype), "c")
                    store_epilogue(e, group, (*row_index(p), out_n))
                    e.regs.pop(id(mm))

                if ragged:
                    with e.scope() as then:
                        store()
                    e.emit(If(Binary("lt", out_n, c(n), DType.bool), tuple(then)))
                else:
                    store()

            loop(c(0), c(nrows), one, "r")

        loop(c(0), c(rows), output, "p")

    start = e.bind(imul(BID, per), "g0")
    stop = iadd(start, c(per)) if steps % per == 0 else imin(iadd(start, c(per)), c(steps))
    loop(c(0), c(rows), stage, "p")
    loop(start, stop, step, "g")
    meta = {"mapping": "cpu-gemv", "rows": rows, "rows_of_w": nrows, "lanes": lanes}
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts),
                  local=(acc, red, sums, arow), meta=meta)
