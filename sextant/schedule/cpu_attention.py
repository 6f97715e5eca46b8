"""Fused attention on the CPU: a flash-attention loop nest shaped for vector registers.

A block walks a chunk of *row blocks* — two GEMM micro-tiles' worth of query rows of one
batch/head — and streams the keys and values past them in tiles (``key_tile``: 64–256 keys)
with an *online softmax* (Milakov & Gimelshein 2018; FlashAttention): each row keeps its
running max ``m``, the running sum ``l`` of ``exp(z - m)`` and its unnormalised output
``o = Σ exp(z_j - m)·v_j``; a tile with a larger max rescales both by ``exp(m_old - m_new)``
(0 stands in for a max of -inf, a row masked so far), and the row is divided by ``l`` at the
end (0 for a fully masked row when the graph asks for it). What makes it fast on a CPU:

* The K tile is staged **transposed** (``Kt[d][jj]``) and the V tile as is (``Vt[jj][d]``), once
  per row block, so its rows reuse them from cache and both products are the CPU GEMM's
  micro-kernel (``cpu_gemm``): ``S[r][0:nr] += q[r][d] · Kt[d][0:nr]`` and
  ``O[r][0:nr] += P[r][jj] · Vt[jj][0:nr]`` on ``mr × nr`` accumulators that LLVM keeps in vector
  registers (a constant-indexed local array in fully unrolled loops).
* Per row, the logits (the fused scale and masks, per element from the score) are one loop,
  ``exp`` another (vectorised), and the row max and sum vector-width partials (``_lane_split``);
  the running max/sum, the rescale factors and the output rows of the block are small local arrays.

Keys past the end are read as the last key and masked (their values staged as 0); rows past the
end are computed from the last row and never stored. A causal mask stops each row block at its
diagonal tile; a tile that a boolean mask hides from every row of the block (``Attention.masks``:
a decode step's keys past its position, padding) is skipped after one pass over the mask.
"""

from __future__ import annotations

import math

from sextant.graph.dtypes import DType
from sextant.graph.symbolic import SymDim
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
    Store,
    Unary,
    Var,
)
from sextant.kernel.sizes import capacity
from sextant.schedule.attention_match import at
from sextant.schedule.indexing import accum_dtype, c, divisible, iadd, idiv, imin, imod, imul
from sextant.schedule.kernels import (
    _chunks,
    _lane_split,
    _loop,
    _row_loop,
    micro_tile,
    narrow_columns,
    reduce_lanes,
    setup_kernel,
    store_epilogue,
)
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc

TILE_BYTES = 64 * 1024  # the staged K and V tiles of a row block together (measured, see key_tile)
KEY_TILES = (256, 128, 64)  # keys per tile, longest first


def key_tile(dim: int, dim_v: int) -> int:
    """Keys per tile: the most of 256, 128, 64 whose staged K and V tiles fit ``TILE_BYTES``.
    Longer tiles amortise each tile's softmax rescale over more keys, which is what small heads
    pay for; past that size the K tile's rows alias in L1. Measured on 2 Zen 5 cores, non-causal
    SDPA: heads of 8 (UNet, 2×8×256) 0.91 ms at 64 keys → 0.64 at 256; 32 (wav2vec2, 2×4×199)
    0.60 → 0.40; 64 (12×512) 7.0 at 64 and 128, 19.5 at 256; 128 (8×1024) 29 at 64, 53 at 128."""
    for keys in KEY_TILES:
        if keys * (dim + dim_v) * 4 <= TILE_BYTES:
            return keys
    return KEY_TILES[-1]


def _micro_gemm(e, rows: int, cols: int, depth: int, a, b, init, store, acc_t: DType) -> None:
    """``store(r, u, init(r, u) + Σ_k a(r, k)·b(k, u))`` for a ``rows × cols`` register tile: the
    CPU GEMM's micro-kernel (``cpu_gemm``) — accumulators in a constant-indexed local array,
    per step a row of B against one broadcast of A per row, every loop but the depth unrolled."""
    loop = _loop
    for r in range(rows):
        loop(e, cols, lambda u, r=r: e.emit(Store("acc", iadd(c(r * cols), u), init(r, u))), "u", unroll=True)

    def step(k: Var) -> None:  # row by row, one value of A live at a time (see cpu_gemm's kstep)
        for r in range(rows):
            av = e.bind(a(r, k), "a")

            def col(u: Var, r: int = r, av: Expr = av) -> None:
                slot = iadd(c(r * cols), u)
                e.emit(Store("acc", slot, Binary("add", Load("acc", slot, acc_t),
                                                 Binary("mul", av, b(k, u), acc_t), acc_t)))

            loop(e, cols, col, "u", unroll=True)

    loop(e, depth, step, "k")
    for r in range(rows):
        loop(e, cols, lambda u, r=r: store(r, u, Load("acc", iadd(c(r * cols), u), acc_t)), "u", unroll=True)


