"""Hopper GEMM: f16/bf16 matmuls on sm_90a as warpgroup MMAs fed by TMA.

The first two rungs of the ladder the issue describes — ``wgmma`` + TMA, then warp
specialisation (no persistent tile scheduler or clusters yet):

* **One block per ``BM × BN`` tile of C** (and per matrix of a batch), ``BM/64`` *consumer*
  warpgroups of 128 threads; consumer ``w`` owns rows ``64w …`` and keeps its ``BN/2`` f32
  accumulators per thread in registers (``kernel.wgmma.d_coord`` says which element each is).
  With ``BM = 128`` one more warpgroup, the *producer*, only issues copies: it gives registers
  up (``setmaxnreg`` 40) so the consumers can have 232 — enough for a 64 × 256 accumulator tile.
* **A ring of ``S`` shared-memory stages**, each holding a ``BM × 64`` tile of A and a ``BN × 64``
  tile of B, written by TMA with the 128-byte swizzle — one 128-byte row per tile row, 8-row atoms
  of 1024 bytes — and read by wgmma through descriptors of the same swizzle (``SBO`` = 1024, the K
  steps of 16 elements 32 bytes apart within the row). B's *columns* are its rows there when B is
  ``Wᵀ`` of a stored ``N × K`` weight (K-major, as wgmma reads it); a B stored ``K × N`` (``x @ W``)
  is copied as ``BN/64`` boxes of 64 K-rows × 64 columns and read MN-major (the transpose bit;
  ``LBO`` = one box, the K steps 16 rows apart). Elements past the matrix edges arrive as zeros
  (TMA's bounds), so ragged M, N and K need no guard in the main loop; a batch's matrices are the
  tensor maps' outer dimensions (``schedule.tma``).
* **Specialised** (:func:`_specialized`): a *full* and an *empty* mbarrier per stage; the
  producer waits for a stage's release and refills it, the consumers wait for its bytes,
  multiply, and release the stage one behind — no block barrier in the loop.
* **Not specialised** (one warpgroup of 64 rows, :func:`_mainloop`): one mbarrier per stage;
  thread 0 also issues the copies, and a block barrier after each K step says the stage one back
  is free.
* **The epilogue** (bias, activation, residual, cast) runs per accumulator at the row and column
  the D layout gives it, guarded at the edges.

Used when the target is ``sm_90a`` and both operands are views TMA can describe (A ``M × K``;
B ``K × N`` or ``Wᵀ`` of an ``N × K`` W; the inner dim contiguous, 16-byte-aligned strides,
static sizes, batch dims as outer dims); anything else keeps the ``mma.sync`` GEMM
(``gpu_mma``), which sm_90a runs as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.symbolic import is_symbolic
from sextant.kernel.ir import (
    Barrier,
    Binary,
    Buffer,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    SetMaxNReg,
    SmemMatrix,
    Store,
    Var,
    Wgmma,
    WgmmaCommit,
    WgmmaFence,
    WgmmaWait,
)
from sextant.kernel.sizes import with_grid
from sextant.kernel.wgmma import WARPGROUP, WGMMA_M, launch_registers
from sextant.schedule.attention_match import at
from sextant.schedule.gpu_kernels import BID_X, TID_X, _and, _bool, _check_shared, _grid, _guarded, _strided_loop
from sextant.schedule.gpu_mma import TC_DTYPES, half_product
from sextant.schedule.indexing import INDEX, ValueEmitter, c, divisible, iadd, idiv, imin, imod, imul
from sextant.schedule.kernels import setup_kernel, store_epilogue
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc, sm_version
from sextant.schedule.tma import SWIZZLE, HeadsOperand, TmaOperand, heads_operand, tma_operand
from sextant.schedule.tuning import choose

BK = 64  # one 128-byte swizzled row of f16/bf16
ATOM = 1024  # bytes: 8 rows of 128


@dataclass(frozen=True)
class WgTile:
    """A block tile ``bm × bn`` computed by ``bm/64`` consumer warpgroups, ``stages`` shared-memory
    stages of ``BK``; ``producer``: one more warpgroup that only issues the copies (warp
    specialisation, registers moved to the consumers with ``setmaxnreg``)."""

    bm: int
    bn: int
    stages: int
    producer: bool = False
    # persistent (warp-specialised GEMMs only): one block per SM walks a list of output tiles in
    # grouped order, the producer loading the next tile's stages while the consumers store this one's
    persistent: bool = False

    @property
    def consumers(self) -> int:
        return self.bm // WGMMA_M

    @property
    def threads(self) -> int:
        return (self.consumers + self.producer) * WARPGROUP

    @property
    def name(self) -> str:
        """How a tuning table names the candidate: ``128x256/s4/ws`` (``ws``: warp-specialised)."""
        return f"{self.bm}x{self.bn}/s{self.stages}" + ("/ws" if self.producer else "") + (
            "/p" if self.persistent else "")

    def meta(self) -> dict:
        return {"tile": (self.bm, self.bn, BK), "warpgroups": self.consumers, "stages": self.stages,
                "warp_specialized": self.producer, **({"persistent": True} if self.persistent else {})}


# Warp-specialised 128 × 256 (× 128 or × 64 when N is small: no tile column wasted on a narrow
# product) with 4 stages (192 / 128 / 96 KiB): CUTLASS's "cooperative" Hopper GEMM — a producer
# warpgroup and two consumers of 64 rows each; one warpgroup of 64 rows, not specialised, for
# problems whose M is small.
CANDIDATES = (WgTile(128, 256, 4, True), WgTile(128, 128, 4, True), WgTile(128, 64, 4, True),
              WgTile(64, 128, 4), WgTile(64, 64, 4),
              WgTile(128, 256, 4, True, persistent=True), WgTile(128, 128, 4, True, persistent=True))
GROUP_M = 8  # a persistent GEMM walks its tiles 8 row tiles at a time down each column (L2 reuse of B)
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # 128·40 + 256·232 ≤ the SM's 65,536 registers


def is_sm90a(target: TargetDesc) -> bool:
    return target.is_gpu and sm_version(target) == 90 and target.name.endswith("a")


def wgmma_sources(group: Group, buffers: dict[int, str]) -> tuple[TmaOperand | HeadsOperand, TmaOperand, bool] | None:
    """A (K-major) and B as TMA sources, and whether B is K-major (``Wᵀ`` of a stored ``N × K``
    weight; else stored ``K × N``, read MN-major) — or None. Batched operands carry their batch
    dims as outer dims of the tensor map; one with none (a weight shared by the batch) is fine.
    An A that merges attention heads (``tma.HeadsOperand``) is read head by head, B then a weight."""
    mm = group.anchor
    a, b = mm.inputs
    dt = a.dtype
    batch = math.prod(int(d) for d in mm.shape[:-2])
    sa: TmaOperand | HeadsOperand | None = tma_operand(a, buffers, dt, -2, -1)
    if sa is None:
        sa = heads_operand(a, buffers, dt)
    sb, k_major = tma_operand(b, buffers, dt, -1, -2), True
    if sb is None:
        sb, k_major = tma_operand(b, buffers, dt, -2, -1), False
    if sa is None or sb is None:
        return None
    if isinstance(sa, HeadsOperand):
        return (sa, sb, k_major) if not sb.lead else None
    if any(op.lead and math.prod(op.lead) != batch for op in (sa, sb)):
        return None
    return sa, sb, k_major


def uses_wgmma(group: Group, target: TargetDesc) -> bool:
    """The group's matmul runs on the Hopper GEMM below (its operands checked when it is built)."""
    mm = group.anchor
    return (is_sm90a(target) and half_product(mm, target) and mm.inputs[0].dtype in TC_DTYPES
            and not is_symbolic(mm.shape) and not any(is_symbolic(x.shape) for x in mm.inputs))


