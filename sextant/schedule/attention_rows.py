"""Fused attention, one query row per thread: the GPU's mapping when tensor cores do not apply
(f32, a head size that is not a multiple of 16, GPUs before sm_80). Simple and general; the
CPU has its own loop nest (``cpu_attention``).

A thread owns query row ``i`` of one batch/head and streams the keys past it in tiles of ``T``
with an *online softmax* (Milakov & Gimelshein 2018; FlashAttention): it keeps the running
row max ``m``, the running sum ``l`` of ``exp(z - m)`` and the unnormalised output
``o = Σ exp(z_j - m)·v_j``; a new tile with a larger max rescales both by ``exp(m_old - m)``.
Per tile::

    z[jj]  = f(q · k_j)                the logits: the scores through the fused scale/mask ops
    m'     = max(m, max_jj z[jj])      (0 stands in for a max of -inf: a row masked so far)
    l, o  *= exp(m - m')
    p[jj]  = exp(z[jj] - m');  l += p[jj];  o += p[jj] · v_j
    out    = o / l                     (0 for a fully masked row when the graph asks for it)

Neither the score nor the probability matrix is ever stored: memory traffic is Q, K, V and the
output, and the scratch is ``E + T + Ev`` values per thread. On the CPU a block walks a chunk of
rows with plain loops; the dot product keeps vector-width partial sums (``_lane_split``) and
the ``o`` update is a contiguous loop over the value's head dim, both vectorised by LLVM.
"""

from __future__ import annotations

import math

from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    Binary,
    Buffer,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    Select,
    Special,
    Store,
    Unary,
    Var,
)
from sextant.schedule.attention_match import at
from sextant.schedule.indexing import accum_dtype, c, iadd, idiv, imin, imod, imul
from sextant.schedule.kernels import _chunks, _lane_split, _loop, _row_loop, reduce_lanes, setup_kernel, store_epilogue
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc

CPU_TILE = 128  # keys per tile on the CPU: the logits of a tile stay in L1
GPU_TILE = 32  # ... on the GPU (per-thread local memory)
GPU_THREADS = 128


