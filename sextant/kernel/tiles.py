"""A :class:`~sextant.kernel.ir.TileMatmul` as ordinary kernel IR: pair dots in loops.

A CPU without AMX — and the checked and counting builds, which look at one element at a time —
runs a tile matmul as what it means: zero the result, then for each pair of K and each row, one
:class:`~sextant.kernel.ir.PairDot` per strip of 16 columns (``vdpbf16ps`` where the CPU has
AVX-512-BF16, f32 arithmetic lane by lane elsewhere). This is also the statement's reference
semantics: a schedule that emits tile matmuls is tested on every machine through it, and on an
AMX machine the native tiles are compared against eager besides.
"""

from __future__ import annotations

import dataclasses
import itertools

from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    TILE_ROWS,
    Const,
    For,
    If,
    Kernel,
    Load,
    PairDot,
    Stmt,
    Store,
    TileMatmul,
    Var,
    add,
    c,
    mul,
)


def expand_tile_matmul(s: TileMatmul, prefix: str) -> tuple[Stmt, ...]:
    """The loops computing ``s`` (their variables named ``prefix`` + ``u``/``kp``/``r``)."""
    u, kp, r = Var(prefix + "u"), Var(prefix + "kp"), Var(prefix + "r")
    zero = For(u, c(0), c(s.rows * s.cols), 1, (Store(s.out, u, Const(0.0, DType.f32)),), True)
    a0 = add(add(s.a_off, mul(r, c(s.a_stride))), mul(kp, c(2)))
    lo, hi = Load(s.a, a0, DType.bf16), Load(s.a, add(a0, c(1)), DType.bf16)
    dots = tuple(PairDot(s.out, add(mul(r, c(s.cols)), c(TILE_ROWS * t)), lo, hi, s.b,
                         add(add(s.b_off, c(s.b_tile_stride * t)), mul(kp, c(2 * TILE_ROWS))), TILE_ROWS)
                 for t in range(s.col_tiles))
    rows = For(r, c(0), c(s.rows), 1, dots)
    return zero, For(kp, c(0), c(s.k // 2), 1, (rows,))


def expand_tiles(kernel: Kernel) -> Kernel:
    """``kernel`` with every tile matmul expanded (:func:`expand_tile_matmul`); unchanged without any."""
    counter = itertools.count()
    changed = False

    def block(stmts: tuple[Stmt, ...]) -> tuple[Stmt, ...]:
        nonlocal changed
        out: list[Stmt] = []
        for s in stmts:
            if isinstance(s, TileMatmul):
                changed = True
                out.extend(expand_tile_matmul(s, f"tm{next(counter)}_"))
            elif isinstance(s, For):
                out.append(dataclasses.replace(s, body=block(s.body)))
            elif isinstance(s, If):
                out.append(dataclasses.replace(s, then=block(s.then), orelse=block(s.orelse)))
            else:
                out.append(s)
        return tuple(out)

    body = block(kernel.body)
    return dataclasses.replace(kernel, body=body) if changed else kernel
