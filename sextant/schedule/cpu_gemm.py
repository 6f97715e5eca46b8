"""The CPU's register-tiled GEMM, shared by matmul and convolution (as an implicit GEMM).

``C[b, i, j] = Σ_k A(b, i, k) · B(b, k, j)`` with a per-element epilogue. What A and B *are*
is the caller's: a matmul reads two row-major operands, a convolution reads A as the im2col
of its input (gathered through index arithmetic, zero padding as a select) and B as its
weights laid out ``[K, Cout]`` at compile time. The tiling (argued in ``matmul_kernel``'s
docstring in ``kernels.py``): a block owns a ``block_m`` × ``block_n`` tile of C and walks it
strip by strip of ``nr`` columns, each strip in ``mr`` × ``nr`` register micro-tiles.

Rows past ``m`` in the last micro-tile are computed on a clamped row (a valid address) and not
stored, so a short M (a batch-1 conv's 2×2 positions, attention's per-head products) still runs
the vector micro-kernel; so does a strip cut by the matrix edge, from a zero-padded copy of its
columns (:func:`_pad_strip`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.symbolic import Dim, SymbolicShapeError, SymDim
from sextant.kernel.ir import (
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
    Var,
)
from sextant.kernel.sizes import with_grid
from sextant.schedule.indexing import (
    Index,
    ValueEmitter,
    c,
    delinearize,
    divisible,
    iadd,
    idiv,
    imin,
    imod,
    imul,
    may_be_nonzero,
)

RowReader = Callable[[Expr], Expr]  # k -> A's value on one row


@dataclass(frozen=True)
class Gemm:
    """One GEMM as the micro-kernel sees it."""

    batch: tuple[Dim, ...]  # grid dims outside the GEMM (matmul batch, conv groups)
    m: Dim
    n: int  # columns computed (may be padded past n_store)
    k: int
    acc_t: DType
    # rows(bidx, first_row, count) -> one reader per row: called before the k loop, so per-row
    # index arithmetic (a conv's output position) is computed once per micro-tile
    rows: Callable[[Index, Expr, int], list[RowReader]]
    # (bidx, k, j0, j, strip) -> B's value at column j0 + j, where j0 starts a strip of nr columns,
    # strip = j0 // nr (None on the scalar edge path, where j0 is any column and j is 0)
    col: Callable[[Index, Expr, Expr, Expr, Expr | None], Expr]
    epilogue: Callable[[Index, Expr, Expr, Expr], None]  # (bidx, i, j, accumulator) -> stores
    mr: int
    nr: int
    block_m: int
    block_n: int
    pack: bool = False  # copy each strip of B into a local buffer on its first row tile
    n_store: int | None = None  # columns that exist (default n)
    k_block: int = 0  # walk K in blocks of this many (0: all of K at once); see gemm_kernel
    # the pair-dot micro-kernel (schedule/cpu_pairs.py): (bidx, strip) -> B's buffer in pairs of K and
    # the offset of the strip's first pair; None: both operands widened to acc_t and multiply-added
    pairs: Callable[[Index, Expr], tuple[str, Expr]] | None = None
    pair_lanes: int = 16  # f32 lanes of one PairDot (nr is a multiple)
    # steps (of K, or of pairs of K) per trip of the k loop, unrolled (k = trip·k_unroll + t with t a
    # constant): a convolution's taps, whose input offsets are then constants added to the channel's
    k_unroll: int = 1
    # the epilogue's columns as vector lanes (an unrolled loop, ``codegen/lanes.py``): for stores
    # contiguous along the columns (a matmul's C); a convolution's NCHW stores stride by a plane
    vector_epilogue: bool = False
    # the epilogue column by column, a full tile's rows as vector lanes: for stores contiguous along
    # the rows (a convolution's NCHW output, whose positions are the rows); a partial tile row by row
    column_epilogue: bool = False


def gemm_kernel(e: ValueEmitter, g: Gemm, name: str, params: list[Buffer], bid: Expr) -> Kernel:
    acc_t, mr, nr, m, n, k = g.acc_t, g.mr, g.nr, g.m, g.n, g.k
    n_store = n if g.n_store is None else g.n_store
    zero = Const(0.0 if acc_t.is_float else 0, acc_t)
    bm_ = balanced_rows(m, max(mr, g.block_m // mr * mr), mr)
    bn_ = max(nr, g.block_n // nr * nr)
    if isinstance(n, SymDim) or isinstance(k, SymDim):
        raise SymbolicShapeError(f"the CPU GEMM needs static N and K (here N={n}, K={k}); only M and the "
                                 "batch may be symbolic")
    blocks_m, blocks_n = (m + bm_ - 1) // bm_, math.ceil(n / bn_)
    per_batch = blocks_m * blocks_n
    nb = math.prod(g.batch)
    acc = Buffer("acc", acc_t, mr * nr, "local")
    tile = Buffer("tile", acc_t, mr * nr, "local")
    packed = Buffer("bpack", acc_t, max(1, k * bn_), "local")
    kc = g.k_block if 0 < g.k_block < k else 0
    steps = (k + 1) // 2 if g.pairs else k  # iterations of the k loop: pairs of K, or single K
    kcs = kc // 2 if g.pairs else kc  # ... per K block
    if g.k_unroll > 1 and (kcs % g.k_unroll or steps % g.k_unroll or (g.pairs and k % 2)):
        raise ValueError(f"k_unroll {g.k_unroll} needs a k loop whose {steps} steps and K blocks of {kcs} "
                         f"steps it divides (pairs of K: K = {k} even)")
    part = Buffer("part", acc_t, bm_ * nr, "local")  # a strip's partial sums between K blocks
    ragged = n % nr != 0  # the last strip is cut by the matrix edge
    if ragged and g.pairs is not None:
        raise ValueError(f"the pair-dot GEMM needs whole strips (B laid out and padded): N = {n}, nr = {nr}")
    last = Buffer("blast", acc_t, max(1, k * nr), "local")  # ... its columns, zero-padded (_pad_strip)

    def as_acc(v: Expr) -> Expr:
        return v if v.dtype == acc_t else Cast(v, acc_t)

    def loop(count: int, body: Callable[[Var], None], prefix: str, *, start: Expr | None = None,
             stop: Expr | None = None, unroll: bool = False, step: int = 1) -> None:
        v = e.var(prefix)
        with e.scope() as stmts:
            body(v)
        e.emit(For(v, start if start is not None else c(0), stop if stop is not None else c(count), step,
                   tuple(stmts), unroll))

    def guarded(cond: Expr | None, body: Callable[[], None]) -> None:
        if cond is None:
            body()
            return
        with e.scope() as then:
            body()
        e.emit(If(cond, tuple(then)))

    def fast(bidx: Index, i0: Expr, j0: Expr, strip: Expr, base: Expr, packing: bool,
             kb: Expr | None = None, rt: Expr | None = None, cut: bool = False) -> None:
        """One micro-tile: over all of K, or (``kb``) over the K block from ``kb``, starting from
        and ending in the row tile ``rt``'s partial sums unless it is the first / last block.
        ``cut``: the strip past the matrix edge, read from its zero-padded copy ``blast``."""
        if kb is None:
            loop(mr * nr, lambda u: e.emit(Store("acc", u, zero)), "u", unroll=True)
        else:
            slot0 = e.bind(imul(rt, mr * nr), "ps")
            first_block = Binary("eq", kb, c(0), DType.bool)
            partial = lambda u: Load("part", iadd(slot0, u), acc_t)
            loop(mr * nr, lambda u: e.emit(Store("acc", u, Select(first_block, zero, partial(u), acc_t))), "u",
                 unroll=True)
        first = [iadd(i0, c(r)) if divisible(m, mr) or r == 0 else imin(iadd(i0, c(r)), c(m - 1))
                 for r in range(mr)]
        readers = g.rows(bidx, i0, mr) if divisible(m, mr) else _clamped_rows(g, bidx, first)
        if g.pairs is not None:
            pbuf, pstart = g.pairs(bidx, strip)
            pstart = e.bind(pstart, "pb")

        def pair_step(kp: Expr) -> None:
            """``mr`` rows of A, a pair of K each (zero past an odd K), times the strip's pairs."""
            # unrolled (a convolution's taps), k stays an expression: the offsets fold into constants
            k0 = imul(kp, 2) if g.k_unroll > 1 else e.bind(imul(kp, 2), "k")
            k1 = iadd(k0, c(1))
            rows = []
            for read in readers:
                hi = read(k1) if k % 2 == 0 else Select(Binary("lt", k1, c(k), DType.bool), read(imin(k1, c(k - 1))),
                                                         Const(0.0, DType.bf16), DType.bf16)
                rows.append((e.bind(read(k0), "a"), e.bind(hi, "a")))
            off = e.bind(iadd(pstart, imul(kp, 2 * nr)), "pk")
            w = g.pair_lanes
            for r, (lo, hi) in enumerate(rows):
                for h in range(nr // w):
                    e.emit(PairDot("acc", c(r * nr + h * w), lo, hi, pbuf, iadd(off, c(2 * w * h)), w))

        def kstep(kk: Expr) -> None:
            """Row by row: one broadcast of A against the strip's row of B (one lane loop per row;
            LLVM keeps B's ``nr / lanes`` vectors in registers across the rows). Only one value of
            A is live at a time: with all ``mr`` of them bound first (the earlier order) the 6×16
            tile held 6 broadcasts + 12 accumulators + B, 19 of AVX2's 16 ymm registers, and LLVM
            spilled three accumulators every k step (Zen 3, 768→768 on 128 rows: 69 → 121 GFLOP/s)."""
            row = e.bind(imul(kk, nr) if cut else iadd(base, imul(kk, nr)), "pk")
            for r, read in enumerate(readers):
                a = e.bind(as_acc(read(kk)), "a")

                def col(j: Var, r: int = r, a: Expr = a) -> None:
                    if cut:
                        bv = e.bind(Load("blast", iadd(row, j), acc_t), "b")
                    elif g.pack and not packing:
                        bv = e.bind(Load("bpack", iadd(row, j), acc_t), "b")
                    else:
                        bv = e.bind(as_acc(g.col(bidx, kk, j0, j, strip)), "b")
                        if g.pack and r == 0:
                            e.emit(Store("bpack", iadd(row, j), bv))
                    slot = iadd(c(r * nr), j)
                    e.emit(Store("acc", slot, Binary("add", Load("acc", slot, acc_t),
                                                     Binary("mul", a, bv, acc_t), acc_t)))

                loop(nr, col, "j", unroll=True)

        step = kstep if g.pairs is None else pair_step
        u = g.k_unroll

        def trip(ko: Var) -> None:  # u steps (one when not unrolled: ko·1 + 0 is ko itself)
            for t in range(u):
                step(iadd(imul(ko, u), c(t)))

        if kb is None:
            loop(steps // u, trip, "k")
        else:  # the block's trips (kcs and steps are whole trips)
            loop(0, trip, "k", start=idiv(kb, u), stop=idiv(imin(iadd(kb, c(kcs)), c(steps)), u))

        def finish() -> None:
            loop(mr * nr, lambda u: e.emit(Store("tile", u, Load("acc", u, acc_t))), "u", unroll=True)
            if cut or n_store >= n:
                stores(cut)
                return
            # only the strip that holds the last stored column needs the mask (and its scalar
            # loop): a whole strip keeps the vector epilogue (N = 3136 in 48-column strips had
            # every strip masked, 6x the time of the same product in 32-column strips)
            with e.scope() as whole:
                stores(False)
            with e.scope() as edge:
                stores(True)
            e.emit(If(Binary("le", iadd(j0, c(nr)), c(n_store), DType.bool), tuple(whole), tuple(edge)))

        def stores(masked: bool) -> None:
            """The micro-tile's epilogue, the columns at or past ``n_store`` skipped if ``masked``."""
            column_mask = (lambda jj: Binary("lt", jj, c(n_store), DType.bool)) if masked else (lambda jj: None)

            def out_row(r: Var) -> None:
                i = iadd(i0, r)

                def out_col(j: Var) -> None:
                    jj = iadd(j0, j)
                    guarded(column_mask(jj), lambda: g.epilogue(bidx, i, jj, Load("tile", iadd(imul(r, nr), j), acc_t)))

                guarded(None if divisible(m, mr) else Binary("lt", i, c(m), DType.bool),
                        lambda: loop(nr, out_col, "j", unroll=g.vector_epilogue and not masked))

            def by_rows() -> None:
                loop(mr, out_row, "r")

            def by_columns() -> None:
                def out_col(j: Var) -> None:
                    jj = iadd(j0, j)

                    def lanes() -> None:
                        loop(mr, lambda r: g.epilogue(bidx, iadd(i0, r), jj, Load("tile", iadd(imul(r, nr), j), acc_t)),
                             "r", unroll=True)

                    guarded(column_mask(jj), lanes)

                loop(nr, out_col, "j")

            if not g.column_epilogue:
                by_rows()
            elif divisible(m, mr):
                by_columns()
            else:  # the last row tile, past M, row by row
                with e.scope() as full:
                    by_columns()
                with e.scope() as partial:
                    by_rows()
                e.emit(If(Binary("le", iadd(i0, c(mr)), c(m), DType.bool), tuple(full), tuple(partial)))

        if kb is None:
            finish()
            return
        with e.scope() as last:
            finish()
        with e.scope() as keep:
            loop(mr * nr, lambda u: e.emit(Store("part", iadd(slot0, u), Load("acc", u, acc_t))), "u", unroll=True)
        e.emit(If(Binary("ge", iadd(kb, c(kcs)), c(steps), DType.bool), tuple(last), tuple(keep)))

    def block(t: Expr) -> None:
        bidx = delinearize(e.bind(idiv(t, per_batch), "bb"), g.batch) if g.batch else ()
        rem = e.bind(imod(t, per_batch), "t") if g.batch else t
        bm = e.bind(idiv(rem, blocks_n), "bm")
        bn = e.bind(imod(rem, blocks_n), "bn")
        jstart = e.bind(imul(bn, bn_), "js")
        istart = e.bind(imul(bm, bm_), "is")

        def panel(s: Var) -> None:
            j0 = e.bind(iadd(jstart, imul(s, nr)), "j0")
            strip = e.bind(iadd(imul(bn, bn_ // nr), s), "strip")
            base = e.bind(imul(s, k * nr), "sb")

            def micro(i0: Expr, kb: Expr | None = None, rt: Expr | None = None) -> None:
                def then() -> None:
                    if g.pack:  # the block's first row tile of a strip packs it, the others read the copy
                        with e.scope() as first:
                            fast(bidx, i0, j0, strip, base, True, kb, rt)
                        with e.scope() as rest:
                            fast(bidx, i0, j0, strip, base, False, kb, rt)
                        e.emit(If(Binary("eq", i0, istart, DType.bool), tuple(first), tuple(rest)))
                    else:
                        fast(bidx, i0, j0, strip, base, False, kb, rt)

                if not ragged:
                    then()
                    return
                with e.scope() as fast_path:
                    then()
                with e.scope() as orelse:
                    fast(bidx, i0, j0, strip, base, False, kb, rt, cut=True)
                e.emit(If(Binary("le", iadd(j0, c(nr)), c(n), DType.bool), tuple(fast_path), tuple(orelse)))

            if ragged:
                with e.scope() as fill:
                    _pad_strip(e, g, bidx, j0, loop)
                e.emit(If(Binary("gt", iadd(j0, c(nr)), c(n), DType.bool), tuple(fill)))
            if not kc:
                loop(0, micro, "i0", start=istart, stop=imin(iadd(istart, c(bm_)), c(m)), step=mr)
                return

            def k_block(kb: Var) -> None:  # every row tile of the strip over this K block
                def row_tile(rt: Var) -> None:
                    micro(e.bind(iadd(istart, imul(rt, mr)), "i0"), kb, rt)

                tiles = imin(c(bm_ // mr), idiv(iadd(c(m + mr - 1), imul(istart, -1)), mr))
                loop(0, row_tile, "rt", stop=tiles)

            loop(0, k_block, "kb", stop=c(steps), step=kcs)

        if n % bn_ == 0:
            loop(bn_ // nr, panel, "s")
        else:  # the last column block holds fewer strips (a partial one takes the edge path)
            loop(0, panel, "s", stop=imin(c(bn_ // nr), idiv(iadd(c(n + nr - 1), imul(jstart, -1)), nr)))

    if may_be_nonzero(m, n, nb):
        block(bid)
    local = (acc, tile) + ((packed,) if g.pack else ()) + ((part,) if kc else ()) + ((last,) if ragged else ())
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), (1, 1, 1), tuple(e.stmts), local=local),
                     (nb * per_batch, 1, 1))


def _pad_strip(e: ValueEmitter, g: Gemm, bidx: Index, j0: Expr, loop: Callable[..., None]) -> None:
    """Copy the strip cut by the matrix edge (columns ``j0`` to ``n``) into ``blast`` as ``[K][nr]``,
    zeros past ``n``, so its row tiles run the vector micro-kernel and store only the columns that
    exist. Until 2026-12 those columns took a scalar path per element over all of K: ``W @ x`` at
    14×14 positions (N = 196, four columns past the last whole strip) ran at 27 GFLOP/s on 2 Zen 3
    cores, 2 % of its products taking most of its time. Once per strip and block: k × nr copies
    against the block's rows × k × nr multiply-adds."""
    n, nr, acc_t = g.n, g.nr, g.acc_t

    def step(kk: Var) -> None:
        def col(j: Var) -> None:
            jj = iadd(j0, j)
            value = g.col(bidx, kk, imin(jj, c(n - 1)), c(0), None)
            value = value if value.dtype == acc_t else Cast(value, acc_t)
            zero = Const(0.0 if acc_t.is_float else 0, acc_t)
            inside = Binary("lt", jj, c(n), DType.bool)
            e.emit(Store("blast", iadd(imul(kk, nr), j), Select(inside, value, zero, acc_t)))

        loop(nr, col, "j", unroll=True)

    loop(g.k, step, "k")


def balanced_rows(m: Dim, block_m: int, mr: int) -> int:
    """Rows per block: as many blocks as ``block_m`` rows need, their rows evened out (whole
    micro-tiles). The executor hands each worker a contiguous half of the blocks, row block by row
    block: 197 rows as 128 + 69 gave one worker all the 128-row blocks and the other idle 45% of
    the time (ViT-B/16's products ran at 66% of the FMA peak); as 104 + 93 the halves differ by
    11%. A symbolic M keeps ``block_m``."""
    if not isinstance(m, int) or m <= block_m:
        return block_m
    blocks = math.ceil(m / block_m)
    return math.ceil(math.ceil(m / blocks) / mr) * mr


def _clamped_rows(g: Gemm, bidx: Index, rows: list[Expr]) -> list[RowReader]:
    return [g.rows(bidx, r, 1)[0] for r in rows]

