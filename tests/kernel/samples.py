"""Typical kernels (the patterns schedules emit) and a small kernel interpreter for the tests.

The interpreter runs every thread of a block as a generator that pauses at each ``Barrier``
and ``WarpReduce``, so shared-memory reductions and warp reductions execute as on a GPU;
memory accesses are bounds-checked (an out-of-bounds load or store raises ``IndexError``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Generator

from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    Barrier,
    Binary,
    Buffer,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    Select,
    Special,
    Stmt,
    Store,
    Unary,
    Var,
    WarpReduce,
    add,
    c,
    lt,
    mul,
)
from sextant.kernel.ranges import eval_expr

F32, I32, BOOL = DType.f32, DType.i32, DType.bool
TID, TIDY = Special("tid", "x"), Special("tid", "y")
BID, BIDY = Special("bid", "x"), Special("bid", "y")


def f(v: float) -> Const:
    return Const(float(v), F32)


def b(op: str, x: Expr, y: Expr, dtype: DType | None = None) -> Binary:
    cmp = op in ("lt", "le", "gt", "ge", "eq", "ne")
    return Binary(op, x, y, dtype or (BOOL if cmp else x.dtype))


def v(name: str, dtype: DType = I32) -> Var:
    return Var(name, dtype)


# -- sample kernels ------------------------------------------------------------------------------
def elementwise(n: int = 1000, block: int = 256, guard: Expr | None = None) -> Kernel:
    """``out0[i] = exp(in0[i]) * 0.5`` with the usual ``if (i < n)`` guard."""
    i = v("i")
    grid = -(-n // block)
    body = Store("out0", i, b("mul", Unary("exp", Load("in0", i, F32), F32), f(0.5)))
    return Kernel(
        "elementwise",
        (Buffer("in0", F32, n), Buffer("out0", F32, n, role="out")),
        (grid, 1, 1), (block, 1, 1),
        (Assign(i, add(mul(BID, c(block)), TID)), If(guard if guard is not None else lt(i, c(n)), (body,))),
    )


def block_sum(rows: int = 3, length: int = 300, block: int = 64) -> Kernel:
    """One block per row: strided partial sums, then a tree in shared memory whose halving
    steps run in a uniform loop with a barrier per step."""
    acc, j, t, s = v("acc", F32), v("j"), v("t"), v("s")
    steps = block.bit_length() - 1
    tree = For(t, c(0), c(steps), 1, (
        Assign(s, b("shr", c(block // 2), t)),
        If(lt(TID, s), (Store("buf", TID, b("add", Load("buf", TID, F32), Load("buf", add(TID, s), F32))),)),
        Barrier(),
    ))
    body = (
        Assign(acc, f(0)),
        For(j, TID, c(length), block, (Assign(acc, b("add", acc, Load("in0", add(mul(BID, c(length)), j), F32))),)),
        Store("buf", TID, acc),
        Barrier(),
        tree,
        If(b("eq", TID, c(0)), (Store("out0", BID, Load("buf", c(0), F32)),)),
    )
    return Kernel(
        "block_sum",
        (Buffer("in0", F32, rows * length), Buffer("out0", F32, rows, role="out")),
        (rows, 1, 1), (block, 1, 1), body,
        shared=(Buffer("buf", F32, block, "shared"),),
    )


def warp_sum(rows: int = 2, length: int = 100, block: int = 128) -> Kernel:
    """One block per row: warp sums, one partial per warp in shared memory, then the first
    warp reduces the partials (a warp reduction under the warp-uniform ``tid.x < 32``)."""
    acc, j, p, w, r = v("acc", F32), v("j"), v("p", F32), v("w", F32), v("r", F32)
    warps = block // 32
    first = (
        Assign(w, Select(lt(TID, c(warps)), Load("part", b("minimum", TID, c(warps - 1)), F32), f(0), F32)),
        WarpReduce(r, "sum", w),
        If(b("eq", TID, c(0)), (Store("out0", BID, r),)),
    )
    body = (
        Assign(acc, f(0)),
        For(j, TID, c(length), block, (Assign(acc, b("add", acc, Load("in0", add(mul(BID, c(length)), j), F32))),)),
        WarpReduce(p, "sum", acc),
        If(b("eq", b("fmod", TID, c(32)), c(0)), (Store("part", b("div", TID, c(32)), p),)),
        Barrier(),
        If(lt(TID, c(32)), first),
    )
    return Kernel(
        "warp_sum",
        (Buffer("in0", F32, rows * length), Buffer("out0", F32, rows, role="out")),
        (rows, 1, 1), (block, 1, 1), body,
        shared=(Buffer("part", F32, warps, "shared"),),
    )


def tiled_matmul(m: int = 32, n: int = 32, k: int = 32, tile: int = 16) -> Kernel:
    """``C = A @ B`` with square tiles of A and B staged through shared memory."""
    row, col, acc, k0, kk = v("row"), v("col"), v("acc", F32), v("k0"), v("kk")
    sidx = add(mul(TIDY, c(tile)), TID)
    inner = For(kk, c(0), c(tile), 1, (
        Assign(acc, b("add", acc, b("mul", Load("As", add(mul(TIDY, c(tile)), kk), F32),
                                    Load("Bs", add(mul(kk, c(tile)), TID), F32)))),
    ), unroll=True)
    body = (
        Assign(row, add(mul(BIDY, c(tile)), TIDY)),
        Assign(col, add(mul(BID, c(tile)), TID)),
        Assign(acc, f(0)),
        For(k0, c(0), c(k), tile, (
            Store("As", sidx, Load("A", add(add(mul(row, c(k)), k0), TID), F32)),
            Store("Bs", sidx, Load("B", add(mul(add(k0, TIDY), c(n)), col), F32)),
            Barrier(),
            inner,
            Barrier(),
        )),
        Store("C", add(mul(row, c(n)), col), acc),
    )
    return Kernel(
        "tiled_matmul",
        (Buffer("A", F32, m * k), Buffer("B", F32, k * n), Buffer("C", F32, m * n, role="out")),
        (n // tile, m // tile, 1), (tile, tile, 1), body,
        shared=(Buffer("As", F32, tile * tile, "shared"), Buffer("Bs", F32, tile * tile, "shared")),
    )


# -- interpreter ---------------------------------------------------------------------------------
Memory = dict[str, list]


def _thread(stmts: tuple[Stmt, ...], regs: dict, mem: Memory) -> Generator:
    def load(buf: str, i: int) -> object:
        if not 0 <= i < len(mem[buf]):
            raise IndexError(f"load {buf}[{i}] out of bounds")
        return mem[buf][i]

    def ev(e: Expr) -> object:
        return eval_expr(e, regs, load)

    for s in stmts:
        if isinstance(s, Assign):
            regs[s.var.name] = ev(s.value)
        elif isinstance(s, Store):
            i = ev(s.index)
            if not 0 <= i < len(mem[s.buffer]):
                raise IndexError(f"store {s.buffer}[{i}] out of bounds")
            mem[s.buffer][i] = ev(s.value)
        elif isinstance(s, For):
            for it in range(ev(s.start), ev(s.stop), s.step):
                regs[s.var.name] = it
                yield from _thread(s.body, regs, mem)
            regs.pop(s.var.name, None)
        elif isinstance(s, If):
            yield from _thread(s.then if ev(s.cond) else s.orelse, regs, mem)
        elif isinstance(s, Barrier):
            yield ("barrier",)
        elif isinstance(s, WarpReduce):
            regs[s.var.name] = yield ("warp", s.op, s.width, s.var.dtype, ev(s.value))


def _reduce(op: str, dtype: DType, values: list) -> object:
    out = values[0]
    for x in values[1:]:
        if op == "sum":
            out = eval_expr(Binary("add", Const(out, dtype), Const(x, dtype), dtype))
        elif op == "prod":
            out = eval_expr(Binary("mul", Const(out, dtype), Const(x, dtype), dtype))
        else:
            out = max(out, x) if op == "max" else min(out, x)
    return out


def run_kernel(kernel: Kernel, memory: Memory) -> Memory:
    """Run ``kernel`` on copies of ``memory`` (buffer name -> list of values); returns them."""
    mem = {k: list(vals) for k, vals in memory.items()}
    bx, by, bz = kernel.block
    for bid in itertools.product(*(range(g) for g in reversed(kernel.grid))):
        block_mem = mem | {s.name: [0] * s.size for s in kernel.shared}
        threads = {}
        for lin, tid in enumerate(itertools.product(range(bz), range(by), range(bx))):
            regs = {f"tid.{a}": t for a, t in zip("zyx", tid)} | {f"bid.{a}": g for a, g in zip("zyx", bid)}
            regs |= {f"bdim.{a}": d for a, d in zip("xyz", kernel.block)}
            regs |= {f"gdim.{a}": d for a, d in zip("xyz", kernel.grid)}
            tmem = block_mem | {loc.name: [0] * loc.size for loc in kernel.local}
            threads[lin] = _thread(kernel.body, regs, tmem)
        _schedule(threads)
    return mem


def _schedule(threads: dict[int, Generator]) -> None:
    waiting: dict[int, tuple] = {}
    sends: dict[int, object] = dict.fromkeys(threads)
    while sends or waiting:
        for lin, msg in sends.items():
            with contextlib.suppress(StopIteration):
                waiting[lin] = threads[lin].send(msg)
        sends = {}
        warp = {lin: y for lin, y in waiting.items() if y[0] == "warp"}
        for lin, (_, op, width, dtype, _) in sorted(warp.items()):
            group = range(lin - lin % width, lin - lin % width + width)
            if lin in sends or not all(g in warp for g in group):
                continue
            result = _reduce(op, dtype, [warp[g][4] for g in group])
            for g in group:
                sends[g] = result
                del waiting[g]
        if sends:
            continue
        if waiting and all(y[0] == "barrier" for y in waiting.values()):
            live = {lin for lin in threads if threads[lin].gi_frame is not None}
            if set(waiting) != live:
                raise RuntimeError("barrier not reached by every thread")
            sends, waiting = dict.fromkeys(waiting), {}
        elif waiting:
            raise RuntimeError(f"deadlock: {sorted(set(y[0] for y in waiting.values()))}")
