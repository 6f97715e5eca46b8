"""Hopper flash attention: ``softmax(f(Q·Kᵀ))·V`` with warpgroup MMAs fed by TMA (sm_90a).

The FlashAttention-3 recipe — warp specialisation and the softmax overlapped with the next
tile's scores; not yet its ping-pong between the two consumers:

* **One block per ``BR = 64·W`` query rows** of one batch/head: a *producer* warpgroup that
  only issues copies (``setmaxnreg`` down to 24 registers) and ``W`` *consumer* warpgroups (2,
  or 1 for short sequences; up to 240 registers); consumer ``w`` owns rows ``64w …`` and keeps
  everything of them in registers: two buffers of ``BC/2`` score accumulators, the ``Dv/2`` output
  accumulators, the running row max and sum (a thread holds two rows, as in the D layout).
* **Q once, K and V streamed by TMA.** Q's tile is copied once (its own mbarrier); K and V tiles
  of ``BC = 64`` keys go through a ring of ``S = 3`` stages, each with a *full* mbarrier (the
  producer's arrival announcing both copies' bytes) and an *empty* one (one arrival per
  consumer thread when it is done with the stage). All three are written with the 128-byte
  swizzle, in boxes of 64 columns (one swizzled row each), and read by wgmma through matching
  descriptors: Q as A and K as B are K-major (the head dim contiguous, ``Wᵀ``-like); V is B of
  ``P·V`` with its keys as K and its head dim as N — stored ``keys × Dv``, so MN-major (the
  transpose bit, ``LBO`` one box). The batch and head dims are the tensor maps' outer
  dimensions, so a tile never reads a neighbouring head: rows past the sequence arrive as zeros.
* **``S = Q·Kᵀ``**: ``D/16`` wgmmas of ``64 × BC``; tile ``t + 1``'s are issued before tile
  ``t``'s softmax and awaited after its ``P·V`` (``wgmma_wait(1)`` waits for tile ``t``'s only).
* **The online softmax in registers** — the fused logit ops (scale, masks) per accumulator at
  its ``(row, key)``, the row max over the quad that holds a row (a width-4 butterfly), the
  rescaling of the running sum and of ``O`` by ``exp(m_old − m_new)`` — exactly as the
  ``mma.sync`` kernel (``gpu_flash_attention``) does.
* **``O += P·V`` with P from registers**: the D fragment of two adjacent 8-key column blocks of
  S holds the same ``(row, key)`` pairs as the register A fragment of one 16-key step
  (``kernel.wgmma.a_coord``), so P is cast to f16/bf16 in place and fed as a ``RegMatrix`` —
  it never touches shared memory.
* **The ring**: after both products of tile ``t`` have completed (``wgmma.wait_group 0``), each
  consumer thread arrives on the stage's empty barrier; the producer, in its iteration ``t``,
  waits for tile ``t - 1``'s release and copies tile ``t + 2`` into that stage — two tiles in
  flight while one is computed, and no block barrier after the start. Causal: tiles past the
  block's last query are never loaded or computed.
* **Epilogue**: ``O / l``, cast, the group's fused epilogue, stored at the D layout's positions.

Used on ``sm_90a`` for static f16/bf16 attention whose Q, K and V are strided views TMA can
describe (the head dim contiguous and 16, 32, 64 or 128 wide — rows of one 32/64/128-byte swizzle
span, or two —, 16-byte-aligned strides, an offset that
is a whole number of outer steps — the Q/K/V slices of one fused projection are); anything
else keeps the ``mma.sync`` flash kernel, which sm_90a runs as well.
"""

from __future__ import annotations

import math

from sextant.graph.dtypes import DType
from sextant.graph.symbolic import is_symbolic
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
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    RegMatrix,
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
from sextant.schedule.attention_match import Attention
from sextant.schedule.gpu_flash_attention import half_dtype
from sextant.schedule.gpu_kernels import TID_X, _and, _bool, _check_shared, _grid, _strided_loop
from sextant.schedule.gpu_wgmma import is_sm90a
from sextant.schedule.indexing import ValueEmitter, c, divisible, iadd, idiv, imin, imod, imul
from sextant.schedule.kernels import setup_kernel
from sextant.schedule.online_softmax import normalized_stores, online_softmax
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc
from sextant.schedule.tma import SWIZZLE, TmaOperand, tma_operand

