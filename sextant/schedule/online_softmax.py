"""A flash attention's online softmax on score accumulators in registers: one key tile, and the
normalisation and stores after the last.

Both tensor-core attention kernels hold a tile's scores in the accumulator layout that
``mma.sync``'s m16n8 C fragment and ``wgmma``'s D fragment share per warp: slot ``i`` of a
thread is row ``g + 8·((i >> 1) & 1)`` (``g = lane / 4``) and key ``8·(i >> 2) + 2·(lane % 4) +
(i & 1)`` of the tile. So one routine serves both: the fused logit ops per slot at its
``(row, key)``, each row's max over the quad of lanes that holds it (a width-4 butterfly), the
running max ``m`` and sum ``l`` updated and the output accumulators rescaled by
``exp(m_old − m_new)``, then ``P = exp(z − m)`` cast to the operand type into the slots that are
the A fragment of ``P·V`` (``kernel.fragments`` / ``kernel.wgmma.a_coord``).
"""

from __future__ import annotations

import math

from sextant.graph.dtypes import DType
from sextant.graph.symbolic import Dim
from sextant.kernel.ir import Assign, Binary, Cast, Const, Expr, Load, Select, Store, Unary, Var, WarpReduce
from sextant.schedule.attention_match import Attention, at
from sextant.schedule.gpu_kernels import _bool, _guarded
from sextant.schedule.indexing import ValueEmitter, c, iadd, imin
from sextant.schedule.kernels import store_epilogue
from sextant.schedule.partition import Group


def online_softmax(e: ValueEmitter, att: Attention, bz: Expr, rows: list[Expr], tq: Expr, j0: Expr,
                   ragged: int | None, scores: str, n_scores: int, out: str, n_out: int, m: list[Var],
                   s: list[Var], probs: str, dt: DType) -> None:
    """Tile ``j0``'s ``n_scores`` score slots in ``scores`` → logits (in place) → probabilities in
    ``probs`` (``dt``); ``m``/``s``: the running max and lane-partial sum of this thread's two rows
    ``rows`` (clamped for the logit ops' loads); ``out``'s ``n_out`` slots are rescaled; ``ragged``:
    the key count when keys past it in this tile must be hidden."""
    acc_t = DType.f32
    zero, neg_inf = Const(0.0, acc_t), Const(-math.inf, acc_t)
    tmax = [e.var("tmax", acc_t) for _ in range(2)]
    for h in range(2):
        e.emit(Assign(tmax[h], neg_inf))
    for i in range(n_scores):  # the logits, in place, and this lane's row maxima
        h = (i >> 1) & 1
        col = e.bind(iadd(iadd(j0, tq), c(8 * (i >> 2) + (i & 1))), "key")
        z = logit(e, att, bz, rows[h], col, Load(scores, c(i), acc_t), ragged)
        e.emit(Store(scores, c(i), z))
        e.emit(Assign(tmax[h], Binary("maximum", tmax[h], z, acc_t)))
    shift = []
    for h in range(2):
        full = e.var("tm", acc_t)
        e.emit(WarpReduce(full, "max", tmax[h], 4))  # the quad holding row g (+8)
        m_new = e.bind(Binary("maximum", m[h], full, acc_t), "mn")
        sh = e.bind(Select(Binary("eq", m_new, neg_inf, DType.bool), zero, m_new, acc_t), "sh")
        corr = e.bind(Unary("exp", Binary("sub", m[h], sh, acc_t), acc_t), "corr")
        e.emit(Assign(s[h], Binary("mul", s[h], corr, acc_t)))
        for i in range(n_out):
            if (i >> 1) & 1 == h:
                e.emit(Store(out, c(i), Binary("mul", Load(out, c(i), acc_t), corr, acc_t)))
        e.emit(Assign(m[h], m_new))
        shift.append(sh)
    for i in range(n_scores):  # P = exp(z - m): the A fragments of P·V (same lanes, same slots)
        h = (i >> 1) & 1
        p_val = e.bind(Unary("exp", Binary("sub", Load(scores, c(i), acc_t), shift[h], acc_t), acc_t), "p")
        e.emit(Assign(s[h], Binary("add", s[h], p_val, acc_t)))
        e.emit(Store(probs, c(i), Cast(p_val, dt)))


def normalized_stores(e: ValueEmitter, att: Attention, group: Group, bz: Expr, rows: list[Expr], tq: Expr,
                      out: str, n_out: int, s: list[Var], m: list[Var], n_q: Dim | None) -> None:
    """The end of the key loop: each row's sum over its quad, ``O / l`` (0 for a row the mask
    hides entirely when the graph asks for it), cast, and the group's fused epilogue stored at
    each of ``out``'s ``n_out`` slots' ``(row, column)``; ``n_q``: guard the rows past it."""
    acc_t = DType.f32
    zero, neg_inf = Const(0.0, acc_t), Const(-math.inf, acc_t)
    node = att.out
    inv = []
    for h in range(2):
        total = e.var("lsum", acc_t)
        e.emit(WarpReduce(total, "sum", s[h], 4))
        r = e.bind(Binary("div", Const(1.0, acc_t), total, acc_t), "inv")
        if att.guarded:  # where(m == -inf, 0, .): a row the mask hides entirely
            r = e.bind(Select(Binary("eq", m[h], neg_inf, DType.bool), zero, r, acc_t), "inv")
        inv.append(r)
    for i in range(n_out):
        h = (i >> 1) & 1
        col = e.bind(iadd(tq, c(8 * (i >> 2) + (i & 1))), "dcol")

        def store(h: int = h, col: Expr = col, i: int = i) -> None:
            val = Binary("mul", Load(out, c(i), acc_t), inv[h], acc_t)
            e.regs[id(node)] = e.bind(val if node.dtype == acc_t else Cast(val, node.dtype), "o")
            store_epilogue(e, group, at(node, bz, rows[h], col))
            e.regs.pop(id(node))

        _guarded(e, None if n_q is None else _bool("lt", rows[h], c(n_q)), store)

def logit(e: ValueEmitter, att: Attention, bz: Expr, row: Expr, key: Expr, score: Expr, n_kv: int | None) -> Expr:
    """``Z`` at ``(row, key)`` from the score accumulator: the fused scale/mask ops; with ``n_kv``
    (the ragged tile), -inf past the last key (whose loads read the last key instead)."""
    acc_t = DType.f32
    valid = None
    if n_kv is not None:
        valid = e.bind(_bool("lt", key, c(n_kv)), "kin")
        key = e.bind(imin(key, c(n_kv - 1)), "kc")
    sc = att.scores
    e.regs[id(sc)] = e.bind(score if sc.dtype == acc_t else Cast(score, sc.dtype), "sc")
    z = e.value(att.logits, at(att.logits, bz, row, key))
    e.regs.pop(id(sc))
    z = z if z.dtype == acc_t else e.bind(Cast(z, acc_t), "z")
    if valid is not None:
        z = e.bind(Select(valid, z, Const(-math.inf, acc_t), acc_t), "z")
    return z