def reads_weight_in_place(group: Group, target: TargetDesc) -> bool:
    """A Linear layer's ``permute(W)`` this GEMM reads as ``Wᵀ`` (K-major) where the module keeps
    it: W's rows are TMA-addressable (``K`` · 2 bytes a multiple of 16). A row-major ``K × N``
    copy (``program.prepack_weights``) would only add a constraint — ``N`` · 2 bytes a multiple of
    16, which a 10-class head fails."""
    mm = group.anchor
    b = mm.inputs[1]
    return (uses_wgmma(group, target) and b.op == "permute" and b.inputs[0].op == "param"
            and tuple(b.attr("perm"))[-2:] == (len(b.shape) - 1, len(b.shape) - 2)
            and int(b.shape[-2]) * b.dtype.itemsize % 16 == 0)


def choose_wg_tile(m: int, n: int) -> WgTile:
    """The narrowest candidate whose N covers the product (or the widest), at the product's M."""
    rows = [t for t in CANDIDATES if (t.bm == WGMMA_M) == (m <= WGMMA_M) and not t.persistent]
    fits = [t for t in rows if t.bn >= n]
    return min(fits, key=lambda t: t.bn) if fits else max(rows, key=lambda t: t.bn)


def wg_candidates(m: int, persistent: bool = True) -> tuple[WgTile, ...]:
    """The tiles a product of ``m`` rows may use: every candidate, but only 64-row tiles when
    ``m ≤ 64`` (a 128-row tile would compute half its rows for nothing); the persistent ones
    where the mapping has a persistent form (``persistent``)."""
    return tuple(t for t in CANDIDATES if (m > WGMMA_M or t.bm == WGMMA_M) and (persistent or not t.persistent))