BC = 64  # keys per K/V tile
STAGES = 3
LEAD = STAGES - 1  # tiles the producer copies ahead: tile kt + LEAD once the consumers released tile kt - 1
PRODUCER_REGS, CONSUMER_REGS = 24, 240  # FlashAttention-3's split: 128·24 + 256·240 ≤ 65,536
HEADS = (16, 32, 64, 128)  # head sizes: whole swizzled rows of f16/bf16, accumulators in registers


def swizzle_for(width: int) -> int:
    """The swizzle (bytes) of a tile whose rows are ``width`` 16-bit elements: one 128-byte row
    per 64 columns, or a single 32- or 64-byte row for the narrow heads."""
    return min(SWIZZLE, 2 * width)


def wgmma_attention_refusal(att: Attention, target: TargetDesc) -> str | None:
    """Why the Hopper kernel cannot compute ``att`` (before its operands are seen), or None."""
    if not is_sm90a(target):
        return f"wgmma needs sm_90a, not {target.name}"
    dt = half_dtype(att.q)
    if dt is None or {half_dtype(att.kt), half_dtype(att.v)} != {dt}:
        return "Q, K and V are not all f16 or all bf16"
    if any(is_symbolic(x.shape) for x in (att.q, att.kt, att.v, att.out)):
        return "symbolic sizes (tensor maps are encoded for static shapes)"
    d, dv = att.q.shape[-1], att.v.shape[-1]
    if d not in HEADS or dv not in HEADS:
        return f"head sizes {d}/{dv} (16, 32, 64 or 128: whole swizzled rows)"
    return None


def operands(group: Group, buffers: dict[int, str]) -> tuple[TmaOperand, TmaOperand, TmaOperand] | None:
    att = group.attention
    assert att is not None
    dt = half_dtype(att.q)
    assert dt is not None
    ops = (tma_operand(att.q, buffers, dt, -2, -1), tma_operand(att.kt, buffers, dt, -1, -2),
           tma_operand(att.v, buffers, dt, -2, -1))
    return ops if all(o is not None for o in ops) else None  # type: ignore[return-value]


