"""Hopper convolution: f16/bf16 convolutions on sm_90a as an implicit GEMM on warpgroup MMAs.

The product is ``gpu_conv``'s, ``C[m, co] = Σ_k X[m, k] · W[co, k]`` per channel group, turned the
other way round: GEMM **rows are output positions** ``m = (n, o_1, .., o_d)`` and **columns are
output channels**, because of where wgmma takes its operands from:

* **B, the weights, by TMA.** A group's weights are the stored ``Cout × K`` matrix (``K = Cin_g ·
  KH · KW``, row-major), so ``Wᵀ`` is a K-major B exactly like a Linear layer's: the producer copies
  ``BN × 64`` boxes into the 128-byte-swizzled ring of ``gpu_wgmma`` and the consumers read them
  through descriptors. Rows past ``Cout`` arrive as zeros; in a grouped conv a tile's columns past
  its group's channels read the next group's weights, products the epilogue's guard discards.
* **A, the im2col matrix, from registers.** wgmma's A may live in registers (``RegMatrix``, the
  layout ``kernel.wgmma.a_coord`` gives — how FlashAttention-3 feeds P), so nothing is staged: each
  consumer thread gathers its own fragment from the input, 8 elements per 16-wide K step, from two
  output positions (decoded once) and 4 K indices a step (each split into channel and window
  offset once, shared by both positions). Padding, ragged K and ragged M are the loads' guards;
  a producer node fused into the input (a transposed conv's zero-interleaving, an activation) is
  inlined index arithmetic as in ``gpu_conv``. TMA's *tile* mode cannot gather an im2col tile of an
  NCHW input and its *im2col* mode wants channels-last (NHWC) activations; writing a swizzled A
  tile with ordinary stores would need a generic-to-async proxy fence per stage.
* **Overlap.** The next K tile's fragment is loaded into a second set of registers while this
  tile's wgmmas run (``gpu_wgmma.RegisterA``); since a wgmma reads its register operand while in
  flight, each K step waits for all its groups before the fragments swap and releases its own
  stage (the GEMM with A in shared memory keeps one group in flight).
* **Tiles** are the GEMM's — 128 rows (a producer warpgroup and two consumers) or 64 (one
  warpgroup that also issues the copies), 4 stages — with columns ``BN`` the narrowest of 64, 128,
  256 (64, 128 for 64-row tiles) covering the group's channels, or the channels themselves rounded
  up to 8 below 64 (wgmma's N): a 16-channel conv does not multiply 48 columns of zeros. Groups
  are grid z.
* **Epilogue**: bias, BatchNorm, activation, residual, cast, per accumulator at output index
  ``(n, g·Cout_g + co, o…)``. In the D layout eight lanes of a warp hold eight consecutive
  positions of one channel: the NCHW stores come in 16-byte runs (a shared-memory transpose or a
  TMA store would make them whole lines; not built).

Used for f16/bf16 convolutions on ``sm_90a`` with static sizes, ``K > 8``, a weight whose rows TMA
can address (stored with ``K`` · 2 bytes a multiple of 16, or laid out so at compile time) and at
least ``CONV_GEMM_MIN_CHANNELS`` channels a group; anything else keeps the ``mma.sync`` implicit
GEMM (``gpu_conv``), which sm_90a runs too.
"""

from __future__ import annotations

import math

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node
from sextant.graph.symbolic import is_symbolic
from sextant.kernel.ir import (
    Buffer,
    Cast,
    Const,
    Expr,
    If,
    Kernel,
    Load,
    MbarrierArrive,
    RegMatrix,
    SmemMatrix,
    Store,
    Wgmma,
)
from sextant.kernel.sizes import with_grid
from sextant.kernel.wgmma import WARPGROUP, WGMMA_M, launch_registers, wgmma_n_ok
from sextant.schedule.gpu_kernels import (
    CONV_GEMM_MIN_CHANNELS,
    TID_X,
    _and,
    _bool,
    _check_shared,
    _grid,
    _guarded,
    _strided_loop,
)
from sextant.schedule.gpu_wgmma import (
    ATOM,
    BK,
    CONSUMER_REGS,
    PRODUCER_REGS,
    RegisterA,
    WgTile,
    _mainloop,
    _specialized,
    choose_wg_tile,
    is_sm90a,
    store_d_fragment,
    wg_candidates,
    zero_accumulators,
)
from sextant.schedule.indexing import c, delinearize, divisible, iadd, idiv, imod, imul, may_be_nonzero
from sextant.schedule.kernels import setup_kernel, store_epilogue
from sextant.schedule.partition import Group, append_layouts, params_only
from sextant.schedule.target import TargetDesc
from sextant.schedule.tma import SWIZZLE, TmaOperand
from sextant.schedule.tuning import choose