def tuned_wg_tile(mapping: str, m: int, n: int, k: int, batch: int, dtype: DType,
                  target: TargetDesc) -> tuple[WgTile, dict]:
    """The tile of this problem: the target's tuning table's choice, else :func:`choose_wg_tile`'s
    (never persistent: the persistent tiles are chosen by measurement only)."""
    return choose(mapping, m, n, k, batch, dtype, target, wg_candidates(m), choose_wg_tile(m, n))


def gpu_wgmma_matmul_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel | None:
    """The matmul group as a wgmma + TMA GEMM, or None when its operands are not TMA-describable."""
    mm = group.anchor
    a, b = mm.inputs
    m, k = (int(d) for d in a.shape[-2:])
    n = int(b.shape[-1])
    batch = math.prod(int(d) for d in mm.shape[:-2])
    dt = a.dtype
    e, params, _ = setup_kernel(group, stored)
    sources = wgmma_sources(group, e.buffers)
    if sources is None:
        return None
    src_a, src_b, b_k_major = sources
    flat = False  # C's rows are (b, n) flattened: row tiles run per b (a HeadsOperand A)
    if isinstance(src_a, HeadsOperand):
        flat = mm.type.rank == 2 and src_a.batch is not None
        m, batch = src_a.n, src_a.batch[0] if src_a.batch else batch
    tile, chosen = tuned_wg_tile("wgmma", m, n, k, batch, dt, target)
    S, bm_, bn_ = tile.stages, tile.bm, tile.bn
    size = dt.itemsize
    a_stage, b_stage = bm_ * BK, bn_ * BK  # elements per stage
    tx = (bm_ + bn_) * BK * size
    tiles = (-(-n // bn_), -(-m // bm_), batch)
    pos: dict[str, Expr] = {}  # the output tile being computed: i0, j0 and bz (per tile when persistent)
    if tile.persistent:
        blocks = min(math.prod(tiles), target.cores)  # one block per SM (a 4-stage ring fills its shared memory)
        grid = (blocks, 1, 1)
    else:
        grid, (bn, bm, bz) = _grid(e, tiles)
        pos.update(i0=e.bind(imul(bm, bm_), "i0"), j0=e.bind(imul(bn, bn_), "j0"), bz=bz)
    k_tiles = -(-k // BK)
    t = TID_X
    wg = e.bind(idiv(t, WARPGROUP), "wg")
    first = _bool("eq", t, c(0))
    row_elems = SWIZZLE // size  # elements in one swizzled 128-byte row
    a_width = src_a.width if isinstance(src_a, HeadsOperand) else row_elems  # A's columns per box

    def issue(kt: Expr, it: Expr | None = None) -> list:
        """Thread 0's part: announce the stage's bytes, copy K tile ``kt`` of A and B into it (B stored
        K×N: ``BN / 64`` boxes of 64 K-rows × 64 columns, one after the other); the stage is that of
        pipeline step ``it`` (a persistent GEMM's steps run on across its tiles), by default ``kt``."""
        st = imod(kt if it is None else it, S)
        k0 = imul(kt, BK)
        i0, j0, bz = pos["i0"], pos["j0"], pos["bz"]
        loads: list = [MbarrierArrive("bar", st, tx)]
        if isinstance(src_a, HeadsOperand):
            loads += src_a.boxes("sA", imul(st, a_stage), bz, i0, k0, bm_, BK, "bar", st, size)
        else:
            loads.append(src_a.box("sA", imul(st, a_stage), bz, i0, k0, bm_, "bar", st))
        if b_k_major:
            loads.append(src_b.box("sB", imul(st, b_stage), bz, j0, k0, bn_, "bar", st))
        else:
            loads += [src_b.box("sB", iadd(imul(st, b_stage), c(j * BK * row_elems)), bz, k0,
                                iadd(j0, c(j * row_elems)), BK, "bar", st) for j in range(bn_ // row_elems)]
        return loads

    def mmas(st: Expr, cw: Expr) -> None:
        """Consumer warpgroup ``cw``'s ``BK/16`` wgmmas on stage ``st``."""
        a_base = e.bind(iadd(imul(st, a_stage), imul(cw, WGMMA_M * a_width)), "sa")
        b_base = e.bind(imul(st, b_stage), "sb")
        for kk in range(BK // 16):
            box, step = divmod(16 * kk, a_width)  # A's box of a_width columns (one but for narrow heads)
            a_op = SmemMatrix("sA", iadd(a_base, c(box * bm_ * a_width + step)), a_width * size, 0, 8 * a_width * size)
            if b_k_major:
                b_op = SmemMatrix("sB", iadd(b_base, c(16 * kk)), SWIZZLE, 0, ATOM)
            else:  # 16 K-rows of 128 bytes per step; the next 64 columns of N one box (BK rows) on
                b_op = SmemMatrix("sB", iadd(b_base, c(16 * kk * row_elems)), SWIZZLE, BK * SWIZZLE, ATOM, "mn")
            e.emit(Wgmma(bn_, "acc", c(0), a_op, b_op))

    def epilogue(row: Expr, col: Expr, acc: Expr) -> None:
        bz = pos["bz"]
        e.regs[id(mm)] = e.bind(acc if acc.dtype == mm.dtype else Cast(acc, mm.dtype), "c")
        store_epilogue(e, group, (iadd(imul(bz, m), row), col) if flat else at(mm, bz, row, col))
        e.regs.pop(id(mm))

    def stores(cw: Expr, tid: Expr = TID_X) -> None:
        store_d_fragment(e, pos["i0"], pos["j0"], cw, (m, n), (bm_, bn_), epilogue, tid)

    def place(local: Expr, bid: Expr = BID_X) -> None:
        """Bind the output tile of this block's ``local``-th tile (a persistent GEMM): tile
        ``bid + local·blocks`` in grouped order — ``GROUP_M`` row tiles down one column of tiles,
        then the next column, so the blocks in flight share B's columns and A's rows in L2."""
        nt, mt, _ = tiles
        index = e.bind(iadd(bid, imul(local, grid[0])), "tile")
        per, width = nt * mt, GROUP_M * nt
        r = e.bind(imod(index, per), "r")
        first_m = e.bind(imul(idiv(r, width), GROUP_M), "m0")
        within = e.bind(imod(r, width), "w")
        if mt <= GROUP_M or mt % GROUP_M == 0:  # every group has min(mt, GROUP_M) row tiles
            row, col = imod(within, min(mt, GROUP_M)), idiv(within, min(mt, GROUP_M))
        else:  # the last group has fewer
            rows = e.bind(imin(Binary("sub", c(mt), first_m, INDEX), c(GROUP_M)), "gm")
            row, col = Binary("fmod", within, rows, INDEX), Binary("div", within, rows, INDEX)
        pos.update(bz=e.bind(idiv(index, per), "bz"), i0=e.bind(imul(iadd(first_m, row), bm_), "i0"),
                   j0=e.bind(imul(col, bn_), "j0"))

    if tile.persistent:
        _persistent(e, tile, k_tiles, first, wg, issue, mmas, lambda _cw: zero_accumulators(e, bn_), stores,
                    place, (math.prod(tiles), grid[0]))
    elif tile.producer:
        _specialized(e, tile, k_tiles, first, wg, issue, mmas, lambda _cw: zero_accumulators(e, bn_), stores)
    else:
        zero_accumulators(e, bn_)
        _mainloop(e, tile, k_tiles, first, wg, issue, mmas)
        stores(wg)
    shared = [Buffer("sA", dt, S * a_stage, "shared"), Buffer("sB", dt, S * b_stage, "shared"),
              Buffer("bar", DType.i64, 2 * S if tile.producer else S, "shared")]
    _check_shared(name, shared, target)
    meta = {"mapping": "wgmma-tma", **tile.meta(), "mma": f"m64n{bn_}k16.{dt.value}", **chosen}
    if tile.producer:
        meta["registers"] = {"producer": PRODUCER_REGS, "consumers": CONSUMER_REGS}
        meta["max_registers"] = min(launch_registers(tile.threads), CONSUMER_REGS)  # inc never lowers
    local = (Buffer("acc", DType.f32, bn_ // 2, "local"),) + ((Buffer("tile", INDEX, 4, "local"),)
                                                              if tile.persistent else ())
    kernel = Kernel(name, tuple(params), (1, 1, 1), (tile.threads, 1, 1), tuple(e.stmts), shared=tuple(shared),
                    local=local, meta=meta)
    return with_grid(kernel, grid)


def _full_and_empty_barriers(e: ValueEmitter, tile: WgTile, first: Expr) -> None:
    """A warp-specialised ring's mbarriers, initialised by thread 0 before a block barrier: stage
    ``s``'s *full* barrier ``bar[s]`` (the producer's one arrival) and *empty* one ``bar[S + s]``
    (an arrival from every consumer thread)."""
    S, consumer_threads = tile.stages, tile.consumers * WARPGROUP
    e.emit(If(first, tuple([*(MbarrierInit("bar", c(s), 1) for s in range(S)),
                            *(MbarrierInit("bar", c(S + s), consumer_threads) for s in range(S))])))
    e.emit(Barrier())


def _persistent(e: ValueEmitter, tile: WgTile, k_tiles: int, first: Expr, wg: Expr,
                issue: Callable[..., list], mmas: Callable[[Expr, Expr], None], start: Callable[[Expr], None],
                stores: Callable[[Expr, Expr], None], place: Callable[[Expr, Expr], None],
                work: tuple[int, int]) -> None:
    """:func:`_specialized`'s pipeline run over all of this block's output tiles: ``work = (tiles,
    blocks)``; block ``b`` computes tiles ``b, b + blocks, …``. Both roles loop over the block's
    tiles and, inside, over K; step ``g = tile·k_tiles + kt`` numbers the pipeline's steps across
    tiles, and stages and barrier phases follow ``g``, so the producer runs on into the next
    tile's first K tiles while the consumers finish and store the current one. The consumers'
    zeroing and stores sit between their K loops, after a wait for every wgmma, as in the
    one-tile kernel (a zeroing inside the K loop, under a condition, made ptxas inject waits and
    spill: the accumulators looked in flight). Both roles' loops have the same variables and
    bounds, which keeps cuda-sim's iteration-by-iteration interleaving (``jam_roles``, applied at
    both levels) exact."""
    S = tile.stages
    lead = S - 2
    total, blocks = work
    _full_and_empty_barriers(e, tile, first)
    mine = e.bind(idiv(iadd(Binary("sub", c(total), BID_X, INDEX), c(blocks - 1)), blocks), "mine")  # its tiles
    steps = e.bind(imul(mine, k_tiles), "steps")
    lt, kt = e.var("lt"), e.var("kt")
    with e.scope() as produce:
        e.emit(SetMaxNReg(PRODUCER_REGS, False))
        for p in range(lead):
            with e.scope() as first_copies:
                place(c(p // k_tiles))
                for x in issue(c(p % k_tiles), c(p)):
                    e.emit(x)
            cond = _and([first, _bool("lt", c(p), steps)])
            assert cond is not None
            e.emit(If(cond, tuple(first_copies)))
        with e.scope() as tile_body:
            with e.scope() as body:
                g = e.bind(iadd(imul(lt, k_tiles), kt), "g")
                nxt = e.bind(iadd(g, c(lead)), "nxt")
                more = _and([first, _bool("lt", nxt, steps)])
                released = _and([first, _bool("lt", nxt, steps), _bool("ge", g, c(2))])
                assert more is not None and released is not None
                stage = iadd(imod(nxt, S), c(S))
                parity = imod(idiv(Binary("sub", g, c(2), INDEX), S), 2)
                e.emit(If(released, (MbarrierWait("bar", stage, parity),)))
                with e.scope() as copies:
                    place(idiv(nxt, k_tiles))
                    for x in issue(imod(nxt, k_tiles), nxt):
                        e.emit(x)
                e.emit(If(more, tuple(copies)))
            e.emit(For(kt, c(0), c(k_tiles), 1, tuple(body)))
        e.emit(For(lt, c(0), mine, 1, tuple(tile_body)))
    with e.scope() as consume:
        e.emit(SetMaxNReg(CONSUMER_REGS, True))
        cw = e.bind(Binary("sub", wg, c(1), DType.i32), "cw")
        with e.scope() as tile_body:
            # What the epilogue's addresses derive from passes through the wait after the K loop, so
            # LLVM keeps their arithmetic below it (ptxas serialises the wgmmas, C7514, when any
            # instruction sits between the last K step and that wait); and through a wait here,
            # where none is in flight, so LLVM cannot re-derive them below the K loop either.
            for i, v in enumerate((lt, TID_X, BID_X, cw)):
                e.emit(Store("tile", c(i), v))
            e.emit(WgmmaWait(0, ("tile",)))
            start(cw)
            with e.scope() as body:
                g = e.bind(iadd(imul(lt, k_tiles), kt), "g")
                lag = _k_step(e, S, g, cw, mmas, None)
                release = MbarrierArrive("bar", iadd(imod(iadd(g, c(S - lag)), S), c(S)))
                e.emit(If(_bool("ge", g, c(lag)), (release,)))
            e.emit(For(kt, c(0), c(k_tiles), 1, tuple(body)))
            e.emit(WgmmaWait(0, ("acc", "tile")))
            local, tid, bid, cw_after = (e.bind(Load("tile", c(i), INDEX), "w") for i in range(4))
            place(local, bid)
            stores(cw_after, tid)
        e.emit(For(lt, c(0), mine, 1, tuple(tile_body)))
    e.emit(If(_bool("eq", wg, c(0)), tuple(produce), tuple(consume)))


@dataclass(frozen=True)
class RegisterA:
    """A fed from registers the consumers load themselves (wgmma's ``RegMatrix``; the Hopper
    convolution's im2col fragment): ``prefetch(kt)`` loads tile ``kt``'s fragment into the
    spare registers while the previous tile's wgmmas run, ``swap()`` makes them the ones the next
    wgmmas read. A wgmma reads its register A while it runs, so each K step waits for all its
    groups (not one behind) before the swap, and releases its own stage."""

    prefetch: Callable[[Expr], None]
    swap: Callable[[], None]


def _k_step(e: ValueEmitter, S: int, kt: Var, cw: Expr, mmas: Callable[[Expr, Expr], None],
            reg_a: RegisterA | None) -> int:
    """One consumer K step on stage ``kt % S``: wait for its bytes, multiply, commit, wait until
    ``lag`` groups are in flight (1 with A in shared memory, 0 with A in registers, whose next
    fragment is loaded meanwhile); returns ``lag``: tile ``kt - lag``'s stage is free."""
    st = e.bind(imod(kt, S), "st")
    e.emit(MbarrierWait("bar", st, imod(idiv(kt, S), 2)))
    e.emit(WgmmaFence())
    mmas(st, cw)
    e.emit(WgmmaCommit())
    if reg_a is None:
        e.emit(WgmmaWait(1, ("acc",)))
        return 1
    reg_a.prefetch(iadd(kt, c(1)))
    e.emit(WgmmaWait(0, ("acc",)))
    reg_a.swap()
    return 0


def zero_accumulators(e: ValueEmitter, n: int) -> None:
    """A consumer thread's ``n/2`` f32 accumulators (``acc``) of a 64 × ``n`` tile set to 0."""
    _strided_loop(e, c(0), n // 2, 1, lambda u: e.emit(Store("acc", u, Const(0.0, DType.f32))), "u", unroll=True)


def store_d_fragment(e: ValueEmitter, i0: Expr, j0: Expr, cw: Expr, lims: tuple[int, int], tile: tuple[int, int],
                     epilogue: Callable[[Expr, Expr, Expr], None], tid: Expr = TID_X) -> None:
    """Consumer warpgroup ``cw``'s ``tile[1]/2`` accumulators of the tile at ``(i0, j0)`` through
    ``epilogue(row, col, acc)`` at the rows and columns the D layout gives them, guarded where the
    ``lims`` (rows, columns) are not whole tiles; ``tid``: the thread index (a copy of it that
    passed through the wgmma wait, in a persistent GEMM)."""
    t = tid
    lane = imod(t, 32)
    g, q = e.bind(idiv(lane, 4), "g"), e.bind(imul(imod(lane, 4), 2), "q")
    wrow = e.bind(iadd(i0, iadd(imul(cw, WGMMA_M), imul(imod(idiv(t, 32), 4), 16))), "wrow")

    def element(i: Var) -> None:
        half = Binary("shr", i, c(1), DType.i32)
        row = e.bind(iadd(iadd(wrow, g), imul(imod(half, 2), 8)), "row")
        col = e.bind(iadd(j0, iadd(imul(Binary("shr", i, c(2), DType.i32), 8), iadd(q, imod(i, 2)))), "col")
        guard = _and([_bool("lt", v, c(lim)) for v, lim, sz in zip((row, col), lims, tile) if not divisible(lim, sz)])
        _guarded(e, guard, lambda: epilogue(row, col, Load("acc", i, DType.f32)))

    _strided_loop(e, c(0), tile[1] // 2, 1, element, "ci", unroll=True)


def _mainloop(e: ValueEmitter, tile: WgTile, k_tiles: int, first: Expr, wg: Expr, issue: Callable[[Expr], list],
              mmas: Callable[[Expr, Expr], None], reg_a: RegisterA | None = None) -> None:
    """Every warpgroup computes; thread 0 also issues the copies (one mbarrier per stage), and a
    block barrier after each K step says the stage one back is free to refill."""
    S = tile.stages
    e.emit(If(first, tuple(MbarrierInit("bar", c(s), 1) for s in range(S))))
    e.emit(Barrier())
    prologue = [x for p in range(min(S - 1, k_tiles)) for x in issue(c(p))]
    e.emit(If(first, tuple(prologue)))

    def k_tile(kt: Var) -> None:
        _k_step(e, S, kt, wg, mmas, reg_a)
        e.emit(Barrier())  # every warpgroup is done with stage kt-1: refill it with tile kt+S-1
        nxt = iadd(kt, c(S - 1))
        cond = _and([first, _bool("lt", nxt, c(k_tiles))])
        assert cond is not None
        e.emit(If(cond, tuple(issue(nxt))))

    _strided_loop(e, c(0), k_tiles, 1, k_tile, "kt")
    e.emit(WgmmaWait(0, ("acc",)))


def _specialized(e: ValueEmitter, tile: WgTile, k_tiles: int, first: Expr, wg: Expr, issue: Callable[[Expr], list],
                 mmas: Callable[[Expr, Expr], None], start: Callable[[Expr], None],
                 stores: Callable[[Expr], None], reg_a: RegisterA | None = None) -> None:
    """Warpgroup 0 produces, the others consume, each role its own loop (so the producer holds no
    accumulators and gives its registers up); no block barrier after the start. Stage ``s`` has a
    *full* barrier ``bar[s]`` (the producer's arrival announcing the bytes, then the copies) and an
    *empty* one ``bar[S + s]`` (one arrival per consumer thread once the wgmmas reading the stage
    are done). The producer copies tiles ``0 … S-3`` first; in its iteration ``kt`` it waits until
    tile ``kt-2`` is released (the empty barrier's phase ``(kt-2)/S``: its stage is the one tile
    ``kt+S-2`` goes to) and copies that tile. Consumer iteration ``kt`` waits for tile ``kt``'s
    full phase ``kt/S``, multiplies, waits until one group is in flight and releases tile ``kt-1``
    (with A in registers, ``RegisterA``: waits for all and releases tile ``kt`` itself).
    On the GPU each role runs at its own pace, the producer up to ``S-2`` tiles ahead (one stage
    is the group still in flight, one the tile being multiplied). cuda-sim runs the two loops
    interleaved iteration by iteration (``codegen.simt.jam_roles``), every wait a cut whose phase
    it checks; that the releases a producer waits for come from an earlier iteration is what
    makes that interleaving run."""
    S = tile.stages
    lead = S - 2
    assert lead >= 1, "a specialised pipeline needs 3 stages or more"
    _full_and_empty_barriers(e, tile, first)
    kt = e.var("kt")
    with e.scope() as produce:
        e.emit(SetMaxNReg(PRODUCER_REGS, False))
        e.emit(If(first, tuple(x for p in range(min(lead, k_tiles)) for x in issue(c(p)))))
        with e.scope() as body:
            nxt = iadd(kt, c(lead))
            more = _and([first, _bool("lt", nxt, c(k_tiles))])
            released = _and([first, _bool("lt", nxt, c(k_tiles)), _bool("ge", kt, c(2))])
            assert more is not None and released is not None
            stage = iadd(imod(nxt, S), c(S))
            parity = imod(idiv(Binary("sub", kt, c(2), DType.i32), S), 2)
            e.emit(If(released, (MbarrierWait("bar", stage, parity),)))
            e.emit(If(more, tuple(issue(nxt))))
        e.emit(For(kt, c(0), c(k_tiles), 1, tuple(body)))
    with e.scope() as consume:
        e.emit(SetMaxNReg(CONSUMER_REGS, True))
        cw = e.bind(Binary("sub", wg, c(1), DType.i32), "cw")  # consumer cw owns rows 64·cw … of the tile
        start(cw)
        with e.scope() as body:
            lag = _k_step(e, S, kt, cw, mmas, reg_a)  # tile kt-lag's products are done: release its stage
            release = MbarrierArrive("bar", iadd(imod(iadd(kt, c(S - lag)), S), c(S)))
            e.emit(If(_bool("ge", kt, c(lag)), (release,)) if lag else release)
        e.emit(For(kt, c(0), c(k_tiles), 1, tuple(body)))
        e.emit(WgmmaWait(0, ("acc",)))
        stores(cw)
    e.emit(If(_bool("eq", wg, c(0)), tuple(produce), tuple(consume)))
