"""Fused attention on the CPU: a flash-attention loop nest shaped for vector registers.

A block owns a *chunk* of one batch/head's query rows (up to ``CHUNK_ROWS``; fewer where the
heads alone would leave a core without two blocks), walked in *row blocks* of two GEMM
micro-tiles' worth of rows, and streams the keys and values past them in tiles (``key_tile``:
64–256 keys) with an *online softmax* (Milakov & Gimelshein 2018; FlashAttention): each row keeps
its running max ``m``, the running sum ``l`` of ``exp(z - m)`` and its unnormalised output
``o = Σ exp(z_j - m)·v_j``; a tile with a larger max rescales both by ``exp(m_old - m_new)``
(0 stands in for a max of -inf, a row masked so far), and the row is divided by ``l`` at the
end (0 for a fully masked row when the graph asks for it). What makes it fast on a CPU:

* The K tile is staged **transposed** (``Kt[d][jj]``) and the V tile as is (``Vt[jj][d]``),
  **once per chunk** — every row block of the chunk then takes the tile (the loop over key tiles
  is outside the loop over row blocks, the rows' running state is per chunk) — and both products
  are the CPU GEMM's micro-kernel (``cpu_gemm``): ``S[r][0:nr] += q[r][d] · Kt[d][0:nr]`` and
  ``O[r][0:nr] += P[r][jj] · Vt[jj][0:nr]`` on ``mr × nr`` accumulators that LLVM keeps in vector
  registers (a constant-indexed local array in fully unrolled loops). Staged once per row block
  of 12 rows (the order before), the scalar transpose of K cost about as much as the products.
* Per row, two passes over vector-width lanes (``_lane_split``, which the CPU lowering emits as
  vector code): the logits (the fused scale and masks, per element from the score) with their
  max, then ``P = exp(z - m)`` with its sum — exp included, vectorised (LLVM left the plain loop
  over ``exp`` scalar). The running max/sum, the rescale factors and the chunk's output rows are
  local arrays.
* Static key counts are cut into tiles of even length (ViT's 197 keys as 2 × 112, not 128 + 69
  of a 128-key tile).

Measured on 2 Zen 3 cores (AVX2, fp32 SDPA, GFLOP/s, interleaved best-of-24; eager's flash
kernel beside): BERT's 12 heads × 128 × 64 27 → 59–63 (eager 53–83), ViT's 12 × 197 × 64
22 → 57–66 (47–72), 12 × 256 × 64 32 → 67–102 (69–104), 2 × 1024 × 64 → 83–110 (100–122).

In bf16 on a CPU with AVX-512-BF16 (:func:`uses_pair_attention`) both products run on the pair
dot: Q is staged as bf16, K in pairs of head dims (``[dim/2][tile][2]``), V in pairs of keys
(``[tile/2][dvp][2]``), and the softmax pass writes P rounded to bf16 beside its f32 sum.
2 Zen 4 cores, bf16 SDPA, GFLOP/s widened → pairs (eager beside): 12 × 128 × 64 125 → 151 (97),
12 × 197 × 64 106 → 138 (112), causal 12 × 256 × 64 91 → 110 (67). The products' loops are then
a broadcast and two ``vdpbf16ps`` per row; what is left is the staging and the softmax (without
the products the ViT-sized call takes 0.40–0.52 of its 1.15–1.39 ms).

Keys past the end are read as the last key and masked (their values staged as 0); rows past the
end are computed from the last row and never stored. A causal mask stops each chunk at its
diagonal tile and skips a row block's tiles past its diagonal; a tile that a boolean mask hides
from every row of the chunk (``Attention.masks``: a decode step's keys past its position,
padding) is not staged, and one it hides from a row block's rows is skipped for that row block;
both are found in one pass over the tile's mask, row block by row block (a local ``vis`` flag
each), rather than once over the chunk and again per row block.
"""

from __future__ import annotations

import math

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
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
    PairDot,
    Select,
    Store,
    Unary,
    Var,
)
from sextant.kernel.sizes import capacity
from sextant.schedule.attention_match import Attention, at
from sextant.schedule.cpu_pairs import pair_lanes
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
ROW_TILES = 2  # register tiles of query rows per row block
CHUNK_ROWS = 256  # query rows per block at most: their output rows are 64 KiB at 64-wide heads


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