def gpu_wgmma_attention_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel | None:
    """The attention group on wgmma + TMA, or None when its operands are not TMA-describable."""
    att = group.attention
    assert att is not None and wgmma_attention_refusal(att, target) is None
    dt = half_dtype(att.q)
    assert dt is not None
    acc_t, size = DType.f32, dt.itemsize
    q, kt, v = att.q, att.kt, att.v
    *batch, n_q, d = (int(x) for x in q.shape)
    n_kv, dv = int(kt.shape[-1]), int(v.shape[-1])
    e, params, _ = setup_kernel(group, stored)
    ops = operands(group, e.buffers)
    if ops is None:
        return None
    src_q, src_k, src_v = ops
    wgs = 2 if n_q > WGMMA_M else 1
    br = WGMMA_M * wgs
    grid, (bq, bz, _) = _grid(e, (-(-n_q // br), math.prod(batch), 1))
    t = TID_X
    wg = e.bind(idiv(t, WARPGROUP), "wg")
    lane = e.bind(imod(t, 32), "lane")
    first = _bool("eq", t, c(0))
    q0 = e.bind(imul(bq, br), "q0")
    k_stage, v_stage = BC * d, BC * dv  # elements per stage
    # causal: keys from the block's last query on are hidden from every row of the block
    kend = e.bind(imin(iadd(q0, c(br)), c(n_kv)), "kend") if att.causal else c(n_kv)
    tiles = e.bind(idiv(iadd(kend, c(BC - 1)), BC), "tiles") if att.causal else c(-(-n_kv // BC))
    static_tiles = -(-n_kv // BC)

    def issue(kt_: Expr) -> list:
        """Thread 0: announce tile ``kt_``'s bytes on its stage's barrier and copy its K and V."""
        st = imod(kt_, STAGES)
        row = imul(kt_, BC)
        return [MbarrierArrive("bar", st, BC * (d + dv) * size),
                *src_k.load("sK", imul(st, k_stage), bz, row, BC, "bar", st, swizzle_for(d)),
                *src_v.load("sV", imul(st, v_stage), bz, row, BC, "bar", st, swizzle_for(dv))]

    qbar = c(2 * STAGES)  # full[s] = bar[s], empty[s] = bar[S + s], Q's = bar[2S]
    consumer_threads = wgs * WARPGROUP
    e.emit(If(first, (*(MbarrierInit("bar", c(s), 1) for s in range(STAGES)),
                      *(MbarrierInit("bar", c(STAGES + s), consumer_threads) for s in range(STAGES)),
                      MbarrierInit("bar", qbar, 1))))
    e.emit(Barrier())
    kt_ = e.var("kt")
    # both roles loop over all tiles but the last: the consumers' iteration kt overlaps tile kt's
    # softmax with tile kt+1's Q·Kᵀ, and the last tile follows the loop (the producer has copied
    # everything by then)
    loop_stop = Binary("sub", tiles, c(1), DType.i32) if att.causal else c(static_tiles - 1)

    # -- the producer: Q and the first LEAD tiles, then tile kt + LEAD once tile kt - 1 is released
    with e.scope() as produce:
        e.emit(SetMaxNReg(PRODUCER_REGS, False))
        prologue: list = [MbarrierArrive("bar", qbar, br * d * size),
                          *src_q.load("sQ", c(0), bz, q0, br, "bar", qbar, swizzle_for(d))]
        for p in range(min(LEAD, static_tiles)):
            prologue += [If(_bool("lt", c(p), tiles), tuple(issue(c(p))))] if att.causal else issue(c(p))
        e.emit(If(first, tuple(prologue)))
        with e.scope() as body:
            nxt = iadd(kt_, c(LEAD))
            more = _and([first, _bool("lt", nxt, tiles)])
            released = _and([first, _bool("lt", nxt, tiles), _bool("ge", kt_, c(1))])
            assert more is not None and released is not None
            parity = imod(idiv(Binary("sub", kt_, c(1), DType.i32), STAGES), 2)  # tile kt-1's release
            e.emit(If(released, (MbarrierWait("bar", iadd(imod(nxt, STAGES), c(STAGES)), parity),)))
            e.emit(If(more, tuple(issue(nxt))))
        e.emit(For(kt_, c(0), loop_stop, 1, tuple(body)))

    # -- the consumers: 64 query rows each, both products and the softmax of every key tile
    with e.scope() as consume:
        e.emit(SetMaxNReg(CONSUMER_REGS, True))
        cw = e.bind(Binary("sub", wg, c(1), DType.i32), "cw")
        _consumer(e, att, dt, cw, lane, bz, q0, br, n_q, n_kv, d, dv, kt_, loop_stop, group)
    e.emit(If(_bool("eq", wg, c(0)), tuple(produce), tuple(consume)))
    shared = [Buffer("sQ", dt, br * d, "shared"), Buffer("sK", dt, STAGES * k_stage, "shared"),
              Buffer("sV", dt, STAGES * v_stage, "shared"), Buffer("bar", DType.i64, 2 * STAGES + 1, "shared")]
    _check_shared(name, shared, target)
    n_s, n_o = BC // 2, dv // 2
    local = (Buffer("sacc", acc_t, n_s, "local"), Buffer("snext", acc_t, n_s, "local"), Buffer("fp", dt, n_s, "local"),
             Buffer("oacc", acc_t, n_o, "local"))
    meta = {"mapping": "flash-attention-wgmma-tma", "tile": (br, BC), "warpgroups": wgs, "stages": STAGES,
            "mma": f"m64n{BC}k16/m64n{dv}k16.{dt.value}", "head": (d, dv), "warp_specialized": True,
            "registers": {"producer": PRODUCER_REGS, "consumers": CONSUMER_REGS},
            "max_registers": min(launch_registers((wgs + 1) * WARPGROUP), CONSUMER_REGS)}  # inc never lowers
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), ((wgs + 1) * WARPGROUP, 1, 1), tuple(e.stmts),
                            shared=tuple(shared), local=local, meta=meta), grid)



def _consumer(e: ValueEmitter, att: Attention, dt: DType, cw: Expr, lane: Expr, bz: Expr, q0: Expr, br: int,
              n_q: int, n_kv: int, d: int, dv: int, kt_: Var, stop: Expr, group: Group) -> None:
    """Consumer warpgroup ``cw``: rows ``q0 + 64·cw …``. ``S`` of tile 0 first; then per tile ``kt``
    (but the last): issue tile ``kt+1``'s ``Q·Kᵀ`` into ``snext``, wait for tile ``kt``'s only
    (``wgmma_wait(1)``), its online softmax while the tensor cores compute the next scores
    (FlashAttention-3's intra-warpgroup overlap), ``O += P·V`` with P from registers, wait for
    everything, release the stage, ``snext`` becomes ``sacc``. The last tile without a next one;
    then ``O / l`` through the fused epilogue."""
    acc_t = DType.f32
    n_s, n_o = BC // 2, dv // 2  # accumulators per thread
    k_stage, v_stage = BC * d, BC * dv
    zero, neg_inf = Const(0.0, acc_t), Const(-math.inf, acc_t)
    _strided_loop(e, c(0), n_o, 1, lambda u: e.emit(Store("oacc", u, zero)), "u", unroll=True)
    m = [e.var("m", acc_t) for _ in range(2)]  # running max and (lane-partial) sum of rows g, g + 8
    s = [e.var("l", acc_t) for _ in range(2)]
    for h in range(2):
        e.emit(Assign(m[h], neg_inf))
        e.emit(Assign(s[h], zero))
    g, tq = e.bind(idiv(lane, 4), "g"), e.bind(imul(imod(lane, 4), 2), "tq")
    wrow = e.bind(iadd(q0, iadd(imul(cw, WGMMA_M), imul(imod(idiv(TID_X, 32), 4), 16))), "wrow")
    rows = [e.bind(iadd(wrow, iadd(g, c(8 * h))), "row") for h in range(2)]
    rows_c = [r if divisible(n_q, br) else e.bind(imin(r, c(n_q - 1)), "rc") for r in rows]
    ragged = None if divisible(n_kv, BC) else n_kv

    def scores(kt: Expr, acc: str) -> None:
        """Wait for tile ``kt``'s copies and issue its ``Q·Kᵀ`` into ``acc`` (one commit group)."""
        st = e.bind(imod(kt, STAGES), "sk")
        e.emit(MbarrierWait("bar", st, imod(idiv(kt, STAGES), 2)))
        _strided_loop(e, c(0), n_s, 1, lambda u: e.emit(Store(acc, u, zero)), "u", unroll=True)
        e.emit(WgmmaFence())
        kbase = e.bind(imul(st, k_stage), "kb")
        sw = swizzle_for(d)
        width = sw // 2  # columns per box
        for kk in range(d // 16):  # box kk // (width/16) of Q and K, 16 columns per step within it
            box, step = divmod(kk, width // 16)
            a = SmemMatrix("sQ", iadd(c(box * br * width + 16 * step), imul(cw, WGMMA_M * width)), sw, 0, 8 * sw)
            b = SmemMatrix("sK", iadd(kbase, c(box * BC * width + 16 * step)), sw, 0, 8 * sw)
            e.emit(Wgmma(BC, acc, c(0), a, b))
        e.emit(WgmmaCommit())

    def softmax_pv(kt: Expr) -> None:
        """Tile ``kt``'s scores (in ``sacc``, complete) through the online softmax into P, then
        ``O += P·V`` issued and committed."""
        j0 = e.bind(imul(kt, BC), "j0")
        online_softmax(e, att, bz, rows_c, tq, j0, ragged, "sacc", n_s, "oacc", n_o, m, s, "fp", dt)
        e.emit(WgmmaFence())  # the accumulators and P were written by ordinary instructions
        vbase = e.bind(imul(imod(kt, STAGES), v_stage), "vb")
        for kk in range(BC // 16):  # O += P·V: 16 keys (rows of V) per step, 128 bytes each
            sv = swizzle_for(dv)  # 16 keys (rows of sv bytes) per step; the next box of columns BC rows on
            b = SmemMatrix("sV", iadd(vbase, c(16 * kk * (sv // 2))), sv, BC * sv, 8 * sv, "mn")
            e.emit(Wgmma(dv, "oacc", c(0), RegMatrix("fp", c(8 * kk)), b))
        e.emit(WgmmaCommit())

    def release(kt: Expr) -> None:
        e.emit(MbarrierArrive("bar", iadd(imod(kt, STAGES), c(STAGES))))  # this warpgroup is done with the stage

    e.emit(MbarrierWait("bar", c(2 * STAGES), c(0)))  # Q has landed
    scores(c(0), "sacc")
    with e.scope() as body:
        scores(iadd(kt_, c(1)), "snext")
        e.emit(WgmmaWait(1, ("sacc",)))  # tile kt's scores are done; the next tile's are in flight
        softmax_pv(kt_)
        e.emit(WgmmaWait(0, ("snext", "oacc")))
        release(kt_)
        _strided_loop(e, c(0), n_s, 1, lambda u: e.emit(Store("sacc", u, Load("snext", u, acc_t))), "u",
                      unroll=True)
    e.emit(For(kt_, c(0), stop, 1, tuple(body)))
    e.emit(WgmmaWait(0, ("sacc",)))
    softmax_pv(stop)  # the last tile
    e.emit(WgmmaWait(0, ("oacc",)))
    normalized_stores(e, att, group, bz, rows, tq, "oacc", n_o, s, m, None if divisible(n_q, br) else n_q)