FRAGMENT = 8  # A elements a thread holds per 16-wide K step


def uses_wgmma_conv(group: Group, target: TargetDesc) -> bool:
    """The group's convolution may run on the Hopper kernel below (its weight is checked when the
    kernel is built: stored, TMA-addressable). Not with ``K ≤ 8``: the only 16-wide step's upper
    half is zeros LLVM folds into the zero accumulators' registers, and ptxas serialises the
    wgmma (C7511)."""
    cv = group.anchor
    x, w = cv.inputs
    return (is_sm90a(target) and x.dtype == w.dtype == cv.dtype and x.dtype in (DType.f16, DType.bf16)
            and not any(is_symbolic(s) for s in (cv.shape, x.shape, w.shape)) and may_be_nonzero(cv.type.numel)
            and w.shape[0] // cv.attr("groups") >= CONV_GEMM_MIN_CHANNELS and math.prod(w.shape[1:]) > 8)


def conv_wg_tile(positions: int, channels: int, k: int, groups: int, dtype: DType,
                 target: TargetDesc) -> tuple[WgTile, dict]:
    """The GEMM's tile for ``positions × channels`` (tuned, else ``choose_wg_tile``'s), narrowed
    to the channels (rounded up to wgmma's multiple of 8) when there are fewer than 64; with the
    meta of the choice. The candidates are narrowed first, so the tuner times distinct kernels
    and a stored name is the tile that runs (``128x40/s4/ws``)."""
    narrow = -(-channels // 8) * 8

    def narrowed(t: WgTile) -> WgTile:
        return WgTile(t.bm, narrow, t.stages, t.producer) if narrow < t.bn else t

    candidates = tuple(dict.fromkeys(narrowed(t) for t in wg_candidates(positions, persistent=False)))
    tile, chosen = choose("conv-wgmma", positions, channels, k, groups, dtype, target, candidates,
                          narrowed(choose_wg_tile(positions, channels)))
    assert wgmma_n_ok(tile.bn), tile
    return tile, chosen


def weight_matrix(cv: Node) -> Node | None:
    """The weight as the ``Cout × K`` matrix TMA reads, laid out at compile time — or None when the
    stored weight is that already. Laid out: a weight that is a movement of one (a transposed
    convolution's flipped, transposed kernel), and ``K`` not a multiple of 8 (TMA's 16-byte row
    pitch; a first layer's ``3 · 3 · 3 = 27``), padded with zero columns."""
    w = cv.inputs[1]
    k = math.prod(int(s) for s in w.shape[1:])
    if k % 8 == 0 and w.op == "param":
        return None
    b = GraphBuilder()
    b.loc = w.loc
    mat = b.reshape(w, (int(w.shape[0]), k))
    return b.pad(mat, (0, 0), (0, -k % 8)) if k % 8 else mat


def layout_hopper_conv_weights(graph: Graph, groups: list[Group], target: TargetDesc) -> tuple[Graph, list[Node]]:
    """Lay out the weights of the convolutions this kernel runs that are not a ``Cout × K`` matrix
    TMA can address (``weight_matrix``), at compile time (``Group.packed``; the nodes returned are
    evaluated into constants and appended to the graph). A weight computed per call (training) is
    left alone: its conv keeps mma.sync when ``K`` is not a multiple of 8."""
    layouts = []
    for g in groups:
        w = g.anchor.inputs[1] if g.kind == "conv" else None
        if w is None or not uses_wgmma_conv(g, target) or not params_only(w):
            continue
        p = weight_matrix(g.anchor)
        if p is not None:
            layouts.append((g, w, p))
    return append_layouts(graph, layouts, groups)


def gpu_wgmma_conv_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel | None:
    """The convolution group as an implicit GEMM on wgmma (weights by TMA, im2col from registers),
    or None when its weight is not a stored matrix TMA can address."""
    cv = group.anchor
    x, w = cv.inputs
    dt = cv.dtype
    groups: int = cv.attr("groups")
    cout_g, cin_g, ksp = w.shape[0] // groups, int(w.shape[1]), tuple(int(s) for s in w.shape[2:])
    stride, padding, dilation = (cv.attr(a) for a in ("stride", "padding", "dilation"))
    nb, osp, isp = int(cv.shape[0]), tuple(int(s) for s in cv.shape[2:]), tuple(int(s) for s in x.shape[2:])
    m, k = nb * math.prod(osp), cin_g * math.prod(ksp)
    e, params, _ = setup_kernel(group, stored)
    wt = group.packed.get(id(w), w)
    pitch = int(wt.shape[-1]) if wt is not w else k
    if id(wt) not in e.buffers or (pitch * dt.itemsize) % 16:
        return None
    weights = TmaOperand(e.buffers[id(wt)], int(w.shape[0]), pitch, pitch, (), ())
    tile, chosen = conv_wg_tile(m, cout_g, k, groups, dt, target)
    S, bm_, bn_ = tile.stages, tile.bm, tile.bn
    b_stage = bn_ * BK
    grid, (bn, bm, g) = _grid(e, (-(-cout_g // bn_), -(-m // bm_), groups))
    i0, j0 = e.bind(imul(bm, bm_), "i0"), e.bind(imul(bn, bn_), "j0")
    channel0 = e.bind(imul(g, cout_g), "co0")
    k_tiles = -(-k // BK)
    t = TID_X
    wg = e.bind(idiv(t, WARPGROUP), "wg")
    first = _bool("eq", t, c(0))
    steps = min(BK, -(-k // 16) * 16) // 16  # a single K tile: only its 16-wide steps with K in them

    def issue(kt: Expr) -> list:
        """Thread 0's part: announce the stage's bytes and copy tile ``kt`` of the weights into it."""
        st = imod(kt, S)
        return [MbarrierArrive("bar", st, b_stage * dt.itemsize),
                weights.box("sB", imul(st, b_stage), c(0), iadd(channel0, j0), imul(kt, BK), bn_, "bar", st)]

    def mmas(st: Expr, cw: Expr) -> None:
        b_base = e.bind(imul(st, b_stage), "sb")
        for kk in range(steps):
            b = SmemMatrix("sB", iadd(b_base, c(16 * kk)), SWIZZLE, 0, ATOM)
            e.emit(Wgmma(bn_, "acc", c(0), RegMatrix("xa", c(FRAGMENT * kk)), b))

    def position(row: Expr) -> tuple[Expr, tuple[Expr, ...]]:
        n, *o = delinearize(row, (nb, *osp))
        return n, tuple(o)

    # the thread's two rows of every A fragment (a_coord: g and g + 8 of its warp's 16), decoded once
    lane = imod(t, 32)
    tq = e.bind(imul(imod(lane, 4), 2), "tq")
    rows: list[tuple[Expr, tuple[Expr, ...], Expr | None]] = []

    def decode_rows(cw: Expr) -> None:
        rows.clear()
        r0 = e.bind(iadd(i0, iadd(imul(cw, WGMMA_M), iadd(imul(imod(idiv(t, 32), 4), 16), idiv(lane, 4)))), "pr")
        for half in (0, 8):
            r = e.bind(iadd(r0, c(half)), "pr") if half else r0
            n, o = position(r)
            n, o = e.bind(n, "pn"), tuple(e.bind(v, "po") for v in o)
            rows.append((n, o, None if divisible(m, bm_) else _bool("lt", r, c(m))))

    def fragment(kt: Expr, buf: str) -> None:
        """Tile ``kt``'s A fragment of this thread into ``buf``: im2col elements, 0 in the padding
        and past the edges."""
        kb = e.bind(iadd(imul(kt, BK), tq), "kb")
        for kk in range(steps):
            for kpair in (0, 8):
                for odd in (0, 1):
                    kidx = e.bind(iadd(kb, c(16 * kk + kpair + odd)), "ka")
                    ci, *kw = (e.bind(v, "kd") for v in delinearize(kidx, (cin_g, *ksp)))
                    for h, (n, o, row_ok) in enumerate(rows):
                        slot = FRAGMENT * kk + (4 if kpair else 0) + 2 * h + odd
                        guard: list[Expr] = [] if divisible(k, BK) else [_bool("lt", kidx, c(k))]
                        if row_ok is not None:
                            guard.append(row_ok)
                        pos = []
                        for d in range(len(osp)):
                            p = iadd(iadd(imul(o[d], stride[d]), imul(kw[d], dilation[d])), c(-padding[d]))
                            p = e.bind(p, "ip")
                            if padding[d]:
                                guard += [_bool("ge", p, c(0)), _bool("lt", p, c(isp[d]))]
                            pos.append(p)
                        idx = (n, iadd(imul(g, cin_g), ci), *pos)

                        def load(slot: int = slot, idx: tuple = idx) -> None:
                            v = e.value(x, idx)
                            e.emit(Store(buf, c(slot), v if v.dtype == dt else Cast(v, dt)))

                        _guarded(e, _and(guard), load, lambda slot=slot: e.emit(Store(buf, c(slot), Const(0.0, dt))))

    def prefetch(kt: Expr) -> None:
        with e.scope() as body:
            fragment(kt, "xn")
        e.emit(If(_bool("lt", kt, c(k_tiles)), tuple(body)))

    def swap() -> None:
        _strided_loop(e, c(0), steps * FRAGMENT, 1, lambda u: e.emit(Store("xa", u, Load("xn", u, dt))), "u",
                      unroll=True)

    def start(cw: Expr) -> None:
        zero_accumulators(e, bn_)
        decode_rows(cw)
        fragment(c(0), "xa")

    def epilogue(row: Expr, col: Expr, acc: Expr) -> None:
        e.regs[id(cv)] = e.bind(Cast(acc, dt), "c")
        n, o = position(row)
        store_epilogue(e, group, (n, iadd(channel0, col), *o))
        e.regs.pop(id(cv))

    def stores(cw: Expr) -> None:
        """Consumer ``cw``'s accumulators through the fused epilogue at the D layout's (position,
        channel), guarded at the edges."""
        store_d_fragment(e, i0, j0, cw, (m, cout_g), (bm_, bn_), epilogue)

    reg_a = RegisterA(prefetch, swap)
    if tile.producer:
        _specialized(e, tile, k_tiles, first, wg, issue, mmas, start, stores, reg_a)
    else:
        start(wg)
        _mainloop(e, tile, k_tiles, first, wg, issue, mmas, reg_a)
        stores(wg)
    bars = 2 * S if tile.producer else S
    shared = [Buffer("sB", dt, S * b_stage, "shared"), Buffer("bar", DType.i64, bars, "shared")]
    _check_shared(name, shared, target)
    meta = {"mapping": "wgmma-tma-implicit-gemm", **tile.meta(), "mma": f"m64n{bn_}k16.{dt.value}", **chosen,
            "gemm": (m, cout_g, k), "groups": groups, "a": "im2col in registers"}
    if tile.producer:
        meta["registers"] = {"producer": PRODUCER_REGS, "consumers": CONSUMER_REGS}
        meta["max_registers"] = min(launch_registers(tile.threads), CONSUMER_REGS)
    local = (Buffer("acc", DType.f32, bn_ // 2, "local"), Buffer("xa", dt, steps * FRAGMENT, "local"),
             Buffer("xn", dt, steps * FRAGMENT, "local"))
    kernel = Kernel(name, tuple(params), (1, 1, 1), (tile.threads, 1, 1), tuple(e.stmts), shared=tuple(shared),
                    local=local, meta=meta)
    return with_grid(kernel, grid)