def _register_tile(e, rows: int, cols: int, depth: int, step, init, store, acc_t: DType) -> None:
    """``store(r, u, ...)`` of a ``rows × cols`` register tile after ``depth`` steps of ``step(k)``
    into it, started from ``init(r, u)``: accumulators in a constant-indexed local array (``acc``)
    that LLVM keeps in registers, every loop but the depth unrolled."""
    for r in range(rows):
        _loop(e, cols, lambda u, r=r: e.emit(Store("acc", iadd(c(r * cols), u), init(r, u))), "u", unroll=True)
    _loop(e, depth, step, "k")
    for r in range(rows):
        _loop(e, cols, lambda u, r=r: store(r, u, Load("acc", iadd(c(r * cols), u), acc_t)), "u", unroll=True)


def _micro_gemm(e, rows: int, cols: int, depth: int, a, b, init, store, acc_t: DType) -> None:
    """``store(r, u, init(r, u) + Σ_k a(r, k)·b(k, u))`` for a ``rows × cols`` register tile: the
    CPU GEMM's micro-kernel (``cpu_gemm``), per step a row of B against one broadcast of A per row."""

    def step(k: Var) -> None:  # row by row, one value of A live at a time (see cpu_gemm's kstep)
        for r in range(rows):
            av = e.bind(a(r, k), "a")

            def col(u: Var, r: int = r, av: Expr = av) -> None:
                slot = iadd(c(r * cols), u)
                e.emit(Store("acc", slot, Binary("add", Load("acc", slot, acc_t),
                                                 Binary("mul", av, b(k, u), acc_t), acc_t)))

            _loop(e, cols, col, "u", unroll=True)

    _register_tile(e, rows, cols, depth, step, init, store, acc_t)