def cpu_attention_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    att = group.attention
    assert att is not None, "an attention group carries its matched chain"
    e, params, _ = setup_kernel(group, stored)
    q, kt, v, out = att.q, att.kt, att.v, att.out
    *batch, n_q, dim = q.shape
    n_kv, dim_v = kt.shape[-1], v.shape[-1]
    acc_t = accum_dtype(att.logits.dtype)
    dot_t = accum_dtype(att.scores.dtype)
    mr, nr = micro_tile(target)
    # over symbolic lengths the tiles are chosen for the longest (ragged rows and keys always guarded)
    n_q_most, n_kv_most = capacity(n_q), capacity(n_kv)
    rg = min(mr, n_q_most)  # rows per register tile; a row block is two of them
    br = min(2 * rg, -(-n_q_most // rg) * rg)
    nk = nr if n_kv_most >= nr else narrow_columns(n_kv_most, nr) if divisible(n_kv, 4) else nr
    nv = narrow_columns(dim_v, nr)
    dvp = -(-dim_v // nv) * nv  # value rows padded to whole register-tile widths
    # over a symbolic key count every tile computes all its keys (past n_kv masked): the shortest
    # tile keeps short sequences cheap (GPT-2 2-layer at 1 token: 2.2 → 0.7 ms with 64 for 256 keys)
    keys = KEY_TILES[-1] if isinstance(n_kv, SymDim) else key_tile(dim, dvp)
    tile = keys if n_kv_most >= keys else -(-n_kv_most // nk) * nk  # keys past n_kv are masked
    lanes = reduce_lanes(target, acc_t, tile)
    n_qb = -(-n_q // br)
    blocks_total = math.prod(batch) * n_qb
    local = (Buffer("qb", dot_t, br * dim, "local"), Buffer("kt", dot_t, dim * tile, "local"),
             Buffer("vt", acc_t, tile * dvp, "local"), Buffer("zt", acc_t, br * tile, "local"),
             Buffer("ob", acc_t, br * dvp, "local"), Buffer("acc", acc_t, rg * max(nk, nv), "local"),
             Buffer("mb", acc_t, br, "local"), Buffer("lb", acc_t, br, "local"), Buffer("cb", acc_t, br, "local"),
             Buffer("red", acc_t, lanes, "local"))
    neg_inf, zero = Const(-math.inf, acc_t), Const(0.0, acc_t)
    half_p = att.probs.dtype if att.probs.dtype != acc_t else None  # P rounded as the product reads it
    ragged_kv = not divisible(n_kv, tile)

    def loop(n: int, body, prefix: str, *, start: Expr | None = None, stop: Expr | None = None,
             unroll: bool = False) -> None:
        _loop(e, n, body, prefix, start=start, stop=stop, unroll=unroll)

    def as_(x: Expr, dt: DType) -> Expr:
        return x if x.dtype == dt else Cast(x, dt)

    def row_block(rb: Var) -> None:
        bl = e.bind(idiv(rb, n_qb), "b") if batch else c(0)
        i0 = e.bind(imul(imod(rb, n_qb), br), "i0")

        def row_of(r: Expr) -> Expr:  # rows past the end compute the last row's values, never stored
            return e.bind(iadd(i0, r), "i") if divisible(n_q, br) else e.bind(imin(iadd(i0, r), c(n_q - 1)), "i")

        def query_row(r: Var) -> None:
            i = row_of(r)
            loop(dim, lambda d: e.emit(Store("qb", iadd(imul(r, dim), d), as_(e.value(q, at(q, bl, i, d)), dot_t))),
                 "d")
            e.emit(Store("mb", r, neg_inf))
            e.emit(Store("lb", r, zero))
            loop(dvp, lambda d: e.emit(Store("ob", iadd(imul(r, dvp), d), zero)), "d")

        loop(br, query_row, "r")

        def kv_tile(j0: Var) -> None:
            def stage(jj: Var) -> None:
                j = e.bind(iadd(j0, jj), "j")
                valid = Binary("lt", j, c(n_kv), DType.bool)
                jc = e.bind(imin(j, c(n_kv - 1)), "jc") if ragged_kv else j
                loop(dim, lambda d: e.emit(Store("kt", iadd(imul(d, tile), jj), as_(e.value(kt, at(kt, bl, d, jc)),
                                                                                     dot_t))), "d")

                def v_elem(d: Var) -> None:
                    val = as_(e.value(v, at(v, bl, jc, d)), acc_t)
                    if ragged_kv:  # a key past the end contributes 0, even against an inf value
                        val = Select(valid, val, zero, acc_t)
                    e.emit(Store("vt", iadd(imul(jj, dvp), d), val))

                loop(dim_v, v_elem, "d")
                for d in range(dim_v, dvp):
                    e.emit(Store("vt", iadd(imul(jj, dvp), c(d)), zero))

            loop(tile, stage, "jj")

            # S = Q·Kᵀ for the row block, a register tile of rg rows × nk keys at a time
            def s_tile(r0: int, c0: Var) -> None:
                _micro_gemm(e, rg, nk, dim,
                            lambda r, k: as_(Load("qb", iadd(c((r0 + r) * dim), k), dot_t), acc_t),
                            lambda k, u: as_(Load("kt", iadd(imul(k, tile), iadd(c0, u)), dot_t), acc_t),
                            lambda r, u: zero,
                            lambda r, u, val: e.emit(Store("zt", iadd(c((r0 + r) * tile), iadd(c0, u)), val)), acc_t)

            for r0 in range(0, br, rg):
                c0 = e.var("c0")
                with e.scope() as body:
                    s_tile(r0, c0)
                e.emit(For(c0, c(0), c(tile), nk, tuple(body)))
            loop(br, lambda r: softmax_row(r, j0), "r")

            # O = O·corr + P·V, a register tile of rg rows × nv value columns at a time
            def o_tile(r0: int, d0: Var) -> None:
                def p(r: int, k: Expr) -> Expr:
                    x = Load("zt", iadd(c((r0 + r) * tile), k), acc_t)
                    return Cast(Cast(x, half_p), acc_t) if half_p is not None else x

                _micro_gemm(e, rg, nv, tile, p,
                            lambda k, u: Load("vt", iadd(imul(k, dvp), iadd(d0, u)), acc_t),
                            lambda r, u: Binary("mul", Load("ob", iadd(c((r0 + r) * dvp), iadd(d0, u)), acc_t),
                                                Load("cb", c(r0 + r), acc_t), acc_t),
                            lambda r, u, val: e.emit(Store("ob", iadd(c((r0 + r) * dvp), iadd(d0, u)), val)), acc_t)

            for r0 in range(0, br, rg):
                d0 = e.var("d0")
                with e.scope() as body:
                    o_tile(r0, d0)
                e.emit(For(d0, c(0), c(dvp), nv, tuple(body)))

        def softmax_row(r: Var, j0: Var) -> None:
            """Row r's logits from its scores, the new running max, P = exp(z - max) in place, the
            running sum, and the factor ``cb[r]`` that rescales its output row."""
            i = row_of(r)
            tmax = e.var("tmax", acc_t)
            e.emit(Assign(tmax, neg_inf))
            row = imul(r, tile)

            def logit(jj: Var) -> None:
                j = e.bind(iadd(j0, jj), "j")
                jc = e.bind(imin(j, c(n_kv - 1)), "jc") if ragged_kv else j
                e.regs[id(att.scores)] = e.bind(as_(Load("zt", iadd(row, jj), acc_t), att.scores.dtype), "sc")
                zv = as_(e.value(att.logits, at(att.logits, bl, i, jc)), acc_t)
                e.regs.pop(id(att.scores))
                if ragged_kv:
                    zv = e.bind(Select(Binary("lt", j, c(n_kv), DType.bool), zv, neg_inf, acc_t), "zv")
                e.emit(Store("zt", iadd(row, jj), zv))

            loop(tile, logit, "jj")
            # the row's max and sum as vector-width partials: a sequential chain of 64 dependent
            # max/add ops would cost as much as the tile's whole Q·Kᵀ
            _lane_split(e, "red", lanes, tile, tmax, "max", acc_t, lambda jj: Load("zt", iadd(row, jj), acc_t))
            m = e.bind(Load("mb", r, acc_t), "m")
            m_new = e.bind(Binary("maximum", m, tmax, acc_t), "mn")
            # a row masked so far keeps m = -inf: shift by 0 then, so exp gives 0, not NaN
            sh = e.bind(Select(Binary("eq", m_new, neg_inf, DType.bool), zero, m_new, acc_t), "sh")
            corr = e.bind(Unary("exp", Binary("sub", m, sh, acc_t), acc_t), "corr")
            loop(tile, lambda jj: e.emit(Store("zt", iadd(row, jj), Unary(
                "exp", Binary("sub", Load("zt", iadd(row, jj), acc_t), sh, acc_t), acc_t))), "jj")
            total = e.var("l", acc_t)
            e.emit(Assign(total, Const(0.0, acc_t)))
            _lane_split(e, "red", lanes, tile, total, "sum", acc_t, lambda jj: Load("zt", iadd(row, jj), acc_t))
            e.emit(Store("lb", r, Binary("add", Binary("mul", Load("lb", r, acc_t), corr, acc_t), total, acc_t)))
            e.emit(Store("mb", r, m_new))
            e.emit(Store("cb", r, corr))

        def visible(j0: Var) -> Expr:
            """Whether any row of the block sees a key of the tile (``att.masks``): a tile all
            its rows hide adds exp(-inf) = 0 to every sum and is skipped — a decode step's keys
            past its position, padding."""
            seen = e.var("seen", DType.bool)
            e.emit(Assign(seen, Const(False, DType.bool)))

            def row(r: Var) -> None:
                i = row_of(r)

                def key(jj: Var) -> None:
                    j = e.bind(iadd(j0, jj), "j")
                    jc = e.bind(imin(j, c(n_kv - 1)), "jc") if ragged_kv else j
                    shown: Expr = Const(True, DType.bool)
                    for mask in att.masks:
                        cond = e.value(mask, at(mask, bl, i, jc))
                        shown = cond if isinstance(shown, Const) else Binary("bitwise_and", shown, cond, DType.bool)
                    if ragged_kv:
                        shown = Binary("bitwise_and", shown, Binary("lt", j, c(n_kv), DType.bool), DType.bool)
                    e.emit(Assign(seen, Binary("bitwise_or", seen, shown, DType.bool)))

                loop(tile, key, "jj")

            loop(br, row, "r")
            return seen

        j0 = e.var("j0")
        with e.scope() as body:
            if att.masks:
                cond = visible(j0)
                with e.scope() as work:
                    kv_tile(j0)
                e.emit(If(cond, tuple(work)))
            else:
                kv_tile(j0)
        # causal: the block's last query is i0 + br - 1, so keys from i0 + br on are all masked
        stop = e.bind(imin(iadd(i0, c(br)), c(n_kv)), "kend") if att.causal else c(n_kv)
        e.emit(For(j0, c(0), stop, tile, tuple(body)))

        def finish(r: Var) -> None:
            i = e.bind(iadd(i0, r), "i")
            with e.scope() as store:
                inv = e.bind(Binary("div", Const(1.0, acc_t), Load("lb", r, acc_t), acc_t), "inv")
                if att.guarded:  # where(m == -inf, 0, .): a row the mask hides entirely
                    inv = e.bind(Select(Binary("eq", Load("mb", r, acc_t), neg_inf, DType.bool), zero, inv, acc_t),
                                 "inv")

                def element(d: Var) -> None:
                    val = Binary("mul", Load("ob", iadd(imul(r, dvp), d), acc_t), inv, acc_t)
                    e.regs[id(out)] = e.bind(as_(val, out.dtype), "o")
                    store_epilogue(e, group, at(out, bl, i, d))
                    e.regs.pop(id(out))

                loop(dim_v, element, "d")
            if not divisible(n_q, br):
                e.emit(If(Binary("lt", i, c(n_q), DType.bool), tuple(store)))
            else:
                e.stmts.extend(store)

        loop(br, finish, "r")

    blocks, per = _chunks(blocks_total, target, 2 * br * n_kv * (dim + dim_v))
    _row_loop(e, blocks_total, per, row_block)
    meta = {"mapping": "attention-cpu-flash", "rows": br, "kv_tile": tile, "skips_hidden_tiles": bool(att.masks)}
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), local=local, meta=meta)
