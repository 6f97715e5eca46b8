"""Tensor-core GEMM: f16/bf16 matmuls on sm_80+ as warps of ``mma.sync.m16n8k16``.

The mapping (one thread block per ``BM × BN`` tile of C, the K loop in steps of ``BK``):

* **Warps own warp tiles.** The block's ``WM × WN`` warps each compute a ``BM/WM × BN/WN`` part
  of the tile as ``MI × NI`` MMA tiles of 16×8; a lane holds ``MI·NI·4`` f32 accumulators
  (registers: a ``local`` array indexed by constants once the loops are unrolled).
* **Tiles are staged in shared memory** in the operands' own dtype, loaded cooperatively
  (consecutive threads read consecutive elements of a row: coalesced for row-major operands),
  zero outside the matrices — any fused producer (a transpose, a cast, a slice) is evaluated
  as the tile loads, exactly as in the CUDA-core mapping. A row-major buffer operand is copied
  by ``cp.async`` in 16-byte chunks into two stages instead; each 8 lanes (one shared-memory
  wavefront) write either 8 consecutive chunks of a row or — for A's 4-chunk rows — one chunk
  column of 8 rows, which the odd 16-byte row stride (80 bytes) puts in 8 different bank groups.
* **Fragments come from ``ldmatrix``.** A: ``.x4`` per 16×16 piece (lane ``l`` addresses row
  ``l % 16``, column ``8·(l // 16)``). B is K×N row-major, so ``.x4.trans`` gives two 16×8
  B fragments at once (lanes 0–7/8–15 address k rows 0–7/8–15 of columns 0–7, lanes 16–31 the
  same of columns 8–15). Rows are padded by 8 elements (16 bytes): a row of A is then 80 bytes
  and of B ``2·BN + 16``, so the 8 row addresses of each 8×8 matrix fall in 8 different groups
  of 4 banks — conflict-free — and every row start stays 16-byte aligned as ldmatrix requires.
* **The epilogue** (bias, activation, residual, the cast to the output dtype) runs per
  accumulator element at the row and column the PTX ISA's C layout gives it
  (``kernel.fragments``: row ``lane/4 (+8)``, column ``2·(lane%4) (+1)``), guarded at the edges.

Tiles are chosen per problem from :data:`CANDIDATES` by :func:`choose_tile`; accumulation is
f32, as torch's f16/bf16 matmuls on the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.symbolic import SymDim
from sextant.kernel.fragments import MMA_SHAPES
from sextant.kernel.ir import (
    Barrier,
    Binary,
    Buffer,
    Cast,
    Const,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    Expr,
    If,
    Kernel,
    LdMatrix,
    Load,
    Mma,
    Store,
    Var,
)
from sextant.kernel.sizes import capacity, with_grid
from sextant.schedule.gemm_cost import TileEstimate, estimate
from sextant.schedule.gpu_kernels import TID_X, _and, _bool, _check_shared, _grid, _guarded, _strided_loop
from sextant.schedule.indexing import ValueEmitter, accum_dtype, c, delinearize, divisible, iadd, idiv, imod, imul
from sextant.schedule.kernels import setup_kernel, store_epilogue
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc, sm_version
from sextant.schedule.tuning import choose
from sextant.schedule.views import chunked

MMA = MMA_SHAPES[((16, 8, 16), "f16")]  # the layout is the same for bf16
PAD = 8  # elements added to each shared row (16 bytes): conflict-free, aligned ldmatrix rows
STAGES = 2  # shared-memory stages by default: tile kt+1 is copied (cp.async) while tile kt is multiplied
TC_DTYPES = (DType.f16, DType.bf16)


@dataclass(frozen=True)
class TcTile:
    """A block tile ``bm × bn × bk`` computed by ``wm × wn`` warps; ``registers``: what ptxas
    gives its kernel per thread (sm_80/sm_90, with an epilogue; a test keeps the figure honest),
    for the occupancy in the tile choice's cost model (``schedule/gemm_cost.py``)."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    registers: int = 128
    stages: int = STAGES  # shared-memory stages of the K pipeline: tiles kt+1 .. kt+stages-1 in flight

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def mi(self) -> int:  # 16-row MMA tiles per warp
        return self.bm // self.wm // MMA.m

    @property
    def ni(self) -> int:  # 8-column MMA tiles per warp
        return self.bn // self.wn // MMA.n

    def shared_elems(self) -> tuple[int, int]:
        return self.bm * (self.bk + PAD), self.bk * (self.bn + PAD)

    @property
    def name(self) -> str:
        """How a tuning table names the candidate: ``128x128x64/w2x4/s2``."""
        return f"{self.bm}x{self.bn}x{self.bk}/w{self.wm}x{self.wn}/s{self.stages}"

    def meta(self) -> dict:
        """What a kernel built on this tile records: its shape, and ``max_registers`` (ptxas's
        ``.maxnreg``), so the occupancy the cost model assumes is what ptxas builds."""
        return {"tile": (self.bm, self.bn, self.bk), "warps": (self.wm, self.wn),
                "warp_tile": (self.bm // self.wm, self.bn // self.wn), "max_registers": self.registers}


# 128×128 (8 warps) and 128×64 (4 warps) give each warp a 64×32 tile (16 MMAs per 6 ldmatrix a
# k-step); 64×64 for problems with too few larger tiles to occupy the GPU's SMs. 128×128 walks K
# 64 deep (2 × 35 KiB stages, dynamic shared memory): half the barriers and cp.async waits per
# MMA of a 32-deep step; on an H200 (tools/tile_study, docs/benchmarks.md) it ran 4096³ fp16 in
# 0.475 ms against 0.52 for 128×128×32 and 2048³ 11 % faster, GPT-2's 3072→768 layer 12 % faster,
# its 768→3072 one 12 % slower (one run each; repeat spread ~15 % at 0.1 ms). The 4-warp tiles
# (fewer warps to switch between) keep a third tile in flight (3 × 15 KiB, 3 × 10 KiB) — a fourth
# for 64×64 fit too, but ptxas then gave it 147 registers instead of ≤ 112. 256×128 and 128×256
# (64×64 warp tiles, ~210 registers, 1 block/SM) were 6–16 % slower than 128×128 on the H200.
CANDIDATES = (TcTile(128, 128, 64, 2, 4, registers=128, stages=2),
              TcTile(128, 64, 32, 2, 2, registers=144, stages=3),
              TcTile(64, 64, 32, 2, 2, registers=112, stages=3))


def gemm_operands(e: ValueEmitter, a: Node, b: Node, bidx: tuple[Expr, ...],
                  batch: list[int]) -> tuple[Operand, Operand]:
    """How the GEMM reads ``A`` and ``B`` of ``A·B``. A tile is copied by ``cp.async`` whenever the
    operand is a strided view of a buffer with contiguous rows (``views.chunked``: the buffer, or a
    reshape/slice/permute of it — a ``[B, S, D]`` activation seen as ``[B·S, D]``). ``B`` whose
    *columns* are contiguous (``Wᵀ`` of a Linear's stored ``N×K`` weight) is staged ``N×K`` — the
    layout ``mma``'s B operand wants — instead of gathering one strided element per lane; any other
    operand (a fused producer) is evaluated element by element as its tile loads."""
    a_op = Operand(lambda r, col: ([], lambda: e.value(a, (*bidx, r, col))), chunked(a, e.buffers, bidx, -2, -1))
    b_nk = chunked(b, e.buffers, bidx, -1, -2)  # (n, k) -> chunk along k
    if b_nk is not None:
        return a_op, Operand(lambda n, k: ([], lambda: e.value(b, (*bidx, k, n))), b_nk, nk=True)
    bt = transposed_source(b, e.buffers, batch)
    if bt is not None:  # Wᵀ whose rows are not whole chunks: still N×K, element by element
        return a_op, Operand(lambda n, k: ([], lambda: e.value(bt, (*bidx, n, k))), None, nk=True)
    return a_op, Operand(lambda k, n: ([], lambda: e.value(b, (*bidx, k, n))), chunked(b, e.buffers, bidx, -2, -1))


def transposed_source(b: Node, buffers: dict[int, str], batch: list[int]) -> Node | None:
    """The stored ``W`` when ``b`` is ``Wᵀ`` (a permute swapping the last two dims of a kernel
    buffer, as a Linear layer's weight): its tiles are staged N×K, rows contiguous along K — the
    layout ``mma``'s B operand ("col") wants, read by plain ``ldmatrix`` — instead of gathering
    one strided element per lane."""
    if b.op != "permute" or id(b) in buffers:
        return None
    rank = len(b.shape)
    if list(b.attr("perm")) != [*range(rank - 2), rank - 1, rank - 2]:
        return None
    w = b.inputs[0]
    return w if id(w) in buffers and list(w.shape[:-2]) == list(batch) else None


def half_product(mm: Node, target: TargetDesc) -> bool:
    """An f16/bf16 matmul (to f16/bf16, or to f32: split-K's partials) on sm_80 or newer
    (mma.sync m16n8k16 with f32 accumulation)."""
    if not target.is_gpu or sm_version(target) < 80:
        return False
    a, b = mm.inputs
    return (a.dtype == b.dtype and a.dtype in TC_DTYPES and mm.dtype in (a.dtype, DType.f32)
            and mm.type.numel > 0)


def tensor_core_product(mm: Node, target: TargetDesc) -> bool:
    """A matmul node the GPU runs on tensor cores: f16/bf16 (:func:`half_product`), or f32 when the
    target allows tf32 (``gpu_tf32``)."""
    a, b = mm.inputs
    tf32 = (target.is_gpu and target.tf32 and sm_version(target) >= 80 and mm.type.numel > 0
            and a.dtype == b.dtype == mm.dtype == DType.f32)
    return half_product(mm, target) or tf32


def uses_tensor_cores(group: Group, target: TargetDesc) -> bool:
    """The group's matmul runs on the f16/bf16 tensor-core GEMM below."""
    return half_product(group.anchor, target)


def rank_tiles(m: int, n: int, batch: int, target: TargetDesc, candidates: tuple[TcTile, ...] = CANDIDATES,
               itemsize: int = 2) -> list[tuple[TileEstimate, TcTile]]:
    """Every candidate with the cost model's estimate for this problem, best first (ties: the
    order of ``candidates``) — what an autotuner would time on a real GPU."""
    ranked = []
    for tile in candidates:
        shared = tile.stages * sum(tile.shared_elems()) * itemsize
        ranked.append((estimate(tile.bm, tile.bn, tile.threads, tile.registers, shared, m, n, batch, target,
                                itemsize), tile))
    return sorted(ranked, key=lambda et: et[0].seconds)


def choose_tile(m: int, n: int, batch: int, target: TargetDesc,
                candidates: tuple[TcTile, ...] = CANDIDATES, itemsize: int = 2) -> TcTile:
    """The candidate the cost model ranks first (``schedule/gemm_cost.py``)."""
    return rank_tiles(m, n, batch, target, candidates, itemsize)[0][1]


def tuned_tile(mapping: str, m: int, n: int, k: int, batch: int, dtype: DType, target: TargetDesc,
               candidates: tuple[TcTile, ...] = CANDIDATES) -> tuple[TcTile, dict]:
    """The tile of this problem: the target's tuning table's choice (``schedule/tuning.py``), else
    the cost model's; with the meta its kernel records (the problem, the candidates)."""
    return choose(mapping, m, n, k, batch, dtype, target, candidates,
                  choose_tile(m, n, batch, target, candidates, dtype.itemsize))


@dataclass(frozen=True)
class Operand:
    """How the tiles of one GEMM operand are read. ``element(row, col)`` gives the conditions
    under which the element is loaded rather than zero (a convolution's padding) and a thunk
    emitting its value — any fused producer is evaluated there; ``chunk(row, col)``, when given,
    the buffer and flat index of a row-major operand whose rows are whole 16-byte chunks (copied
    by ``cp.async``); ``nk``: B staged N×K (the operand is ``Wᵀ`` of a stored N×K ``W``)."""

    element: Callable[[Expr, Expr], tuple[list[Expr], Callable[[], Expr]]]
    chunk: Callable[[Expr, Expr], tuple[str, Expr]] | None = None
    nk: bool = False


def stage_tile(e: ValueEmitter, threads: int, dt: DType, buf: str, x: Operand, rows: int, cols: int, stride: int,
               row0: Expr, col0: Expr, row_lim: int, col_lim: int, base: Expr) -> None:
    """``buf[base + r·stride + col] = x[row0 + r, col0 + col]`` for one ``rows × cols`` tile, zero
    outside the matrix, by the block's ``threads`` together: by ``cp.async`` in 16-byte chunks
    when ``x`` has them, else element by element (its producer evaluated as it loads)."""
    t = TID_X
    if x.chunk is not None:
        chunk = 16 // dt.itemsize
        cpr = cols // chunk  # chunks per tile row
        for p in range(rows * cols // chunk // threads):
            el = iadd(t, c(p * threads))
            if cpr >= 8:  # 8 consecutive lanes (one shared-memory wavefront) write 8 consecutive chunks
                r, col = e.bind(idiv(el, cpr), "r"), e.bind(imul(imod(el, cpr), chunk), "cc")
            else:  # ... or one chunk column of 8 rows, whose odd 16-byte stride spreads them over the banks
                r = e.bind(iadd(imod(el, 8), imul(idiv(el, 8 * cpr), 8)), "r")
                col = e.bind(imul(imod(idiv(el, 8), cpr), chunk), "cc")
            gr, gc = e.bind(iadd(row0, r), "gr"), e.bind(iadd(col0, col), "gc")
            guard = _and([_bool("lt", v, c(lim)) for v, lim, size in ((gr, row_lim, rows), (gc, col_lim, cols))
                          if not divisible(lim, size)])  # a chunk is all in or all out: col_lim is a multiple of it
            src, at = x.chunk(gr, gc)
            e.emit(CpAsync(buf, iadd(base, iadd(imul(r, stride), col)), src, at, chunk, guard))
        return
    for p in range(rows * cols // threads):
        el = iadd(t, c(p * threads))
        r, col = e.bind(idiv(el, cols), "r"), e.bind(imod(el, cols), "cc")
        gr, gc = e.bind(iadd(row0, r), "gr"), e.bind(iadd(col0, col), "gc")
        slot = iadd(base, iadd(imul(r, stride), col))
        extra, value = x.element(gr, gc)
        guard = _and([_bool("lt", v, c(lim)) for v, lim, size in ((gr, row_lim, rows), (gc, col_lim, cols))
                      if not divisible(lim, size)] + extra)
        _guarded(e, guard, lambda slot=slot, value=value: e.emit(Store(buf, slot, value())),
                 lambda slot=slot: e.emit(Store(buf, slot, Const(0.0, dt))))


def emit_mma_gemm(e: ValueEmitter, tile: TcTile, dt: DType, m: int, n: int, k: int, bm: Expr, bn: Expr,
                  a: Operand, b: Operand, epilogue: Callable[[Expr, Expr, Expr], None],
                  out_dtype: DType | None = None) -> tuple[list[Buffer], tuple[Buffer, ...]]:
    """The block's ``tile`` of ``C = A·B`` (``m × n``, depth ``k``; block coordinates ``bm``,
    ``bn``) on tensor cores, then ``epilogue(row, col, value)`` per element of C the block owns
    (under its edge guard). When C's dtype ``out_dtype`` is the operands' (f16/bf16), the tile is
    staged through ``As`` for coalesced stores and ``value`` is already rounded to it; otherwise
    ``value`` is the f32 accumulator. Returns the shared and local buffers the statements use.
    Shared by the matmul and the implicit-GEMM convolution."""
    acc_t = DType.f32
    a_stride, b_stride = tile.bk + PAD, (tile.bk if b.nk else tile.bn) + PAD
    sa, sb = tile.shared_elems()
    if b.nk:
        sb = tile.bn * b_stride
    mi, ni = tile.mi, tile.ni
    shared = [Buffer("As", dt, tile.stages * sa, "shared"), Buffer("Bs", dt, tile.stages * sb, "shared")]
    local = (Buffer("fa", dt, mi * MMA.a_elems, "local"), Buffer("fb", dt, ni * MMA.b_elems, "local"),
             Buffer("acc", acc_t, mi * ni * MMA.c_elems, "local"))
    t = TID_X
    lane = e.bind(imod(t, 32), "lane")
    warp = e.bind(idiv(t, 32), "warp")
    wrow = e.bind(imul(idiv(warp, tile.wn), tile.bm // tile.wm), "wrow")  # the warp tile's first row ...
    wcol = e.bind(imul(imod(warp, tile.wn), tile.bn // tile.wn), "wcol")  # ... and column in the block tile
    i0 = e.bind(imul(bm, tile.bm), "i0")
    j0 = e.bind(imul(bn, tile.bn), "j0")
    zero = Const(0.0, acc_t)
    _strided_loop(e, c(0), mi * ni * MMA.c_elems, 1, lambda u: e.emit(Store("acc", u, zero)), "u", unroll=True)

    a_row = iadd(wrow, imod(lane, 16))  # ldmatrix row addresses of this lane (see the module doc)
    a_col = imul(idiv(lane, 16), 8)
    if not b.nk:  # Bs is K×N: .trans; lanes 0-15 address k rows of n 0-7, lanes 16-31 of n 8-15
        b_row = iadd(imul(imod(idiv(lane, 8), 2), 8), imod(lane, 8))
        b_col = iadd(wcol, imul(idiv(lane, 16), 8))
    else:  # Bs is N×K (mma's own "col" B): no .trans; lane l addresses n row 8(l/16) + l%8, k 8((l/8)%2)
        b_row = iadd(wcol, iadd(imul(idiv(lane, 16), 8), imod(lane, 8)))
        b_col = imul(imod(idiv(lane, 8), 2), 8)

    def k_step(a_base: Expr, b_base: Expr) -> None:
        for ks in range(0, tile.bk, MMA.k):
            for x in range(mi):
                e.emit(LdMatrix("fa", c(x * MMA.a_elems), "As",
                                iadd(a_base, iadd(imul(iadd(a_row, c(x * 16)), a_stride), iadd(a_col, c(ks)))), 4))
            for p in range(ni // 2):
                if not b.nk:
                    at = iadd(imul(iadd(b_row, c(ks)), b_stride), iadd(b_col, c(p * 16)))
                else:
                    at = iadd(imul(iadd(b_row, c(p * 16)), b_stride), iadd(b_col, c(ks)))
                e.emit(LdMatrix("fb", c(p * 2 * MMA.b_elems), "Bs", iadd(b_base, at), 4, trans=not b.nk))

            def mma_row(x: Var) -> None:
                def mma(y: Var) -> None:
                    acc = imul(iadd(imul(x, ni), y), MMA.c_elems)
                    e.emit(Mma((16, 8, 16), "acc", acc, "fa", imul(x, MMA.a_elems), "fb", imul(y, MMA.b_elems),
                               "acc", acc))

                _strided_loop(e, c(0), ni, 1, mma, "nj", unroll=True)

            _strided_loop(e, c(0), mi, 1, mma_row, "mi", unroll=True)

    pipelined_k_loop(e, tile, dt, m, n, k, i0, j0, a, b, (a_stride, b_stride), (sa, sb), k_step)
    stage = ("As", dt, tile.stages * sa) if out_dtype == dt else None
    store_accumulators(e, tile, m, n, i0, j0, wrow, wcol, lane, epilogue, stage)
    return shared, local


def pipelined_k_loop(e: ValueEmitter, tile: TcTile, dt: DType, m: int, n: int, k: int, i0: Expr, j0: Expr,
                     a: Operand, b: Operand, strides: tuple[int, int], stage_elems: tuple[int, int],
                     step: Callable[[Expr, Expr], None]) -> None:
    """The K loop of the tensor-core GEMMs, ``S = tile.stages`` shared-memory stages deep: tiles
    ``0 .. S-2`` are staged before the loop (one ``cp.async`` group each); each iteration issues
    tile ``kt + S - 1`` into the stage iteration ``kt - 1`` used, waits until at most ``S - 1``
    groups are in flight (so tile ``kt``'s has landed) and a barrier, runs ``step(a_base,
    b_base)`` on stage ``kt % S`` (the offsets of A's and B's tile in ``As``/``Bs``), and ends on a
    barrier before that stage is refilled. Every iteration commits a group, empty past the last
    tile, so the count of groups in flight stays exact."""
    (a_stride, b_stride), (sa, sb) = strides, stage_elems
    k_tiles = -(-k // tile.bk)
    stages = tile.stages

    def load_stage(kt: Expr) -> None:
        """Tile ``kt`` of A and B into stage ``kt % stages``, as one cp.async group."""
        st = imod(kt, stages)
        k0 = e.bind(imul(kt, tile.bk), "k0")
        stage_tile(e, tile.threads, dt, "As", a, tile.bm, tile.bk, a_stride, i0, k0, m, k, imul(st, sa))
        if not b.nk:
            stage_tile(e, tile.threads, dt, "Bs", b, tile.bk, tile.bn, b_stride, k0, j0, k, n, imul(st, sb))
        else:
            stage_tile(e, tile.threads, dt, "Bs", b, tile.bn, tile.bk, b_stride, j0, k0, n, k, imul(st, sb))

    for p in range(stages - 1):  # the prologue: the first tiles are in flight before the loop starts
        if isinstance(k_tiles, SymDim):  # (a uniform branch: the size is the same in every thread)
            with e.scope() as first:
                load_stage(c(p))
            e.emit(If(_bool("lt", c(p), c(k_tiles)), tuple(first)))
        elif p < k_tiles:
            load_stage(c(p))
        e.emit(CpAsyncCommit())

    def k_tile(kt: Var) -> None:
        nxt = iadd(kt, c(stages - 1))  # issue a later tile into the freed stage, then wait for this one
        with e.scope() as prefetch:
            load_stage(nxt)
        e.emit(If(_bool("lt", nxt, c(k_tiles)), tuple(prefetch)))
        e.emit(CpAsyncCommit())
        e.emit(CpAsyncWait(stages - 1))
        e.emit(Barrier())
        step(e.bind(imul(imod(kt, stages), sa), "sa"), e.bind(imul(imod(kt, stages), sb), "sb"))
        e.emit(Barrier())

    _strided_loop(e, c(0), k_tiles, 1, k_tile, "kt")


def c_fragment(x: Expr, y: Expr, i: Expr, g: Expr, q: Expr, ni: int) -> tuple[Expr, Expr, Expr]:
    """Where accumulator ``i`` of MMA tile ``(x, y)`` of a lane's warp tile lies: its row and column in
    the warp tile (the C layout: row ``g = lane/4`` (+8), column ``q = 2·(lane%4)`` (+1)) and its
    slot in the local ``acc``."""
    half = Binary("shr", i, c(1), DType.i32)
    return (iadd(iadd(imul(x, 16), g), imul(half, 8)), iadd(iadd(imul(y, 8), q), imod(i, 2)),
            iadd(imul(iadd(imul(x, ni), y), MMA.c_elems), i))


def store_accumulators(e: ValueEmitter, tile: TcTile, m: int, n: int, i0: Expr, j0: Expr, wrow: Expr, wcol: Expr,
                       lane: Expr, epilogue: Callable[[Expr, Expr, Expr], None],
                       stage: tuple[str, DType, int] | None = None) -> None:
    """``epilogue(row, col, value)`` for every element of the block's tile of C, guarded at the
    matrix edges.

    With ``stage`` — a shared buffer of the output's 16-bit dtype that the K loop is done with, and
    its size — the tile goes through shared memory (:func:`staged_epilogue`): the epilogue then
    runs with consecutive threads on consecutive columns, so its stores (and the residuals it
    reads) are coalesced; ``value`` is the accumulator already rounded to that dtype. Without, each
    lane runs it on its own f32 accumulators where the C layout puts them (row ``lane/4`` (+8),
    column ``2·(lane%4)`` (+1)): a warp's store then touches 8 rows × 16 bytes."""
    mi, ni = tile.mi, tile.ni
    g, q = e.bind(idiv(lane, 4), "g"), e.bind(imul(imod(lane, 4), 2), "q")  # C layout: row g (+8), col 2t (+1)
    if stage is not None:
        staged_epilogue(e, tile, m, n, i0, j0, wrow, wcol, g, q, epilogue, stage)
        return

    def out_tile(x: Var) -> None:
        def out_col(y: Var) -> None:
            def element(i: Var) -> None:
                frow, fcol, slot = c_fragment(x, y, i, g, q, ni)
                row = e.bind(iadd(iadd(i0, wrow), frow), "row")
                col = e.bind(iadd(iadd(j0, wcol), fcol), "col")
                guard = _and([_bool("lt", v, c(lim)) for v, lim, size in ((row, m, tile.bm), (col, n, tile.bn))
                              if not divisible(lim, size)])
                _guarded(e, guard, lambda: epilogue(row, col, Load("acc", slot, DType.f32)))

            _strided_loop(e, c(0), MMA.c_elems, 1, element, "ci", unroll=True)

        _strided_loop(e, c(0), ni, 1, out_col, "nj", unroll=True)

    _strided_loop(e, c(0), mi, 1, out_tile, "mi", unroll=True)


def staged_epilogue(e: ValueEmitter, tile: TcTile, m: int, n: int, i0: Expr, j0: Expr, wrow: Expr, wcol: Expr,
                    g: Expr, q: Expr, epilogue: Callable[[Expr, Expr, Expr], None],
                    stage: tuple[str, DType, int]) -> None:
    """The tile of C through shared memory, ``rows`` rows a pass (as many whole warp tiles of rows as
    the buffer holds): the warps owning those rows write their accumulators, rounded to the
    output's dtype, at a row stride of ``bn + 8`` elements (``≡ 4 words mod 32``: the 8 rows × 4
    lanes of a store hit 32 different banks); a barrier; then the block's threads walk the rows in
    order — thread ``t`` takes columns ``t, t + threads, ...`` — reading shared memory and running
    the epilogue; a barrier before the next pass overwrites the buffer."""
    buf, dt, capacity = stage
    stride = tile.bn + PAD
    warp_rows = tile.bm // tile.wm
    fits = [d * warp_rows for d in range(tile.wm, 0, -1) if tile.wm % d == 0 and d * warp_rows * stride <= capacity]
    if not fits:
        raise ValueError(f"a {tile.bm}x{tile.bn} tile's warp rows do not fit {capacity} elements of {buf}")
    rows = fits[0]  # whole warp tiles of rows, dividing the tile: every pass is full
    mi, ni, threads = tile.mi, tile.ni, tile.threads
    for p in range(-(-tile.bm // rows)):
        if p:
            e.emit(Barrier())  # every thread has read the previous pass

        def write(x: Var, p: int = p) -> None:
            def write_col(y: Var) -> None:
                def element(i: Var) -> None:
                    frow, fcol, slot = c_fragment(x, y, i, g, q, ni)
                    r, col = iadd(iadd(wrow, c(-p * rows)), frow), iadd(wcol, fcol)
                    e.emit(Store(buf, iadd(imul(r, stride), col), Cast(Load("acc", slot, DType.f32), dt)))

                _strided_loop(e, c(0), MMA.c_elems, 1, element, "ci", unroll=True)

            _strided_loop(e, c(0), ni, 1, write_col, "nj", unroll=True)

        with e.scope() as mine:  # the warps whose rows this pass holds (a warp-uniform condition)
            _strided_loop(e, c(0), mi, 1, write, "mi", unroll=True)
        if rows == tile.bm:
            e.stmts.extend(mine)
        else:
            e.emit(If(_bool("eq", idiv(wrow, rows), c(p)), tuple(mine)))
        e.emit(Barrier())

        def read(v: Var, p: int = p) -> None:
            r, col = e.bind(idiv(v, tile.bn), "r"), e.bind(imod(v, tile.bn), "cc")
            row, gcol = e.bind(iadd(i0, iadd(r, c(p * rows))), "row"), e.bind(iadd(j0, col), "col")
            guard = _and([_bool("lt", v2, c(lim)) for v2, lim, size in ((row, m, tile.bm), (gcol, n, tile.bn))
                          if not divisible(lim, size)])
            _guarded(e, guard, lambda: epilogue(row, gcol, Load(buf, iadd(imul(r, stride), col), dt)))

        _strided_loop(e, TID_X, rows * tile.bn, threads, read, "u")


def tensor_core_matmul_kernel(group: Group, stored: set[int], target: TargetDesc, name: str, tile: TcTile,
                              emit: Callable[..., tuple[list[Buffer], tuple[Buffer, ...]]], mapping: str,
                              mma: str, chosen: dict | None = None) -> Kernel:
    """A matmul group as one tensor-core GEMM per ``tile`` of C: the grid, the operands
    (``gemm_operands``) and the fused epilogue around ``emit`` (``emit_mma_gemm`` or the tf32 body,
    called as ``emit(e, tile, m, n, k, bm, bn, a, b, epilogue)``); ``chosen``: how the tile was
    chosen (``tuning.pick``'s meta)."""
    mm = group.anchor
    a, b = mm.inputs
    *batch, m, k = a.shape
    n = b.shape[-1]
    nb = math.prod(batch)
    e, params, _ = setup_kernel(group, stored)
    grid, (bn, bm, bz) = _grid(e, (-(-n // tile.bn), -(-m // tile.bm), nb))
    bidx = delinearize(bz, batch) if batch else ()
    a_op, b_op = gemm_operands(e, a, b, bidx, batch)

    def epilogue(row: Expr, col: Expr, acc: Expr) -> None:
        e.regs[id(mm)] = e.bind(acc if acc.dtype == mm.dtype else Cast(acc, mm.dtype), "c")
        store_epilogue(e, group, (*bidx, row, col))
        e.regs.pop(id(mm))

    shared, local = emit(e, tile, m, n, k, bm, bn, a_op, b_op, epilogue, out_dtype=mm.dtype)
    _check_shared(name, shared, target)
    meta = {"mapping": mapping, **tile.meta(), "mma": mma, **(chosen or {})}
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), (tile.threads, 1, 1), tuple(e.stmts),
                            shared=tuple(shared), local=local, meta=meta), grid)


def gpu_mma_matmul_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    mm = group.anchor
    (*batch, m, _), n, dt = mm.inputs[0].shape, mm.shape[-1], mm.inputs[0].dtype
    if accum_dtype(mm.dtype) != DType.f32:
        raise ValueError(f"kernel {name}: tensor cores accumulate in f32, not {accum_dtype(mm.dtype).value}")
    k = mm.inputs[0].shape[-1]
    tile, chosen = tuned_tile("mma", capacity(m), capacity(n), capacity(k), capacity(math.prod(batch)), dt,
                              target)  # for the largest sizes

    def emit(e: ValueEmitter, tile: TcTile, *rest: object, **kw: object) -> tuple[list[Buffer], tuple[Buffer, ...]]:
        return emit_mma_gemm(e, tile, dt, *rest, **kw)  # type: ignore[arg-type]

    return tensor_core_matmul_kernel(group, stored, target, name, tile, emit, "tensor-core", "m16n8k16." + dt.value,
                                     chosen)
