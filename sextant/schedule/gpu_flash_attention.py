"""Flash attention on tensor cores: one kernel for ``softmax(f(Q·Kᵀ))·V`` with f16/bf16 operands.

The mapping (one thread block of 4 warps per ``BR = 64`` query rows of one batch/head):

* **Q stays resident.** The block's Q tile is staged through shared memory once and every
  warp keeps its 16 rows as ``ldmatrix`` A fragments (``D/16`` k-steps) for the whole kernel.
* **K and V stream** through shared memory in tiles of ``BC`` keys (64; 32 for heads up to 32). K is staged key-major
  (``BC × D``, rows contiguous along the head dim): exactly ``mma``'s "col" B operand for
  ``S = Q·Kᵀ``, read by plain ``ldmatrix``; V is staged ``BC × Dv`` and read by
  ``ldmatrix.trans``, as the GEMM reads a row-major B. Rows are padded by 8 elements (an odd
  number of 16-byte groups per row): every ldmatrix is conflict-free. Both are **double
  buffered**: tile ``t + 1`` is copied (``cp.async``) into one half while tile ``t`` is multiplied
  from the other — one copy group per tile (empty past the last) so the wait count is static;
  Q is staged through the second K buffer before the loop, with the first tile in flight.
* **The softmax is online, in registers.** A warp's ``16 × BC`` scores are its ``mma``
  accumulators (C layout: lane ``l`` holds rows ``l/4`` and ``l/4 + 8``); the fused logit ops
  (scale, causal/boolean/additive masks, casts) run on each accumulator element at its
  ``(row, key)``; the row max is the lane's own max combined over its quad (a width-4
  butterfly); the running max, sum and the output accumulators are rescaled by
  ``exp(m_old - m_new)`` per tile.
* **P never leaves the registers.** The C fragment of two adjacent 16×8 score tiles holds the
  same ``(row, key)`` pairs as the A fragment of one 16×16 tile (``kernel.fragments``), so the
  probabilities are cast to f16/bf16 in place and fed to ``O += P·V`` directly.
* **Epilogue**: ``O / l`` (0 for a fully masked row when the graph asks for it), cast, and the
  group's fused epilogue, stored at the C layout's positions.

Accumulation is f32 for both products, as FlashAttention's; ``P`` is rounded to the operand
dtype before the second product (FlashAttention does the same), which stays within f16
tolerance of eager's f32 softmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.symbolic import SymDim
from sextant.kernel.fragments import MMA_SHAPES
from sextant.kernel.ir import (
    Assign,
    Barrier,
    Buffer,
    Cast,
    Const,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Mma,
    Store,
)
from sextant.kernel.sizes import with_grid
from sextant.schedule.attention_match import Attention, at
from sextant.schedule.gpu_kernels import TID_X, _and, _bool, _check_shared, _grid, _guarded, _strided_loop
from sextant.schedule.gpu_mma import PAD, TC_DTYPES, sm_version
from sextant.schedule.indexing import c, divisible, iadd, idiv, imin, imod, imul
from sextant.schedule.kernels import setup_kernel
from sextant.schedule.online_softmax import normalized_stores, online_softmax
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc
from sextant.schedule.views import chunked

Chunk = Callable[[Expr, Expr], tuple[str, Expr]]  # (row, col) -> (buffer, flat index) of a 16-byte chunk
MMA = MMA_SHAPES[((16, 8, 16), "f16")]  # the layout is the same for bf16
BR = 64  # query rows per block (16 per warp)
ZERO = c(0)  # a default offset


def kv_tile_keys(head: int) -> int:
    """Keys per streamed K/V tile: 64, or 32 for heads of up to 32 — with 64, ptxas (CUDA 13,
    sm_90) holds such a kernel to 96 registers and spills its copy addresses; with 32 it needs 72."""
    return 32 if head <= 32 else 64
WARPS = BR // 16
MAX_HEAD = 128  # head sizes up to this keep Q fragments and O accumulators in registers


def half_dtype(x: Node) -> DType | None:
    """The 16-bit float type whose values ``x`` holds exactly: its own dtype, or that of the
    tensor an upcast read through re-indexing ops (SDPA's lowering computes in f32 from f16
    inputs; casting those values back is exact)."""
    while True:
        if x.dtype in TC_DTYPES:
            return x.dtype
        if x.op == "cast" and x.inputs[0].dtype in TC_DTYPES:
            return x.inputs[0].dtype
        if x.op not in ("reshape", "permute", "expand", "slice"):
            return None
        x = x.inputs[0]


def flash_refusal(att: Attention, target: TargetDesc) -> str | None:
    """Why the tensor-core kernel cannot compute ``att``, or None when it can. The GPU fuses only
    what this kernel computes: for the rest, the tiled matmuls and the warp softmax (the score
    matrix stored) beat any CUDA-core fused kernel sextant has."""
    if sm_version(target) < 80:
        return f"mma.sync needs sm_80 or newer, not {target.name}"
    types = {half_dtype(x) for x in (att.q, att.kt, att.v)}
    if None in types:
        return "Q, K or V is not f16/bf16 (tensor cores; f32 stays exact)"
    if len(types) != 1:
        return "Q, K and V mix f16 and bf16"
    d, dv = att.q.shape[-1], att.v.shape[-1]
    if d % 16 or dv % 16 or d > MAX_HEAD or dv > MAX_HEAD:
        return f"head sizes {d}/{dv} are not multiples of 16 up to {MAX_HEAD}"
    return None


def gpu_flash_attention_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    att = group.attention
    assert att is not None and flash_refusal(att, target) is None
    dt = half_dtype(att.q)
    assert dt is not None
    acc_t = DType.f32
    q, kt, v = att.q, att.kt, att.v
    *batch, n_q, d = q.shape
    n_kv, dv = kt.shape[-1], v.shape[-1]
    bc = kv_tile_keys(d)
    e, params, _ = setup_kernel(group, stored)
    grid, (bq, bz, _) = _grid(e, (-(-n_q // BR), math.prod(batch), 1))
    k_stride, v_stride = d + PAD, dv + PAD
    k_size, v_size = max(BR, bc) * k_stride, bc * v_stride  # one of the two buffers of each
    shared = [Buffer("Ks", dt, 2 * k_size, "shared"), Buffer("Vs", dt, 2 * v_size, "shared")]
    n_s, n_o = bc // 8, dv // 8  # 16x8 accumulator tiles of S and of O per warp
    local = (Buffer("fq", dt, d // 16 * MMA.a_elems, "local"), Buffer("fb", dt, 2 * MMA.b_elems, "local"),
             Buffer("sacc", acc_t, n_s * MMA.c_elems, "local"), Buffer("fp", dt, n_s * MMA.c_elems, "local"),
             Buffer("oacc", acc_t, n_o * MMA.c_elems, "local"))
    t = TID_X
    lane = e.bind(imod(t, 32), "lane")
    wrow = e.bind(imul(idiv(t, 32), 16), "wrow")  # the warp's first row in the block tile
    q0 = e.bind(imul(bq, BR), "q0")
    g, tq = e.bind(idiv(lane, 4), "g"), e.bind(imul(imod(lane, 4), 2), "tq")  # C layout: row g (+8), col 2t (+1)
    neg_inf, zero = Const(-math.inf, acc_t), Const(0.0, acc_t)

    def half(x: Node, idx: tuple) -> Expr:
        value = e.value(x, idx)
        return value if value.dtype == dt else Cast(value, dt)

    def chunks(x: Node, row_axis: int, col_axis: int) -> Chunk | None:
        """Q/K/V tiles by ``cp.async`` when the operand is a strided view of a buffer (``views``)."""
        return chunked(x, e.buffers, at(x, bz, c(0), c(0))[:-2], row_axis, col_axis, exact_from=dt)

    def stage(buf: str, rows: int, cols: int, stride: int, row0: Expr, row_lim: int,
              element: Callable[[Expr, Expr], Expr], chunk: Chunk | None = None, base: Expr = ZERO) -> None:
        """``buf[r·stride + col] = element(row0 + r, col)``, zero for rows past ``row_lim``: by
        ``cp.async`` in 16-byte chunks when ``chunk`` gives their source (8 consecutive lanes write
        8 consecutive chunks of a row, or one chunk column of 8 rows when rows are shorter — the
        odd 16-byte row stride spreads those over the banks), else element by element
        (consecutive threads on consecutive columns: coalesced along the head dim)."""
        threads = 32 * WARPS
        guard_rows = not divisible(row_lim, rows)
        if chunk is not None:
            per = 16 // dt.itemsize
            cpr = cols // per
            count = rows * cpr
            for p in range(-(-count // threads)):  # a small tile has fewer chunks than threads
                el = iadd(t, c(p * threads))
                if cpr >= 8:
                    r, col = e.bind(idiv(el, cpr), "r"), e.bind(imul(imod(el, cpr), per), "cc")
                else:
                    r = e.bind(iadd(imod(el, 8), imul(idiv(el, 8 * cpr), 8)), "r")
                    col = e.bind(imul(imod(idiv(el, 8), cpr), per), "cc")
                gr = e.bind(iadd(row0, r), "gr")
                guard = _bool("lt", gr, c(row_lim)) if guard_rows else None
                src, index = chunk(e.bind(imin(gr, c(row_lim - 1)), "gc") if guard_rows else gr, col)
                copy = CpAsync(buf, iadd(base, iadd(imul(r, stride), col)), src, index, per, guard)
                e.emit(If(_bool("lt", el, c(count)), (copy,)) if count % threads else copy)
            return
        for p in range(rows * cols // threads):
            el = iadd(t, c(p * threads))
            r, col = e.bind(idiv(el, cols), "r"), e.bind(imod(el, cols), "cc")
            gr = e.bind(iadd(row0, r), "gr")
            slot = iadd(base, iadd(imul(r, stride), col))
            guard = _bool("lt", gr, c(row_lim)) if guard_rows else None
            _guarded(e, guard, lambda slot=slot, gr=gr, col=col: e.emit(Store(buf, slot, element(gr, col))),
                     lambda slot=slot: e.emit(Store(buf, slot, Const(0.0, dt))))

    q_chunk, k_chunk, v_chunk = chunks(q, -2, -1), chunks(kt, -1, -2), chunks(v, -2, -1)

    def load_tile(j0: Expr, ragged: bool, buf: Expr) -> None:
        """Start copying the K and V tile of keys from ``j0`` into buffer ``buf`` (0 or 1) of Ks/Vs."""
        lim = n_kv if ragged else bc
        stage("Ks", bc, d, k_stride, j0, lim, lambda j, col: half(kt, at(kt, bz, col, j)), k_chunk,
              imul(buf, k_size))
        stage("Vs", bc, dv, v_stride, j0, lim, lambda j, col: half(v, at(v, bz, j, col)), v_chunk,
              imul(buf, v_size))

    full = n_kv // bc  # whole key tiles (a SymDim over a symbolic length: the tail is then decided at run time)
    symbolic = isinstance(full, SymDim)
    # causal: the block's queries end at q0 + BR, so tiles from there on are masked entirely
    # (BR is a multiple of bc, so the bound is a whole tile)
    reach = iadd(q0, c(BR)) if att.causal else None
    # Q: staged through Ks's second buffer (free until the second K tile), then held as A fragments;
    # the first K/V tile is in flight meanwhile
    stage("Ks", BR, d, k_stride, q0, n_q, lambda r, col: half(q, at(q, bz, r, col)), q_chunk, c(k_size))
    e.emit(CpAsyncCommit())
    load_tile(c(0), symbolic or full == 0, c(0))  # (over a symbolic length the first tile may be the tail)
    e.emit(CpAsyncCommit())
    e.emit(CpAsyncWait(1))
    e.emit(Barrier())
    a_row, a_col = iadd(wrow, imod(lane, 16)), imul(idiv(lane, 16), 8)
    for ks in range(d // 16):
        e.emit(LdMatrix("fq", c(ks * MMA.a_elems), "Ks",
                        iadd(c(k_size), iadd(imul(a_row, k_stride), iadd(a_col, c(ks * 16)))), 4))
    _strided_loop(e, c(0), n_o * MMA.c_elems, 1, lambda u: e.emit(Store("oacc", u, zero)), "u", unroll=True)
    m = [e.var("m", acc_t) for _ in range(2)]  # running max and (lane-partial) sum of rows g, g + 8
    s = [e.var("l", acc_t) for _ in range(2)]
    for h in range(2):
        e.emit(Assign(m[h], neg_inf))
        e.emit(Assign(s[h], zero))
    # rows of this lane, clamped for the logit ops' loads (rows past n_q are computed, never stored)
    rows = [e.bind(iadd(q0, iadd(wrow, iadd(g, c(8 * h)))), "row") for h in range(2)]
    rows_c = [r if divisible(n_q, BR) else e.bind(imin(r, c(n_q - 1)), "rc") for r in rows]
    # ldmatrix addresses: K (key-major, as the GEMM's N×K B) and V (.trans, as its K×N B)
    kb_row, kb_col = iadd(imul(idiv(lane, 16), 8), imod(lane, 8)), imul(imod(idiv(lane, 8), 2), 8)
    vb_row, vb_col = iadd(imul(imod(idiv(lane, 8), 2), 8), imod(lane, 8)), imul(idiv(lane, 16), 8)

    def kv_tile(j0: Expr, ragged: bool, buf: Expr) -> None:
        """One tile of keys from ``j0``, landed in buffer ``buf``; ``ragged``: the last, partial
        tile (its key checks are kept out of the main loop, where they would cost registers)."""
        kbase, vbase = e.bind(imul(buf, k_size), "kbase"), e.bind(imul(buf, v_size), "vbase")
        _strided_loop(e, c(0), n_s * MMA.c_elems, 1, lambda u: e.emit(Store("sacc", u, zero)), "u", unroll=True)
        for ks in range(d // 16):  # S = Q·Kᵀ
            for p in range(n_s // 2):
                addr = iadd(kbase, iadd(imul(iadd(kb_row, c(p * 16)), k_stride), iadd(kb_col, c(ks * 16))))
                e.emit(LdMatrix("fb", c(0), "Ks", addr, 4))
                for y in (2 * p, 2 * p + 1):
                    off = c(y * MMA.c_elems)
                    e.emit(Mma((16, 8, 16), "sacc", off, "fq", c(ks * MMA.a_elems), "fb",
                               c((y - 2 * p) * MMA.b_elems), "sacc", off))
        online_softmax(e, att, bz, rows_c, tq, j0, n_kv if ragged else None, "sacc", n_s * MMA.c_elems, "oacc",
                       n_o * MMA.c_elems, m, s, "fp", dt)
        for kk in range(bc // 16):  # O += P·V
            for p in range(n_o // 2):
                addr = iadd(vbase, iadd(imul(iadd(vb_row, c(kk * 16)), v_stride), iadd(vb_col, c(p * 16))))
                e.emit(LdMatrix("fb", c(0), "Vs", addr, 4, trans=True))
                for y in (2 * p, 2 * p + 1):
                    off = c(y * MMA.c_elems)
                    e.emit(Mma((16, 8, 16), "oacc", off, "fp", c(kk * MMA.a_elems), "fb",
                               c((y - 2 * p) * MMA.b_elems), "oacc", off))

    # K/V double-buffered: while full tile t is multiplied from buffer t % 2, full tile t + 1 is
    # copied into the other (one cp.async group per tile, empty past the last: a static wait count);
    # a ragged last tile is copied after the loop
    if symbolic or full:
        stop = e.bind(imin(reach, c(full * bc)), "kend") if reach is not None else c(full * bc)
        j0 = e.var("j0")
        with e.scope() as body:
            buf = e.bind(imod(idiv(j0, bc), 2), "buf")
            other = iadd(c(1), imul(buf, -1))
            e.emit(Barrier())  # every warp is done with tile t - 1, whose buffer the copies overwrite
            more = _bool("lt", j0, c((full - 1) * bc))
            if reach is not None:
                more = _and([more, _bool("lt", iadd(j0, c(bc)), stop)])
            with e.scope() as next_full:  # min(): a no-op under `more` that bounds the rows by a
                # constant, so interval analysis proves the copies in range (no witness search: 5x
                # the schedule time of GPT-2 with it)
                load_tile(imin(iadd(j0, c(bc)), c((full - 1) * bc)), False, other)
            e.emit(If(more, tuple(next_full)))
            e.emit(CpAsyncCommit())
            e.emit(CpAsyncWait(1))  # tile t has landed (t + 1 may still be in flight)
            e.emit(Barrier())
            kv_tile(j0, False, buf)
        e.emit(For(j0, c(0), stop, bc, tuple(body)))
    if not divisible(n_kv, bc):
        with e.scope() as tail:
            last = e.bind(imod(c(full), 2), "lastbuf") if symbolic else c(full % 2)
            if symbolic:  # whether a full tile came first is known per launch (a uniform branch)
                with e.scope() as after_full:
                    load_tile(c(full * bc), True, last)
                    e.emit(CpAsyncCommit())
                e.emit(If(_bool("lt", c(0), c(full)), tuple(after_full)))
            elif full:  # not prefetched (its key guards in the loop cost registers: ptxas spilled at
                # sm_80); buffer full % 2 is free since the last iteration's first barrier
                load_tile(c(full * bc), True, last)
                e.emit(CpAsyncCommit())
            e.emit(CpAsyncWait(0))  # (with no full tile: copied before the loop)
            e.emit(Barrier())
            kv_tile(c(full * bc), True, last)
        cond = [_bool("lt", c(full * bc), reach)] if reach is not None else []
        if symbolic:  # a length that is a whole number of tiles has no tail
            cond.append(_bool("ne", imod(c(n_kv), bc), c(0)))
        if cond:
            e.emit(If(_and(cond), tuple(tail)))
        else:
            e.stmts.extend(tail)
    normalized_stores(e, att, group, bz, rows, tq, "oacc", n_o * MMA.c_elems, s, m,
                      None if divisible(n_q, BR) else n_q)
    _check_shared(name, shared, target)
    # .maxnreg 128 for heads up to 64: left to itself ptxas held some of these kernels (a ragged
    # last tile after a one-tile loop) to 96 registers and spilled; 128 still gives 4 blocks (16
    # warps) per SM. Larger heads need more (O and Q fragments): ptxas chooses.
    meta = {"mapping": "flash-attention-tensor-core", "tile": (BR, bc), "warps": WARPS,
            "mma": "m16n8k16." + dt.value, "head": (d, dv),
            "max_registers": 128 if max(d, dv) <= 64 else None}
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), (32 * WARPS, 1, 1), tuple(e.stmts),
                            shared=tuple(shared), local=local, meta=meta), grid)