def rows_attention_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    att = group.attention
    assert att is not None, "an attention group carries its matched chain"
    e, params, _ = setup_kernel(group, stored)
    q, kt, v, out = att.q, att.kt, att.v, att.out
    *batch, n_q, dim = q.shape
    n_kv, dim_v = kt.shape[-1], v.shape[-1]
    rows = math.prod(batch) * n_q
    acc_t = accum_dtype(att.logits.dtype)
    dot_t = accum_dtype(att.scores.dtype)
    tile = min(n_kv, GPU_TILE if target.is_gpu else CPU_TILE)
    lanes = 1 if target.is_gpu else reduce_lanes(target, dot_t, dim)
    local = [Buffer("qv", dot_t, dim, "local"), Buffer("zt", acc_t, tile, "local"),
             Buffer("ov", acc_t, dim_v, "local")]
    if lanes > 1:
        local.append(Buffer("dl", dot_t, lanes, "local"))
    neg_inf = Const(-math.inf, acc_t)
    half_p = att.probs.dtype if att.probs.dtype != acc_t else None  # P rounded as the product reads it

    def loop(n: int, body, prefix: str, start: Expr | None = None, stop: Expr | None = None) -> None:
        _loop(e, n, body, prefix, start=start, stop=stop)

    def row(r: Expr) -> None:
        bl = e.bind(idiv(r, n_q), "b") if batch else c(0)
        i = e.bind(imod(r, n_q), "i") if batch else r
        loop(dim, lambda d: e.emit(Store("qv", d, _as(e.value(q, at(q, bl, i, d)), dot_t))), "d")
        loop(dim_v, lambda d: e.emit(Store("ov", d, Const(0.0, acc_t))), "d")
        m, s = e.var("m", acc_t), e.var("l", acc_t)
        e.emit(Assign(m, neg_inf))
        e.emit(Assign(s, Const(0.0, acc_t)))

        def kv_tile(j0: Var) -> None:
            tmax = e.var("tmax", acc_t)
            e.emit(Assign(tmax, neg_inf))

            def logit(jj: Var) -> None:
                j = e.bind(iadd(j0, jj), "j")
                valid = Binary("lt", j, c(n_kv), DType.bool)
                if n_kv % tile:  # the last tile's keys past the end: read the last key, then mask it
                    j = e.bind(imin(j, c(n_kv - 1)), "j")

                def term(d: Expr) -> Expr:
                    return Binary("mul", Load("qv", d, dot_t), _as(e.value(kt, at(kt, bl, d, j)), dot_t), dot_t)

                dot = e.var("dot", dot_t)
                e.emit(Assign(dot, Const(0.0, dot_t)))
                if lanes > 1:
                    _lane_split(e, "dl", lanes, dim, dot, "sum", dot_t, term)
                else:
                    loop(dim, lambda d: e.emit(Assign(dot, Binary("add", dot, term(d), dot_t))), "d")
                e.regs[id(att.scores)] = e.bind(Cast(dot, att.scores.dtype)) if dot_t != att.scores.dtype else dot
                z = _as(e.value(att.logits, at(att.logits, bl, i, j)), acc_t)
                e.regs.pop(id(att.scores))
                if n_kv % tile:
                    z = e.bind(Select(valid, z, neg_inf, acc_t), "z")
                e.emit(Store("zt", jj, z))
                e.emit(Assign(tmax, Binary("maximum", tmax, z, acc_t)))

            loop(tile, logit, "jj")
            m_new = e.bind(Binary("maximum", m, tmax, acc_t), "mn")
            # a row masked so far keeps m = -inf: shift by 0 then, so exp gives 0, not NaN
            shift = e.bind(Select(Binary("eq", m_new, neg_inf, DType.bool), Const(0.0, acc_t), m_new, acc_t), "sh")
            corr = e.bind(Unary("exp", Binary("sub", m, shift, acc_t), acc_t), "corr")
            e.emit(Assign(s, Binary("mul", s, corr, acc_t)))
            loop(dim_v, lambda d: e.emit(Store("ov", d, Binary("mul", Load("ov", d, acc_t), corr, acc_t))), "d")

            def accumulate(jj: Var) -> None:
                p = e.bind(Unary("exp", Binary("sub", Load("zt", jj, acc_t), shift, acc_t), acc_t), "p")
                e.emit(Assign(s, Binary("add", s, p, acc_t)))
                if half_p is not None:
                    p = e.bind(Cast(Cast(p, half_p), acc_t), "p")
                j = iadd(j0, jj)

                def update(d: Var) -> None:
                    pv = Binary("mul", p, _as(e.value(v, at(v, bl, j, d)), acc_t), acc_t)
                    e.emit(Store("ov", d, Binary("add", Load("ov", d, acc_t), pv, acc_t)))

                if n_kv % tile:
                    with e.scope() as body:
                        loop(dim_v, update, "d")
                    e.emit(If(Binary("lt", j, c(n_kv), DType.bool), tuple(body)))
                else:
                    loop(dim_v, update, "d")

            loop(tile, accumulate, "jj")
            e.emit(Assign(m, m_new))

        j0 = e.var("j0")
        with e.scope() as body:
            kv_tile(j0)
        # causal: keys past the query are masked, so the loop stops at the query's own tile
        stop = e.bind(imin(iadd(i, c(1)), c(n_kv)), "kend") if att.causal else c(n_kv)
        e.emit(For(j0, c(0), stop, tile, tuple(body)))
        inv = e.bind(Binary("div", Const(1.0, acc_t), s, acc_t), "inv")
        if att.guarded:  # where(m == -inf, 0, .): a row the mask hides entirely
            inv = e.bind(Select(Binary("eq", m, neg_inf, DType.bool), Const(0.0, acc_t), inv, acc_t), "inv")

        def store(d: Var) -> None:
            val = Binary("mul", Load("ov", d, acc_t), inv, acc_t)
            e.regs[id(out)] = e.bind(_as(val, out.dtype), "o")
            store_epilogue(e, group, at(out, bl, i, d))
            e.regs.pop(id(out))

        loop(dim_v, store, "d")

    meta = {"mapping": "attention-rows", "kv_tile": tile}
    if target.is_gpu:
        r = e.bind(iadd(imul(Special("bid", "x"), GPU_THREADS), Special("tid", "x")), "r")
        with e.scope() as body:
            row(r)
        e.emit(If(Binary("lt", r, c(rows), DType.bool), tuple(body)))
        return Kernel(name, tuple(params), (-(-rows // GPU_THREADS), 1, 1), (GPU_THREADS, 1, 1), tuple(e.stmts),
                      local=tuple(local), meta=meta)
    blocks, per = _chunks(rows, target, 4 * n_kv * (dim + dim_v))
    _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), local=tuple(local), meta=meta)


def _as(x: Expr, dt: DType) -> Expr:
    return x if x.dtype == dt else Cast(x, dt)