def _pair_gemm(e, rows: int, cols: int, pairs: int, a, b: str, b_off, init, store, acc_t: DType, lanes: int) -> None:
    """:func:`_micro_gemm` on the pair dot: per pair step ``p``, each row's bf16 pair ``a(r, p)``
    against ``cols`` columns of ``b`` laid out in pairs from ``b_off(p)`` (``cols / lanes`` pair
    dots a row)."""

    def step(p: Var) -> None:
        off = e.bind(b_off(p), "pk")
        for r in range(rows):
            lo, hi = (e.bind(x, "a") for x in a(r, p))
            for h in range(cols // lanes):
                e.emit(PairDot("acc", c(r * cols + h * lanes), lo, hi, b, iadd(off, c(2 * lanes * h)), lanes))

    _register_tile(e, rows, cols, pairs, step, init, store, acc_t)


def _bf16_valued(n: Node) -> bool:
    """Every value of ``n`` is a bf16 value: a bf16 tensor, or widening casts and movements of one
    (rounding it to bf16 again is exact)."""
    while n.dtype != DType.bf16:
        if n.op not in ("reshape", "permute", "expand", "slice", "cast") or n.dtype != DType.f32:
            return False
        n = n.inputs[0]
    return True


def uses_pair_attention(group: Group, att: Attention, target: TargetDesc) -> bool:
    """Whether both products run on the bf16 pair dot (``cpu_pairs``): a CPU with the instruction,
    Q, K and V bf16 values (the graph widens a bf16 SDPA's operands to f32), an even head size, and
    every output of the group bf16. P is then rounded to bf16 for ``P·V`` — what eager's CPU flash
    kernel does for bf16, an error below the output's own rounding; ``Q·Kᵀ`` is exact either way."""
    dim = att.q.shape[-1]
    return (not target.is_gpu and target.pair_dot and isinstance(dim, int) and dim % 2 == 0 and dim >= 2
            and all(_bf16_valued(n) for n in (att.q, att.kt, att.v))
            and all(o.dtype == DType.bf16 for o in group.outputs))


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
    br = min(ROW_TILES * rg, -(-n_q_most // rg) * rg)
    nk = nr if n_kv_most >= nr else narrow_columns(n_kv_most, nr) if divisible(n_kv, 4) else nr
    nv = narrow_columns(dim_v, nr)
    dvp = -(-dim_v // nv) * nv  # value rows padded to whole register-tile widths
    # over a symbolic key count every tile computes all its keys (past n_kv masked): the shortest
    # tile keeps short sequences cheap (GPT-2 2-layer at 1 token: 2.2 → 0.7 ms with 64 for 256 keys)
    keys = KEY_TILES[-1] if isinstance(n_kv, SymDim) else key_tile(dim, dvp)
    # static keys: tiles of even length, so a ragged end wastes less than one register tile (ViT's
    # 197 keys as 2 × 112 rather than 128 + 69 of 128); keys past n_kv are masked
    spread = keys if isinstance(n_kv, SymDim) else -(-n_kv_most // -(-n_kv_most // keys))
    tile = min(keys, -(-spread // nk) * nk) if n_kv_most >= keys else -(-n_kv_most // nk) * nk
    lanes = reduce_lanes(target, acc_t, tile)
    # a block owns a *chunk* of a head's query rows: up to CHUNK_ROWS, fewer where the heads alone
    # would not give every core two blocks; the K and V tiles are staged once per chunk
    rbs_most = -(-n_q_most // br)
    heads_most = math.prod(capacity(d) for d in batch)
    per_chunk = max(1, min(rbs_most, CHUNK_ROWS // br, rbs_most * heads_most // (2 * target.cores)))
    rows_c = per_chunk * br
    n_chunks = -(-n_q // rows_c)
    blocks_total = math.prod(batch) * n_chunks
    pairs = uses_pair_attention(group, att, target)
    if pairs:  # staged as bf16: Q's rows as they are, K as [dim/2][tile][2], V as [tile/2][dvp][2]
        dot_t = DType.bf16
    local = (Buffer("qb", dot_t, rows_c * dim, "local"), Buffer("kt", dot_t, dim * tile, "local"),
             Buffer("vt", dot_t if pairs else acc_t, tile * dvp, "local"), Buffer("zt", acc_t, br * tile, "local"),
             Buffer("ob", acc_t, rows_c * dvp, "local"), Buffer("acc", acc_t, rg * max(nk, nv), "local"),
             Buffer("mb", acc_t, rows_c, "local"), Buffer("lb", acc_t, rows_c, "local"),
             Buffer("cb", acc_t, rows_c, "local"), Buffer("red", acc_t, lanes, "local"))
    if att.masks and per_chunk > 1:  # per row block: whether it sees any key of the tile
        local += (Buffer("vis", DType.i32, per_chunk, "local"),)
    if pairs:  # P rounded to bf16, the A of P·V
        local += (Buffer("pb", DType.bf16, br * tile, "local"),)
    neg_inf, zero = Const(-math.inf, acc_t), Const(0.0, acc_t)
    half_p = att.probs.dtype if att.probs.dtype != acc_t else None  # P rounded as the product reads it
    ragged_kv = not divisible(n_kv, tile)

    def loop(n: int, body, prefix: str, *, start: Expr | None = None, stop: Expr | None = None,
             unroll: bool = False) -> None:
        _loop(e, n, body, prefix, start=start, stop=stop, unroll=unroll)

    def as_(x: Expr, dt: DType) -> Expr:
        return x if x.dtype == dt else Cast(x, dt)

    def chunk(cu: Var) -> None:
        """A chunk of one head's query rows: each K/V tile staged once, then every row block of the
        chunk takes it (its scores, online softmax and output update)."""
        bl = e.bind(idiv(cu, n_chunks), "b") if batch else c(0)
        c0 = e.bind(imul(imod(cu, n_chunks), rows_c), "c0")
        # row blocks holding rows: all of them but in a ragged last chunk
        nrb = c(per_chunk) if divisible(n_q, rows_c) else \
            e.bind(imin(c(per_chunk), idiv(iadd(c(n_q + br - 1), imul(c0, -1)), br)), "nrb")
        rows = c(rows_c) if isinstance(nrb, Const) else e.bind(imul(nrb, br), "rows")

        def row_of(r: Expr) -> Expr:  # rows past the end compute the last row's values, never stored
            return e.bind(iadd(c0, r), "i") if divisible(n_q, br) else e.bind(imin(iadd(c0, r), c(n_q - 1)), "i")

        def query_row(r: Var) -> None:
            i = row_of(r)
            loop(dim, lambda d: e.emit(Store("qb", iadd(imul(r, dim), d), as_(e.value(q, at(q, bl, i, d)), dot_t))),
                 "d")
            e.emit(Store("mb", r, neg_inf))
            e.emit(Store("lb", r, zero))
            loop(dvp, lambda d: e.emit(Store("ob", iadd(imul(r, dvp), d), zero)), "d")

        loop(0, query_row, "r", stop=rows)

        def stage(j0: Var) -> None:
            def key(jj: Var) -> None:
                j = e.bind(iadd(j0, jj), "j")
                valid = Binary("lt", j, c(n_kv), DType.bool)
                jc = e.bind(imin(j, c(n_kv - 1)), "jc") if ragged_kv else j
                def kt_at(d: Expr) -> Expr:  # [dim][tile], or in pairs of dims [dim/2][tile][2]
                    return iadd(imul(iadd(imul(idiv(d, 2), tile), jj), 2), imod(d, 2)) if pairs \
                        else iadd(imul(d, tile), jj)

                def vt_at(d: Expr) -> Expr:  # [tile][dvp], or in pairs of keys [tile/2][dvp][2]
                    return iadd(imul(iadd(imul(idiv(jj, 2), dvp), d), 2), imod(jj, 2)) if pairs \
                        else iadd(imul(jj, dvp), d)

                loop(dim, lambda d: e.emit(Store("kt", kt_at(d), as_(e.value(kt, at(kt, bl, d, jc)), dot_t))), "d")
                vt_t = dot_t if pairs else acc_t

                def v_elem(d: Var) -> None:
                    val = as_(e.value(v, at(v, bl, jc, d)), vt_t)
                    if ragged_kv:  # a key past the end contributes 0, even against an inf value
                        val = Select(valid, val, Const(0.0, vt_t), vt_t)
                    e.emit(Store("vt", vt_at(d), val))

                loop(dim_v, v_elem, "d")
                for d in range(dim_v, dvp):
                    e.emit(Store("vt", vt_at(c(d)), Const(0.0, vt_t)))

            loop(tile, key, "jj")

        def row_block(j0: Var, rb: Expr) -> None:
            """The staged tile against the row block whose first row is the chunk's ``rb``."""
            # S = Q·Kᵀ for the row block, a register tile of rg rows × nk keys at a time
            def s_tile(r0: int, c0_: Var) -> None:
                qrow = lambda r: iadd(imul(rb, dim), c((r0 + r) * dim))
                if pairs:
                    qpair = lambda r, p: (Load("qb", iadd(qrow(r), imul(p, 2)), dot_t),
                                          Load("qb", iadd(qrow(r), iadd(imul(p, 2), c(1))), dot_t))
                    _pair_gemm(e, rg, nk, dim // 2, qpair, "kt", lambda p: imul(iadd(imul(p, tile), c0_), 2),
                               lambda r, u: zero,
                               lambda r, u, val: e.emit(Store("zt", iadd(c((r0 + r) * tile), iadd(c0_, u)), val)),
                               acc_t, pair_lanes(target, nk))
                    return
                _micro_gemm(e, rg, nk, dim,
                            lambda r, k: as_(Load("qb", iadd(qrow(r), k), dot_t), acc_t),
                            lambda k, u: as_(Load("kt", iadd(imul(k, tile), iadd(c0_, u)), dot_t), acc_t),
                            lambda r, u: zero,
                            lambda r, u, val: e.emit(Store("zt", iadd(c((r0 + r) * tile), iadd(c0_, u)), val)),
                            acc_t)

            for r0 in range(0, br, rg):
                kc = e.var("kc")
                with e.scope() as body:
                    s_tile(r0, kc)
                e.emit(For(kc, c(0), c(tile), nk, tuple(body)))
            loop(br, lambda r: softmax_row(r, rb, j0), "r")

            # O = O·corr + P·V, a register tile of rg rows × nv value columns at a time
            def o_tile(r0: int, d0: Var) -> None:
                orow = lambda r: iadd(imul(rb, dvp), c((r0 + r) * dvp))

                def p(r: int, k: Expr) -> Expr:
                    x = Load("zt", iadd(c((r0 + r) * tile), k), acc_t)
                    return Cast(Cast(x, half_p), acc_t) if half_p is not None else x

                init = lambda r, u: Binary("mul", Load("ob", iadd(orow(r), iadd(d0, u)), acc_t),
                                           Load("cb", iadd(rb, c(r0 + r)), acc_t), acc_t)
                store = lambda r, u, val: e.emit(Store("ob", iadd(orow(r), iadd(d0, u)), val))
                if pairs:
                    ppair = lambda r, q: (Load("pb", iadd(c((r0 + r) * tile), imul(q, 2)), DType.bf16),
                                          Load("pb", iadd(c((r0 + r) * tile), iadd(imul(q, 2), c(1))), DType.bf16))
                    _pair_gemm(e, rg, nv, tile // 2, ppair, "vt", lambda q: imul(iadd(imul(q, dvp), d0), 2), init,
                               store, acc_t, pair_lanes(target, nv))
                    return
                _micro_gemm(e, rg, nv, tile, p, lambda k, u: Load("vt", iadd(imul(k, dvp), iadd(d0, u)), acc_t), init,
                            store, acc_t)

            for r0 in range(0, br, rg):
                d0 = e.var("d0")
                with e.scope() as body:
                    o_tile(r0, d0)
                e.emit(For(d0, c(0), c(dvp), nv, tuple(body)))

        def softmax_row(r: Var, rb: Expr, j0: Var) -> None:
            """Row ``rb + r``'s logits from its scores, the new running max, P = exp(z - max) in
            place, the running sum, and the factor ``cb`` that rescales its output row."""
            cr = e.bind(iadd(rb, r), "cr")  # the row in the chunk's arrays
            i = row_of(cr)
            tmax = e.var("tmax", acc_t)
            e.emit(Assign(tmax, neg_inf))
            row = imul(r, tile)

            def logit(jj: Expr) -> Expr:
                j = e.bind(iadd(j0, jj), "j")
                jc = e.bind(imin(j, c(n_kv - 1)), "jc") if ragged_kv else j
                e.regs[id(att.scores)] = e.bind(as_(Load("zt", iadd(row, jj), acc_t), att.scores.dtype), "sc")
                zv = e.bind(as_(e.value(att.logits, at(att.logits, bl, i, jc)), acc_t), "z")
                e.regs.pop(id(att.scores))
                if ragged_kv:
                    zv = e.bind(Select(Binary("lt", j, c(n_kv), DType.bool), zv, neg_inf, acc_t), "zv")
                e.emit(Store("zt", iadd(row, jj), zv))
                return zv

            # one pass for the logits and their max, one for P = exp(z - max) and its sum, each over
            # vector-width lanes (``_lane_split``: the lanes become vector code, exp included — a
            # scalar exp per score cost more than the tile's two products together)
            _lane_split(e, "red", lanes, tile, tmax, "max", acc_t, logit)
            m = e.bind(Load("mb", cr, acc_t), "m")
            m_new = e.bind(Binary("maximum", m, tmax, acc_t), "mn")
            # a row masked so far keeps m = -inf: shift by 0 then, so exp gives 0, not NaN
            sh = e.bind(Select(Binary("eq", m_new, neg_inf, DType.bool), zero, m_new, acc_t), "sh")
            corr = e.bind(Unary("exp", Binary("sub", m, sh, acc_t), acc_t), "corr")

            def prob(jj: Expr) -> Expr:
                pv = e.bind(Unary("exp", Binary("sub", Load("zt", iadd(row, jj), acc_t), sh, acc_t), acc_t), "p")
                e.emit(Store("pb", iadd(row, jj), Cast(pv, DType.bf16)) if pairs else Store("zt", iadd(row, jj), pv))
                return pv

            total = e.var("l", acc_t)
            e.emit(Assign(total, Const(0.0, acc_t)))
            _lane_split(e, "red", lanes, tile, total, "sum", acc_t, prob)
            e.emit(Store("lb", cr, Binary("add", Binary("mul", Load("lb", cr, acc_t), corr, acc_t), total, acc_t)))
            e.emit(Store("mb", cr, m_new))
            e.emit(Store("cb", cr, corr))

        def visible(j0: Var, first: Expr, count: Expr) -> Expr:
            """Whether any of the chunk's rows ``first .. first+count`` sees a key of the tile
            (``att.masks``): a tile all of them hide adds exp(-inf) = 0 to every sum and is skipped
            — a decode step's keys past its position, padding, a causal mask's upper triangle."""
            seen = e.var("seen", DType.bool)
            e.emit(Assign(seen, Const(False, DType.bool)))

            def row(r: Var) -> None:
                i = row_of(iadd(first, r))

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

            loop(0, row, "r", stop=count)
            return seen

        def tile_body(j0: Var) -> None:
            def blocks() -> None:
                rbk = e.var("rb")
                with e.scope() as body:
                    rb = e.bind(imul(rbk, br), "rbr")
                    with e.scope() as work:
                        row_block(j0, rb)
                    conds = []
                    if att.causal:  # the row block's last query is c0 + rb + br - 1: keys from there on are masked
                        conds.append(Binary("lt", j0, iadd(iadd(c0, rb), c(br)), DType.bool))
                    if att.masks and per_chunk > 1:  # what the chunk's pass found for this row block
                        conds.append(Binary("ne", Load("vis", rbk, DType.i32), c(0), DType.bool))
                    if conds:
                        cond = conds[0] if len(conds) == 1 else Binary("bitwise_and", conds[0], conds[1], DType.bool)
                        e.emit(If(cond, tuple(work)))
                    else:
                        e.stmts.extend(work)
                e.emit(For(rbk, c(0), nrb, 1, tuple(body)))

            if att.masks and per_chunk > 1:  # the chunk's row blocks first, one pass over the mask: a
                # tile no row block sees is not even staged, one a row block does not see is skipped for it
                cond = e.var("any", DType.bool)
                e.emit(Assign(cond, Const(False, DType.bool)))
                rbk = e.var("rb")
                with e.scope() as each:
                    seen = visible(j0, e.bind(imul(rbk, br), "rbr"), c(br))
                    e.emit(Store("vis", rbk, Select(seen, c(1), c(0), DType.i32)))
                    e.emit(Assign(cond, Binary("bitwise_or", cond, seen, DType.bool)))
                e.emit(For(rbk, c(0), nrb, 1, tuple(each)))
                with e.scope() as work:
                    stage(j0)
                    blocks()
                e.emit(If(cond, tuple(work)))
            elif att.masks:  # the whole chunk first: a tile no row sees is not even staged
                cond = visible(j0, c(0), rows)
                with e.scope() as work:
                    stage(j0)
                    blocks()
                e.emit(If(cond, tuple(work)))
            else:
                stage(j0)
                blocks()

        j0 = e.var("j0")
        with e.scope() as body:
            tile_body(j0)
        # causal: the chunk's last query is c0 + rows - 1, so keys from c0 + rows on are all masked
        stop = e.bind(imin(iadd(c0, rows), c(n_kv)), "kend") if att.causal else c(n_kv)
        e.emit(For(j0, c(0), stop, tile, tuple(body)))

        def finish(r: Var) -> None:
            i = e.bind(iadd(c0, r), "i")
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

        loop(0, finish, "r", stop=rows)

    blocks, per = _chunks(blocks_total, target, 2 * rows_c * n_kv * (dim + dim_v))
    _row_loop(e, blocks_total, per, chunk)
    meta = {"mapping": "attention-cpu-flash-pairs" if pairs else "attention-cpu-flash",
            "rows": br, "chunk_rows": rows_c, "kv_tile": tile,
            "skips_hidden_tiles": bool(att.masks)}
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), local=local, meta=meta)
