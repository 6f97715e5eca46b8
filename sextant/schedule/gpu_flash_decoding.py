"""Split-key ("flash-decoding") attention on the GPU: decode steps that fill the SMs.

A decode step asks ``softmax(f(Q·Kᵀ))·V`` of one (or a few) query rows per batch·head against up
to ``max_cache_len`` keys. The tensor-core flash kernel (``gpu_flash_attention``) gives each 64
query rows of a batch·head one block: here that is ``B·H`` blocks (12 for a batch-1 GPT-2 step on
132 SMs) whose MMAs compute 63 padding rows for every real one. This mapping splits the *keys*
instead and runs two kernels:

* **partials** — grid ``(splits, batch·heads)``, one block of ``THREADS`` = 64 threads per key
  range of ``tiles × KEY_TILE`` keys, all the group's query rows (≤ ``MAX_ROWS``) at once. Per key
  tile: thread ``t`` takes key ``j0 + t`` and computes its score against every row (the key's
  row of K read once, Q resident in shared memory as f32), through the fused logit ops (scale,
  masks); a warp per row then takes the tile's max and sum with warp reductions and updates the
  row's running max ``m`` and sum ``l`` (kept in registers of that warp's lanes); each thread
  rescales and accumulates its share of the unnormalised ``O`` (consecutive threads on
  consecutive value columns: V's rows are read coalesced). SIMT FMAs in f32: with one query row
  there is no product to put on tensor cores. The block writes ``(O_s, m_s, l_s)`` per row to a
  scratch buffer.
* **combine** — a thread per output element: ``M = max_s m_s``, ``O = Σ exp(m_s − M)·O_s /
  Σ exp(m_s − M)·l_s`` (0 for a row every key hides when the graph asks for it, else NaN as
  softmax of all -inf), then the group's fused epilogue.

The number of splits aims at ``SPLIT_BLOCKS_PER_SM`` blocks per SM over all batch·heads, in whole
key tiles; keys past the end of a split's range are the next split's. **Hidden tiles are
skipped**: where the logits hide keys with ``where(mask, x, -inf)`` (``Attention.masks``, as the
CPU kernel reads them — a static KV cache's positions past the current one, padding), a thread
reads its key's row of K only when some query row sees the key, and a tile no row sees skips the
softmax update and its V reads entirely (its three barriers still run: the CPU lowering of the SIMT
IR cannot branch around a barrier on a value in memory); a split every key of which is hidden
writes ``m = -inf, l = 0`` and adds nothing in the combine.

Chosen (``decode_plan``) for at most ``MAX_ROWS`` query rows and at least ``MIN_KEYS`` keys, f16,
bf16 or f32 (SIMT: f32 attention fuses here, where the tensor-core kernel refuses it); prefill
shapes keep the tensor-core kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.ir import make_node
from sextant.kernel.ir import (
    Assign,
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
    Select,
    Store,
    Unary,
    WarpReduce,
)
from sextant.kernel.sizes import with_grid
from sextant.schedule.attention_match import Attention, at
from sextant.schedule.gpu_kernels import BID_X, TID_X, _bool, _check_shared, _grid, _guarded, _strided_loop
from sextant.schedule.indexing import ValueEmitter, c, divisible, iadd, idiv, imin, imod, imul
from sextant.schedule.kernels import KernelChain, setup_kernel, store_epilogue
from sextant.schedule.online_softmax import logit
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc

MAX_ROWS = 16  # query rows per batch·head: a decode step (1), speculative / multi-token decoding (≤ 16)
THREADS = 64  # threads per partials block: two warps, one key of the tile each
KEY_TILE = THREADS  # keys per tile (one per thread); keys per split are a multiple of it
MIN_KEYS = 256  # fewer keys: one tensor-core block per batch·head is cheap enough, no second launch
MAX_ACC = 32  # O accumulators per thread: rows × Dv ≤ THREADS · MAX_ACC (16 rows of 128)
MAX_HEAD = 256  # the score loop over the head dim is unrolled up to this
SPLIT_BLOCKS_PER_SM = 2  # one 2-warp block per SM leaves too few warps to hide DRAM latency
COMBINE_THREADS = 256
DTYPES = (DType.f16, DType.bf16, DType.f32)


@dataclass(frozen=True)
class DecodePlan:
    rows: int  # query rows per batch·head
    heads: int  # batch·heads
    keys: int
    splits: int
    tiles: int  # key tiles per split

    @property
    def split_keys(self) -> int:
        return self.tiles * KEY_TILE

    def describe(self) -> str:
        tiles = f"{self.tiles} tile{'s' if self.tiles > 1 else ''}"
        return f"{self.splits} split{'s' if self.splits > 1 else ''} of {self.split_keys} keys ({tiles} of {KEY_TILE})"


def _static(*dims: object) -> bool:
    return all(isinstance(d, int) for d in dims)


def decode_plan(att: Attention, target: TargetDesc) -> DecodePlan | None:
    """The split-key plan for ``att`` on ``target``, or None when the shape is not a decode step
    (more than ``MAX_ROWS`` query rows, fewer than ``MIN_KEYS`` keys, symbolic sizes, a causal
    iota mask — with at most 16 rows it leaves at most 16 keys — or an unsupported dtype)."""
    if not target.is_gpu or att.causal:
        return None
    q, kt, v = att.q, att.kt, att.v
    *batch, n_q, d = q.shape
    n_kv, dv = kt.shape[-1], v.shape[-1]
    if not _static(*batch, n_q, d, n_kv, dv) or n_q > MAX_ROWS or n_kv < MIN_KEYS:
        return None
    if any(x.dtype not in DTYPES for x in (q, kt, v, att.scores, att.logits)) or att.out.dtype not in DTYPES:
        return None
    if d > MAX_HEAD or n_q * dv > THREADS * MAX_ACC:
        return None
    heads = math.prod(batch)
    tiles = -(-n_kv // KEY_TILE)
    want = max(1, -(-SPLIT_BLOCKS_PER_SM * target.cores // heads))
    per = -(-tiles // min(tiles, want))
    return DecodePlan(n_q, heads, n_kv, -(-tiles // per), per)


def gpu_flash_decoding(group: Group, stored: set[int], target: TargetDesc, name: str) -> KernelChain:
    """The partials and combine kernels of a decode-shaped attention group, and their scratch."""
    att = group.attention
    assert att is not None
    plan = decode_plan(att, target)
    assert plan is not None
    dv = att.v.shape[-1]
    scratch = make_node("full", (), {"value": 0.0, "shape": (plan.splits, plan.heads * plan.rows, dv + 2),
                                     "dtype": DType.f32, "scratch": f"split-key partials (O, m, l) of the "
                                     f"attention at {att.out.loc or '?'}"}, att.out.loc)
    return KernelChain((_partials(group, stored, target, name, plan), _combine(group, stored, target, name, plan)),
                       (scratch,))


def _params(group: Group, stored: set[int], role: str) -> tuple[ValueEmitter, list[Buffer]]:
    """The group's canonical parameters with the scratch buffer between its reads and its outputs
    (``program.schedule`` passes the chain's scratch buffers there to every kernel of a chain)."""
    e, params, ins = setup_kernel(group, stored)
    n = len(ins)
    return e, [*params[:n], Buffer("scratch", DType.f32, 0, "global", role), *params[n:]]


def _sized(params: list[Buffer], size: int) -> tuple[Buffer, ...]:
    return tuple(Buffer(p.name, p.dtype, size, p.space, p.role) if p.name == "scratch" else p for p in params)


def _partials(group: Group, stored: set[int], target: TargetDesc, name: str, plan: DecodePlan) -> Kernel:
    att = group.attention
    assert att is not None
    f32 = DType.f32
    q, kt, v = att.q, att.kt, att.v
    n_q, d = q.shape[-2:]
    n_kv, dv = kt.shape[-1], v.shape[-1]
    e, params = _params(group, stored, "out")
    grid, (split, bz, _) = _grid(e, (plan.splits, plan.heads, 1))
    t = TID_X
    warps = THREADS // 32
    lane, warp = e.bind(imod(t, 32), "lane"), e.bind(idiv(t, 32), "warp")
    rows_per_warp = -(-n_q // warps)
    n_acc = -(-n_q * dv // THREADS)
    ragged = not divisible(n_kv, KEY_TILE)
    neg_inf, zero = Const(-math.inf, f32), Const(0.0, f32)
    shared = [Buffer("Qs", f32, n_q * d, "shared"), Buffer("Ss", f32, n_q * KEY_TILE, "shared"),
              Buffer("Cs", f32, n_q, "shared")]
    if att.masks:
        shared.append(Buffer("Vis", f32, 2 * warps, "shared"))  # per warp, double-buffered by tile parity
    local = (Buffer("sacc", f32, n_q, "local"), Buffer("oacc", f32, n_acc, "local"),
             Buffer("ml", f32, 2 * rows_per_warp, "local"))

    def f32_of(x: Expr) -> Expr:
        return x if x.dtype == f32 else Cast(x, f32)

    # Q, resident as f32 for the whole kernel
    for p in range(-(-n_q * d // THREADS)):
        el = iadd(t, c(p * THREADS))

        def stage_q(el: Expr = el) -> None:
            r, col = e.bind(idiv(el, d), "r"), e.bind(imod(el, d), "qc")
            e.emit(Store("Qs", el, f32_of(e.value(q, at(q, bz, r, col)))))

        _guarded(e, None if (p + 1) * THREADS <= n_q * d else _bool("lt", el, c(n_q * d)), stage_q)
    _strided_loop(e, c(0), n_acc, 1, lambda u: e.emit(Store("oacc", u, zero)), "u", unroll=True)
    for rr in range(rows_per_warp):  # running max and sum of this warp's rows, the same in all its lanes
        e.emit(Store("ml", c(2 * rr), neg_inf))
        e.emit(Store("ml", c(2 * rr + 1), zero))
    e.emit(Barrier())

    k0 = e.bind(imul(split, plan.split_keys), "k0")
    total_tiles = -(-n_kv // KEY_TILE)
    # the last split may have fewer tiles (min(): its bound is a constant for the range analysis)
    stop = e.bind(imin(c(plan.tiles), iadd(c(total_tiles), imul(split, -plan.tiles))), "tend")
    jt = e.var("jt")
    with e.scope() as tile_body:
        j0 = e.bind(iadd(k0, imul(jt, KEY_TILE)), "j0")
        key = e.bind(iadd(j0, t), "key")
        kc = e.bind(imin(key, c(n_kv - 1)), "kc")  # (rows of a ragged last tile past n_kv: masked below)

        def shown(r: Expr) -> Expr | None:
            """Whether row ``r`` sees this thread's key by ``att.masks`` (None: no mask)."""
            conds = [e.value(m, at(m, bz, r, kc)) for m in att.masks]
            if ragged:
                conds.append(_bool("lt", key, c(n_kv)))
            out: Expr | None = None
            for cond in conds:
                out = cond if out is None else _bool("bitwise_and", out, cond)
            return out

        def scores() -> None:
            """Q·k for every row (this thread's key row of K read once), then each row's logit."""
            for r in range(n_q):
                e.emit(Store("sacc", c(r), zero))

            def dot(dd: Expr) -> None:
                kval = e.bind(f32_of(e.value(kt, at(kt, bz, dd, kc))), "kv")
                for r in range(n_q):
                    qv = Load("Qs", iadd(c(r * d), dd), f32)
                    e.emit(Store("sacc", c(r), Binary("add", Load("sacc", c(r), f32),
                                                       Binary("mul", qv, kval, f32), f32)))

            _strided_loop(e, c(0), d, 1, dot, "dd", unroll=True)
            for r in range(n_q):
                z = logit(e, att, bz, c(r), kc, Load("sacc", c(r), f32), None)
                if ragged:
                    z = e.bind(Select(_bool("lt", key, c(n_kv)), z, neg_inf, f32), "z")
                e.emit(Store("Ss", iadd(c(r * KEY_TILE), t), z))

        if att.masks:  # read K only for a key some row sees; flag the tile for the warp
            any_row: Expr | None = None
            for r in range(n_q):
                s = shown(c(r))
                any_row = s if any_row is None else _bool("bitwise_or", any_row, s)
            assert any_row is not None
            seen = e.bind(any_row, "seen")
            with e.scope() as compute:
                scores()
            with e.scope() as hidden:
                for r in range(n_q):
                    e.emit(Store("Ss", iadd(c(r * KEY_TILE), t), neg_inf))
            e.emit(If(seen, tuple(compute), tuple(hidden)))
            flag = e.var("wseen", f32)
            e.emit(WarpReduce(flag, "max", Select(seen, Const(1.0, f32), zero, f32), 32))
            slot = e.bind(iadd(imul(imod(jt, 2), warps), warp), "vslot")
            e.emit(If(_bool("eq", lane, c(0)), (Store("Vis", slot, flag),)))
        else:
            scores()
        e.emit(Barrier())
        visible: Expr | None = None
        if att.masks:  # whether any thread of the block flagged the tile
            base = imul(imod(jt, 2), warps)
            flags: Expr = Load("Vis", base, f32)
            for w in range(1, warps):
                flags = Binary("maximum", flags, Load("Vis", iadd(base, c(w)), f32), f32)
            visible = _bool("gt", e.bind(flags, "vis"), zero)
        # (the barriers stay outside the branches: a branch on memory cannot hold one on the CPU,
        # whose SIMT lowering runs a barrier's branch outside the loop over threads)
        _guarded(e, visible, lambda: _online_softmax(e, n_q, warps, lane, warp))
        e.emit(Barrier())
        _guarded(e, visible, lambda: _accumulate(e, att, bz, j0, n_q, dv, n_kv, n_acc))
        e.emit(Barrier())  # Ss and Cs are rewritten by the next tile
    e.emit(For(jt, c(0), stop, 1, tuple(tile_body)))

    # (O_s, m_s, l_s) of every row: scratch[split][bz·rows + r][0:dv | m | l]
    stride = dv + 2
    row0 = e.bind(imul(iadd(imul(split, plan.heads), bz), n_q), "srow")
    for i in range(n_acc):
        el = t if i == 0 else iadd(t, c(i * THREADS))

        def write_o(el: Expr = el, i: int = i) -> None:
            r, col = e.bind(idiv(el, dv), "r"), e.bind(imod(el, dv), "oc")
            e.emit(Store("scratch", iadd(imul(iadd(row0, r), stride), col), Load("oacc", c(i), f32)))

        _guarded(e, None if (i + 1) * THREADS <= n_q * dv else _bool("lt", el, c(n_q * dv)), write_o)
    for rr in range(rows_per_warp):
        r = e.bind(iadd(warp, c(rr * warps)), "r")
        with e.scope() as stats:
            base = e.bind(iadd(imul(iadd(row0, r), stride), c(dv)), "sb")
            e.emit(Store("scratch", base, Load("ml", c(2 * rr), f32)))
            e.emit(Store("scratch", iadd(base, c(1)), Load("ml", c(2 * rr + 1), f32)))
        cond = _bool("eq", lane, c(0))
        if (rr + 1) * warps > n_q:
            cond = _bool("bitwise_and", cond, _bool("lt", r, c(n_q)))
        e.emit(If(cond, tuple(stats)))
    _check_shared(name, shared, target)
    meta = {"mapping": "attention-split-key-partials", "split_key": plan.describe(), "rows": n_q,
            "threads": THREADS, "skips_hidden_tiles": bool(att.masks)}
    return with_grid(Kernel(name, _sized(params, plan.splits * plan.heads * n_q * stride), (1, 1, 1),
                            (THREADS, 1, 1), tuple(e.stmts), shared=tuple(shared), local=local, meta=meta), grid)


def _online_softmax(e: ValueEmitter, n_q: int, warps: int, lane: Expr, warp: Expr) -> None:
    """A warp per row: the tile's max and sum of ``exp(z - m)`` over its 64 logits (two per lane),
    ``P`` in place of the logits, the running ``m``/``l`` in the warp's registers and the rescale
    factor of the row's output in ``Cs``."""
    f32 = DType.f32
    neg_inf, zero = Const(-math.inf, f32), Const(0.0, f32)
    for rr in range(-(-n_q // warps)):
        r = e.bind(iadd(warp, c(rr * warps)), "r")
        with e.scope() as body:
            slots = [e.bind(iadd(imul(r, KEY_TILE), iadd(lane, c(32 * h))), "sp") for h in range(KEY_TILE // 32)]
            zs = [e.bind(Load("Ss", s, f32), "z") for s in slots]
            lane_max = zs[0]
            for z in zs[1:]:
                lane_max = Binary("maximum", lane_max, z, f32)
            tmax = e.var("tmax", f32)
            e.emit(WarpReduce(tmax, "max", lane_max, 32))
            m = e.bind(Load("ml", c(2 * rr), f32), "m")
            m_new = e.bind(Binary("maximum", m, tmax, f32), "mn")
            # a row hidden so far keeps m = -inf: shift by 0 then, so exp gives 0, not NaN
            sh = e.bind(Select(_bool("eq", m_new, neg_inf), zero, m_new, f32), "sh")
            corr = e.bind(Unary("exp", Binary("sub", m, sh, f32), f32), "corr")
            part: Expr | None = None
            for s, z in zip(slots, zs):
                p = e.bind(Unary("exp", Binary("sub", z, sh, f32), f32), "p")
                e.emit(Store("Ss", s, p))
                part = p if part is None else Binary("add", part, p, f32)
            assert part is not None
            tsum = e.var("tsum", f32)
            e.emit(WarpReduce(tsum, "sum", part, 32))
            e.emit(Store("ml", c(2 * rr), m_new))
            e.emit(Store("ml", c(2 * rr + 1), Binary("add", Binary("mul", Load("ml", c(2 * rr + 1), f32), corr, f32),
                                                       tsum, f32)))
            e.emit(If(_bool("eq", lane, c(0)), (Store("Cs", r, corr),)))
        if (rr + 1) * warps > n_q:
            e.emit(If(_bool("lt", r, c(n_q)), tuple(body)))
        else:
            e.stmts.extend(body)


def _accumulate(e: ValueEmitter, att: Attention, bz: Expr, j0: Expr, n_q: int, dv: int, n_kv: int, n_acc: int) -> None:
    """``O[r][col] = O[r][col]·corr[r] + Σ_j P[r][j]·V[j][col]`` for this thread's elements of O
    (element ``t + 64·i``: consecutive threads on consecutive value columns)."""
    f32 = DType.f32
    v = att.v
    t = TID_X
    cells = []  # per accumulator: (row, column, the column's offset from the thread's: shared V loads)
    for i in range(n_acc):
        if dv % THREADS == 0:  # every thread's i-th element is in row i·64 // dv: a constant
            r, col = c(i * THREADS // dv), e.bind(iadd(t, c(i * THREADS % dv)), "oc")
            cells.append((r, col, i * THREADS % dv))
        else:
            el = t if i == 0 else iadd(t, c(i * THREADS))
            if (i + 1) * THREADS > n_q * dv:  # past the last element: clamp, computed and never stored
                el = imin(el, c(n_q * dv - 1))
            r, col = e.bind(idiv(el, dv), "r"), e.bind(imod(el, dv), "oc")
            cells.append((r, col, -1 - i))
        e.emit(Store("oacc", c(i), Binary("mul", Load("oacc", c(i), f32), Load("Cs", r, f32), f32)))
    jj = e.var("jj")
    with e.scope() as body:
        key = e.bind(imin(iadd(j0, jj), c(n_kv - 1)), "kc")  # a ragged tile's keys past n_kv have P = 0
        vals: dict[int, Expr] = {}
        for i, (r, col, offset) in enumerate(cells):
            vv = vals.get(offset)
            if vv is None:
                x = e.value(v, at(v, bz, key, col))
                vv = vals[offset] = e.bind(x if x.dtype == f32 else Cast(x, f32), "vv")
            p = Load("Ss", iadd(imul(r, KEY_TILE), jj), f32)
            e.emit(Store("oacc", c(i), Binary("add", Load("oacc", c(i), f32), Binary("mul", p, vv, f32), f32)))
    e.emit(For(jj, c(0), c(KEY_TILE), 1, tuple(body)))


def _combine(group: Group, stored: set[int], target: TargetDesc, name: str, plan: DecodePlan) -> Kernel:
    """A thread per output element: the splits' partials merged by their maxima, then the epilogue."""
    att = group.attention
    assert att is not None
    f32 = DType.f32
    out = att.out
    n_q, dv = plan.rows, att.v.shape[-1]
    e, params = _params(group, stored, "in")
    total = plan.heads * n_q * dv
    threads = min(COMBINE_THREADS, -(-total // 32) * 32)
    blocks = -(-total // threads)
    el = e.bind(iadd(imul(BID_X, threads), TID_X), "el")
    stride, rows_total = dv + 2, plan.heads * n_q
    neg_inf, zero = Const(-math.inf, f32), Const(0.0, f32)

    def body() -> None:
        row, col = e.bind(idiv(el, dv), "row"), e.bind(imod(el, dv), "col")
        mx = e.var("mx", f32)
        e.emit(Assign(mx, neg_inf))
        s = e.var("s")
        e.emit(For(s, c(0), c(plan.splits), 1, (
            Assign(mx, Binary("maximum", mx, Load("scratch", iadd(imul(iadd(imul(s, rows_total), row), stride), c(dv)),
                                                  f32), f32)),)))
        sh = e.bind(Select(_bool("eq", mx, neg_inf), zero, mx, f32), "sh")
        num, den = e.var("num", f32), e.var("den", f32)
        e.emit(Assign(num, zero))
        e.emit(Assign(den, zero))
        s2 = e.var("s")
        with e.scope() as acc:
            base = e.bind(imul(iadd(imul(s2, rows_total), row), stride), "pb")
            w = e.bind(Unary("exp", Binary("sub", Load("scratch", iadd(base, c(dv)), f32), sh, f32), f32), "w")
            e.emit(Assign(num, Binary("add", num, Binary("mul", w, Load("scratch", iadd(base, col), f32), f32), f32)))
            e.emit(Assign(den, Binary("add", den, Binary("mul", w, Load("scratch", iadd(base, c(dv + 1)), f32), f32),
                                      f32)))
        e.emit(For(s2, c(0), c(plan.splits), 1, tuple(acc)))
        val: Expr = e.bind(Binary("div", num, den, f32), "o")
        if att.guarded:  # where(m == -inf, 0, .): a row the mask hides entirely
            val = e.bind(Select(_bool("eq", mx, neg_inf), zero, val, f32), "o")
        e.regs[id(out)] = e.bind(val if out.dtype == f32 else Cast(val, out.dtype), "o")
        bz, r = e.bind(idiv(row, n_q), "bz"), e.bind(imod(row, n_q), "qr")
        store_epilogue(e, group, at(out, bz, r, col))
        e.regs.pop(id(out))

    _guarded(e, None if blocks * threads == total else _bool("lt", el, c(total)), body)
    meta = {"mapping": "attention-split-key-combine", "split_key": plan.describe()}
    return Kernel(name, _sized(params, plan.splits * rows_total * stride), (blocks, 1, 1), (threads, 1, 1),
                  tuple(e.stmts), meta=meta)
