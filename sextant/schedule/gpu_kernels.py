"""GPU mappings: each fused group kind spread over blocks, warps and threads (``target.is_gpu``).

The contract is that of the CPU mappings in ``kernels.py``: ``(group, stored, target, name) ->
Kernel``, the same canonical buffers (``in0..``, ``out0..``), the same fusion and the same
inlined indexing (``ValueEmitter``), so deduplication, launches and the memory plan don't
change. Only the mapping onto the machine differs: many threads per block, consecutive
threads on consecutive elements of the innermost dimension (coalesced global accesses), warp
shuffles and shared memory for reductions, shared-memory tiles for matmul and (``gpu_conv.py``,
an implicit GEMM built from the same :class:`GemmTiles`) convolution.

The parameters are tuned for ``sm90_target()`` (warps of 32, 48 KiB of static shared memory,
at most 1024 threads a block) and read from the target where they depend on it. Every kernel
here also runs, unchanged, through the SIMT CPU lowering (``codegen/llvm_cpu``), which is how
they are tested without a GPU. Rules the mappings keep for both lowerings: a ``Barrier`` is
only under thread-uniform control; a ``WarpReduce`` is executed by every lane of its warp
(out-of-range rows are clamped, not skipped, and only their stores are guarded); loads are
never out of bounds (tile loads outside the matrix are skipped and write a zero instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.symbolic import Dim, SymDim
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
    Special,
    Stmt,
    Store,
    Var,
    WarpReduce,
)
from sextant.kernel.ranges import assigned_names, contains_load, free_names
from sextant.kernel.sizes import capacity, with_grid
from sextant.schedule.indexing import (
    Index,
    ValueEmitter,
    accum_dtype,
    c,
    combine_op,
    delinearize,
    divisible,
    iadd,
    idiv,
    imin,
    imod,
    imul,
    linearize,
    may_be_nonzero,
    reduce_identity,
)
from sextant.schedule.kernels import conv_accumulate, regs_ready, setup_kernel, store_epilogue
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc

TID_X, TID_Y = Special("tid", "x"), Special("tid", "y")
BID_X, BID_Y, BID_Z = Special("bid", "x"), Special("bid", "y"), Special("bid", "z")
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z (gridDim.x goes to 2**31 - 1)

# elementwise and the direct conv fallback: one thread per output element
ELEMENTWISE_THREADS = 256  # 8 warps: enough to hide latency, small enough for 8 blocks per SM
CONV_THREADS = 256

# reductions
REDUCE_THREADS = 256  # threads per block for both reduction mappings (8 warps)
SHORT_ROW = 1024  # rows up to this many elements get (part of) a warp; longer ones a whole block

# matmul: a 64x64 tile of C per block of 16x16 threads, each thread a 4x4 register micro-tile
MM_TILE_M, MM_TILE_N, MM_TILE_K = 64, 64, 16
MM_THREADS_X, MM_THREADS_Y = 16, 16
MM_MICRO_M, MM_MICRO_N = MM_TILE_M // MM_THREADS_Y, MM_TILE_N // MM_THREADS_X


# -- helpers -----------------------------------------------------------------------------------------
def _bool(op: str, a: Expr, b: Expr) -> Expr:
    return Binary(op, a, b, DType.bool)


def _and(conds: list[Expr]) -> Expr | None:
    """The conjunction of ``conds`` (None when empty: no guard needed)."""
    out: Expr | None = None
    for cond in conds:
        out = cond if out is None else _bool("bitwise_and", out, cond)
    return out


def _guarded(e: ValueEmitter, cond: Expr | None, body: Callable[[], None],
             orelse: Callable[[], None] | None = None) -> None:
    """``if cond: body() else: orelse()``, or just ``body()`` when there is no condition."""
    if cond is None:
        body()
        return
    with e.scope() as then:
        body()
    other: list[Stmt] = []
    if orelse is not None:
        with e.scope() as other:
            orelse()
    e.emit(If(cond, tuple(then), tuple(other)))


def _strided_loop(e: ValueEmitter, start: Expr, stop: int, step: int, body: Callable[[Var], None],
                  prefix: str = "q", unroll: bool = False) -> None:
    """``for v in range(start, stop, step): body(v)`` (a lane's share of a row when ``start`` is
    its lane and ``step`` the number of lanes)."""
    v = e.var(prefix)
    with e.scope() as stmts:
        body(v)
    e.emit(For(v, start, c(stop), step, tuple(stmts), unroll))


def _threads_for(numel: int, target: TargetDesc, limit: int) -> int:
    """Threads per block for a one-thread-per-element mapping: ``limit``, or fewer (whole warps)
    when the output is smaller than one block."""
    warp = max(target.warp, 1)
    return max(warp, min(limit, -(-numel // warp) * warp))


def _grid(e: ValueEmitter, extents: tuple[Dim, Dim, Dim]) -> tuple[tuple[Dim, Dim, Dim], tuple[Expr, ...]]:
    """The launch grid for logical block coordinates of the given extents, and their expressions.

    The coordinates are ``bid.x/y/z`` when y and z fit CUDA's 65535 limit (a symbolic extent: at its
    upper bound); otherwise all of them are folded into ``bid.x`` (x innermost) and recovered by
    division."""
    ex, ey, ez = (x if isinstance(x, SymDim) else max(1, x) for x in extents)
    if capacity(ey) <= MAX_GRID_YZ and capacity(ez) <= MAX_GRID_YZ:
        return (ex, ey, ez), (BID_X, BID_Y if capacity(ey) > 1 else c(0), BID_Z if capacity(ez) > 1 else c(0))
    bx = e.bind(imod(BID_X, ex), "bx")
    rest = idiv(BID_X, ex)
    by = e.bind(imod(rest, ey), "by")
    bz = e.bind(idiv(rest, ey), "bz")
    return (ex * ey * ez, 1, 1), (bx, by, bz)


def _check_shared(name: str, shared: list[Buffer], target: TargetDesc) -> None:
    used = sum(b.size * b.dtype.itemsize for b in shared)
    if used > target.shared_bytes:  # a mapping bug: the parameters above are sized to fit
        raise ValueError(f"kernel {name}: {used} bytes of shared memory exceed the target's {target.shared_bytes}")


# -- elementwise -------------------------------------------------------------------------------------
def elementwise_vector_width(out: Node, target: TargetDesc) -> int:
    """Consecutive elements per thread: a 128-bit access (4 floats, 8 halves) when the innermost
    dimension splits evenly into such vectors and the output is large enough that 4× fewer
    threads still give every SM at least one full block; 1 (scalar) otherwise.

    A thread's elements then lie in one row, so each input read along that row is read at
    ``base + k`` for k < width: the NVPTX load/store vectoriser turns those into one
    ``ld.global.v4`` (parameters are 16-byte aligned), halving the instructions per byte and
    the number of threads to schedule. A small output keeps one element per thread: it is
    latency- and launch-bound, and more blocks spread it over more SMs."""
    if not out.shape:
        return 1
    width = max(1, target.vector_bytes // out.dtype.itemsize)
    numel = capacity(out.type.numel)  # a symbolic size: as large as it may get
    if width == 1 or not divisible(out.shape[-1], width) or numel // width < target.cores * ELEMENTWISE_THREADS:
        return 1
    return width


def _loads_first(stmts: list[Stmt]) -> list[Stmt]:
    """The assignments that read memory moved ahead of the arithmetic (in order, as far as their
    operands allow). The lanes' loads then sit together in one basic block — calls such as
    libdevice's ``erff`` branch internally, and the vectoriser only merges loads of one block.
    Safe because no store comes between them (the stores follow all lanes' values)."""
    hoisted: list[Stmt] = []
    rest: list[Stmt] = []
    later: set[str] = set()  # registers defined by statements left in place
    for s in stmts:
        if isinstance(s, Assign) and contains_load(s.value) and not (free_names(s.value) & later):
            hoisted.append(s)
            continue
        rest.append(s)
        later |= assigned_names([s]) if not isinstance(s, Assign) else {s.var.name}
    return hoisted + rest


def gpu_elementwise_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """One thread per output element — or per 128-bit vector of elements (see
    :func:`elementwise_vector_width`): thread ``i = bid.x * 256 + tid.x`` computes elements
    ``i*w .. i*w+w-1`` of the (row-major) output, so consecutive threads of a warp write
    consecutive elements of the last dimension — and read consecutive elements of every input
    indexed the same way — in coalesced 128-byte transactions.

    256 threads (8 warps) a block: a multiple of the warp, enough threads per block to hide
    memory latency, few enough registers for several resident blocks per SM; smaller outputs
    get one block of just enough whole warps. ``ceil(numel / w / 256)`` blocks cover the
    output; the last one is guarded by ``if i < numel / w`` (omitted when the blocks divide it
    exactly). All outputs of the group share the anchor's shape (as in the CPU mapping)."""
    out = group.outputs[0]
    e, params, _ = setup_kernel(group, stored)
    numel = out.type.numel
    width = elementwise_vector_width(out, target)
    items = numel // width
    threads = _threads_for(capacity(items), target, ELEMENTWISE_THREADS)
    blocks = -(-items // threads)
    if may_be_nonzero(numel):
        i = e.bind(iadd(imul(BID_X, threads), TID_X), "i")

        def body() -> None:
            if not out.shape:
                for k, o in enumerate(group.outputs):
                    e.emit(Store(f"out{k}", c(0), e.value(o, ())))
                return
            first = delinearize(imul(i, width), out.shape) if width > 1 else delinearize(i, out.shape)
            lanes = [(*first[:-1], iadd(first[-1], c(lane)) if lane else first[-1]) for lane in range(width)]
            # every lane's loads before any store: a store to a buffer not proved distinct from
            # the inputs would otherwise keep the vectoriser from merging the later loads
            with e.scope() as computed:
                values = [[e.value(o, idx) for o in group.outputs] for idx in lanes]
            for s in _loads_first(computed):
                e.emit(s)
            for idx, vals in zip(lanes, values):
                for k, (o, v) in enumerate(zip(group.outputs, vals)):
                    e.emit(Store(f"out{k}", linearize(idx, o.shape), v))

        _guarded(e, None if divisible(items, threads) else _bool("lt", i, c(items)), body)
    meta = {"mapping": "thread-per-element" if width == 1 else f"thread-per-{width}-elements", "vector": width}
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), (threads, 1, 1), tuple(e.stmts), meta=meta),
                     (blocks, 1, 1))


# -- reductions ----------------------------------------------------------------------------------------
class _Rows:
    """The iteration space of a reduce group: rows (points of the kept dims) × the reduced dims."""

    def __init__(self, group: Group):
        self.group = group
        self.shape, self.axes = group.domain
        self.row_dims = [d for d in range(len(self.shape)) if d not in self.axes]
        self.red_shape = [self.shape[d] for d in self.axes]
        self.n_red = math.prod(self.red_shape)
        self.rows = math.prod(self.shape[d] for d in self.row_dims)
        self.row_shape = tuple(1 if d in self.axes else s for d, s in enumerate(self.shape))
        self.members = {id(m) for m in group.members}

    def row_index(self, r: Expr) -> Index:
        return delinearize(r, [self.shape[d] for d in self.row_dims])

    def full_index(self, row_idx: Index, q: Expr | None) -> Index:
        """The index of reduction element ``q`` of the row (the row's own index when None)."""
        red_idx = delinearize(q, self.red_shape) if q is not None else tuple(c(0) for _ in self.axes)
        out: list[Expr] = [c(0)] * len(self.shape)
        for d, i in zip(self.row_dims, row_idx):
            out[d] = i
        for d, i in zip(self.axes, red_idx):
            out[d] = i
        return tuple(out)


Combine = Callable[[int, Var, str, DType], Expr]  # (reduction #, lane partial, fn, dtype) -> row result


def _reduce_row(e: ValueEmitter, rs: _Rows, row_idx: Index, lane: Expr, lanes: int, combine: Combine) -> None:
    """Each reduction of the group in order (so softmax's sum and LayerNorm's variance see the
    earlier results): every lane accumulates elements ``lane, lane + lanes, ...`` of the row in
    a register (f32 for half types), ``combine`` merges the lanes' partials into the row result
    (held by every lane), then the row values that only needed the reductions so far are
    computed once."""
    at_row = rs.full_index(row_idx, None)
    k = 0
    for m in rs.group.members:
        if m.op != "reduce":
            continue
        fn = m.attr("fn")
        acc_t = accum_dtype(m.dtype)
        acc = e.var("acc", acc_t)
        e.emit(Assign(acc, Const(reduce_identity(fn, acc_t), acc_t)))

        def step(q: Var, m: Node = m, acc: Var = acc, fn: str = fn, acc_t: DType = acc_t) -> None:
            v = e.value(m.inputs[0], rs.full_index(row_idx, q))
            v = v if v.dtype == acc_t else Cast(v, acc_t)
            e.emit(Assign(acc, Binary(combine_op(fn), acc, v, acc_t)))

        _strided_loop(e, lane, rs.n_red, lanes, step)
        result = combine(k, acc, fn, acc_t)
        k += 1
        e.regs[id(m)] = result if acc_t == m.dtype else e.bind(Cast(result, m.dtype))
        for v in rs.group.members:
            if v.op != "reduce" and v.shape == rs.row_shape and regs_ready(v, e.regs, rs.members, e.buffers):
                e.value(v, at_row)


def _store_row(e: ValueEmitter, rs: _Rows, row_idx: Index, lane: Expr, lanes: int, valid: Expr | None) -> None:
    """Store the row's outputs: row-shaped ones by lane 0, full-shape ones by all lanes
    cooperatively (lane ``l`` stores elements ``l, l + lanes, ...``: coalesced along the
    reduced dims); only rows that exist (``valid``)."""
    at_row = rs.full_index(row_idx, None)
    outs = list(enumerate(rs.group.outputs))
    row_outs = [(k, o) for k, o in outs if o.shape == rs.row_shape]
    full_outs = [(k, o) for k, o in outs if o.shape != rs.row_shape]

    def stores() -> None:
        if row_outs:
            def row_store() -> None:
                for k, o in row_outs:
                    e.emit(Store(f"out{k}", linearize(at_row, o.shape), e.value(o, at_row)))

            _guarded(e, _bool("eq", lane, c(0)) if lanes > 1 else None, row_store)
        if full_outs:
            def store(q: Var) -> None:
                idx = rs.full_index(row_idx, q)
                for k, o in full_outs:
                    e.emit(Store(f"out{k}", linearize(idx, o.shape), e.value(o, idx)))

            _strided_loop(e, lane, rs.n_red, lanes, store)

    _guarded(e, valid, stores)


def _warp_width(n_red: Dim, target: TargetDesc) -> int:
    """Lanes per row for short rows: the warp, or the smallest power of two ≥ the row length (a
    symbolic length: its upper bound)."""
    return min(target.warp, 1 << max(0, capacity(n_red) - 1).bit_length())


def gpu_reduce_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Reductions over rows, every reduction of the group in order in one kernel (softmax,
    LayerNorm, RMSNorm stay one kernel; f16/bf16 accumulate in f32). Two mappings by row length:

    * **short rows** (≤ ``SHORT_ROW`` = 1024 elements, ≤ 32 per lane): a warp per row — or, for
      rows shorter than 32, a group of ``L`` lanes (the next power of two ≥ the row length) so
      a warp holds ``32 / L`` rows instead of idling most lanes. Block ``(L, 256 / L)``: lanes on
      ``tid.x`` (consecutive lanes read consecutive row elements), rows on ``tid.y``; 8 warps
      a block, fewer rows a block (down to one warp) when that is needed to give all SMs a
      block. Each lane strides over its row accumulating, one ``WarpReduce`` of width ``L``
      per reduction gives every lane the result — no shared memory, no barrier. Rows past the
      end are clamped to the last row (every lane takes part in the warp reductions, as the
      shuffles require) and only their stores are skipped.
    * **long rows**: a block of 256 threads per row. Each thread accumulates a strided partial,
      a ``WarpReduce`` per warp, lane 0 of each warp writes its partial to shared memory,
      ``Barrier``, the first warp combines the 8 partials (``WarpReduce`` of width 8 under
      ``tid < 32``, a warp-uniform condition) and thread 0 writes the row result to shared
      memory, ``Barrier``, every thread reads it (the broadcast). Each reduction has its own
      shared slots, so the next one can start right after.

    Then the row's outputs: row-shaped ones by one lane, full-shape ones cooperatively by all
    the row's lanes. (Lanes stride over the reduced dims, so reductions over an inner axis are
    coalesced; over an outer axis they are not — mapping lanes across rows there is future work.)
    """
    rs = _Rows(group)
    e, params, _ = setup_kernel(group, stored)
    meta: dict = {}
    shared: list[Buffer] = []
    if capacity(rs.n_red) <= SHORT_ROW:
        lanes = _warp_width(rs.n_red, target)
        per_warp = max(1, target.warp // lanes)  # rows a warp holds
        max_rows = REDUCE_THREADS // lanes
        want = -(-capacity(rs.rows) // target.cores)  # rows per block that would give every SM a block
        rows_per_block = min(max_rows, max(per_warp, -(-want // per_warp) * per_warp))
        block = (lanes, rows_per_block, 1)
        blocks = -(-rs.rows // rows_per_block)
        meta = {"mapping": "warp-per-row", "lanes_per_row": lanes, "rows_per_block": rows_per_block}
        if may_be_nonzero(rs.rows):
            lane = TID_X if lanes > 1 else c(0)
            row = e.bind(iadd(imul(BID_X, rows_per_block), TID_Y if rows_per_block > 1 else c(0)), "row")
            ragged = not divisible(rs.rows, rows_per_block)
            valid = _bool("lt", row, c(rs.rows)) if ragged else None
            r = e.bind(imin(row, c(rs.rows - 1)), "r") if ragged else row

            def warp_combine(k: int, acc: Var, fn: str, acc_t: DType) -> Expr:
                if lanes == 1:
                    return acc
                res = e.var("red", acc_t)
                e.emit(WarpReduce(res, fn, acc, lanes))
                return res

            row_idx = rs.row_index(r)
            _reduce_row(e, rs, row_idx, lane, lanes, warp_combine)
            _store_row(e, rs, row_idx, lane, lanes, valid)
    else:
        threads = REDUCE_THREADS
        warps = threads // target.warp
        block = (threads, 1, 1)
        blocks = rs.rows
        meta = {"mapping": "block-per-row", "threads": threads}
        if may_be_nonzero(rs.rows):
            lane_in_warp = e.bind(imod(TID_X, target.warp), "lane")
            warp_id = e.bind(idiv(TID_X, target.warp), "warp")

            def block_combine(k: int, acc: Var, fn: str, acc_t: DType) -> Expr:
                buf = Buffer(f"red{k}", acc_t, warps + 1, "shared")  # [warps partials, row result]
                shared.append(buf)
                part = e.var("part", acc_t)
                e.emit(WarpReduce(part, fn, acc, target.warp))
                e.emit(If(_bool("eq", lane_in_warp, c(0)), (Store(buf.name, warp_id, part),)))
                e.emit(Barrier())
                total = e.var("total", acc_t)
                mine = Load(buf.name, imin(TID_X, c(warps - 1)), acc_t)  # lanes ≥ warps: a copy, unused
                e.emit(If(_bool("lt", TID_X, c(target.warp)), (
                    WarpReduce(total, fn, mine, warps),
                    If(_bool("eq", TID_X, c(0)), (Store(buf.name, c(warps), total),)),
                )))
                e.emit(Barrier())
                return e.bind(Load(buf.name, c(warps), acc_t), "rowred")

            row_idx = rs.row_index(BID_X)
            _reduce_row(e, rs, row_idx, TID_X, threads, block_combine)
            _store_row(e, rs, row_idx, TID_X, threads, None)
    _check_shared(name, shared, target)
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), block, tuple(e.stmts), shared=tuple(shared), meta=meta),
                     (blocks, 1, 1))


# -- tiled GEMM pieces (the matmul and the implicit-GEMM convolution) -----------------------------------
TileElement = Callable[[Expr, Expr], tuple[list[Expr], Callable[[], Expr]]]
"""``(row, column)`` of an operand element → (extra conditions under which it is loaded rather than
zero, e.g. a convolution's padding; a thunk emitting its value, run under those conditions)."""


class GemmTiles:
    """The shared-memory tiled GEMM ``C[i, j] = Σ_k A[i, k]·B[k, j]`` of one thread block, as pieces
    that the matmul and the implicit-GEMM convolution (``gpu_conv.py``) assemble the same way: the
    operands differ only in how an element ``(row, column)`` is found (:data:`TileElement`), C only
    in where its elements are stored. Tile sizes, layouts and their reasoning: :func:`gpu_matmul_kernel`.

    Use: :meth:`start` (the block's tile origin), :meth:`k_loop` with a callback that calls
    :meth:`load_tile` for ``As`` and ``Bs``, then :meth:`store` with the epilogue."""

    def __init__(self, e: ValueEmitter, acc_t: DType) -> None:
        self.e, self.acc_t = e, acc_t
        self.zero = Const(0.0 if acc_t.is_float else 0, acc_t)
        self.a_tile = Buffer("As", acc_t, MM_TILE_M * MM_TILE_K, "shared")
        self.b_tile = Buffer("Bs", acc_t, MM_TILE_K * MM_TILE_N, "shared")
        self.acc = Buffer("acc", acc_t, MM_MICRO_M * MM_MICRO_N, "local")

    def as_acc(self, v: Expr) -> Expr:
        """``v`` in the accumulator type (half-precision operands are widened as tiles load)."""
        return v if v.dtype == self.acc_t else Cast(v, self.acc_t)

    def start(self, bm: Expr, bn: Expr) -> tuple[Expr, Expr]:
        """The linear thread id, and the first row and column of the block's C tile."""
        e = self.e
        self.t = e.bind(iadd(imul(TID_Y, MM_THREADS_X), TID_X), "t")
        i0 = e.bind(imul(bm, MM_TILE_M), "i0")
        j0 = e.bind(imul(bn, MM_TILE_N), "j0")
        return i0, j0

    def load_tile(self, buf: str, rows: int, cols: int, row0: Expr, col0: Expr, row_lim: int, col_lim: int,
                  element: TileElement) -> None:
        """``buf[r, c] = operand[row0 + r, col0 + c]`` (0 outside ``row_lim × col_lim`` or where the
        element's own conditions fail), ``rows*cols/threads`` elements a thread: thread ``t`` takes
        column ``t % cols`` of rows ``t // cols + p·threads/cols``."""
        e, threads = self.e, MM_THREADS_X * MM_THREADS_Y
        assert threads % cols == 0 and rows * cols % threads == 0
        ct = e.bind(imod(self.t, cols), "tc")
        rt = e.bind(idiv(self.t, cols), "tr")
        gc = e.bind(iadd(col0, ct), "gc")
        for p in range(rows * cols // threads):
            r = iadd(rt, c(p * threads // cols))
            gr = e.bind(iadd(row0, r), "gr")
            slot = iadd(imul(r, cols), ct)
            extra, value = element(gr, gc)
            guard = _and([_bool("lt", x, c(lim)) for x, lim, tile in ((gr, row_lim, rows), (gc, col_lim, cols))
                          if not divisible(lim, tile)] + extra)

            def load(slot: Expr = slot, value: Callable[[], Expr] = value) -> None:
                e.emit(Store(buf, slot, self.as_acc(value())))

            _guarded(e, guard, load, lambda slot=slot: e.emit(Store(buf, slot, self.zero)))

    def k_loop(self, k: int, load_tiles: Callable[[Expr], None]) -> None:
        """Zero the micro-tile, then per K step of ``MM_TILE_K``: ``load_tiles(k0)`` fills ``As`` and
        ``Bs``, ``Barrier``, the unrolled rank-1 updates from shared memory, ``Barrier``."""
        e, acc_t = self.e, self.acc_t
        tk, tn, nx, ny, rm, rn = MM_TILE_K, MM_TILE_N, MM_THREADS_X, MM_THREADS_Y, MM_MICRO_M, MM_MICRO_N
        _strided_loop(e, c(0), rm * rn, 1, lambda u: e.emit(Store("acc", u, self.zero)), "u", unroll=True)
        a_rows = [e.bind(imul(iadd(TID_Y, c(ny * i)), tk), "ar") for i in range(rm)]  # As row offsets
        b_cols = [e.bind(iadd(TID_X, c(nx * j)), "bc") for j in range(rn)]  # Bs columns

        def k_tile(kt: Var) -> None:
            k0 = e.bind(imul(kt, tk), "k0")
            load_tiles(k0)
            e.emit(Barrier())

            def rank1(kk: Var) -> None:
                av = [e.bind(Load("As", iadd(a_rows[i], kk), acc_t), "a") for i in range(rm)]
                brow = e.bind(imul(kk, tn), "kb")
                bv = [e.bind(Load("Bs", iadd(brow, b_cols[j]), acc_t), "b") for j in range(rn)]
                for i in range(rm):
                    for j in range(rn):
                        slot = c(i * rn + j)
                        e.emit(Store("acc", slot, Binary("add", Load("acc", slot, acc_t),
                                                         Binary("mul", av[i], bv[j], acc_t), acc_t)))

            _strided_loop(e, c(0), tk, 1, rank1, "kk", unroll=True)
            e.emit(Barrier())

        _strided_loop(e, c(0), -(-k // tk), 1, k_tile, "kt")

    def store(self, i0: Expr, j0: Expr, m: int, n: int, out: Node, store: Callable[[Expr, Expr], None]) -> None:
        """Per element of the thread's micro-tile inside the ``m × n`` result: bind ``out`` (the
        contraction node) to the accumulator, rounded to its dtype, and call ``store(row, col)``
        (the fused epilogue and its stores)."""
        e, acc_t, nx, ny, rn = self.e, self.acc_t, MM_THREADS_X, MM_THREADS_Y, MM_MICRO_N

        def out_row(i: Var) -> None:
            row = e.bind(iadd(iadd(i0, TID_Y), imul(i, ny)), "row")

            def out_col(j: Var) -> None:
                col = e.bind(iadd(iadd(j0, TID_X), imul(j, nx)), "col")
                guard = _and([_bool("lt", x, c(lim)) for x, lim, tile in ((row, m, MM_TILE_M), (col, n, MM_TILE_N))
                              if not divisible(lim, tile)])

                def element() -> None:
                    value = Load("acc", iadd(imul(i, rn), j), acc_t)
                    e.regs[id(out)] = e.bind(value if acc_t == out.dtype else Cast(value, out.dtype), "c")
                    store(row, col)
                    e.regs.pop(id(out))

                _guarded(e, guard, element)

            _strided_loop(e, c(0), rn, 1, out_col, "j", unroll=True)

        _strided_loop(e, c(0), MM_MICRO_M, 1, out_row, "i", unroll=True)

    def kernel(self, name: str, params: list[Buffer], grid: tuple[int, int, int], target: TargetDesc,
               meta: dict) -> Kernel:
        """The finished kernel: block 16×16, the two shared tiles, the register micro-tile."""
        shared = (self.a_tile, self.b_tile)
        _check_shared(name, list(shared), target)
        return with_grid(Kernel(name, tuple(params), (1, 1, 1), (MM_THREADS_X, MM_THREADS_Y, 1), tuple(self.e.stmts),
                                shared=shared, local=(self.acc,), meta=meta), grid)


# -- matmul ---------------------------------------------------------------------------------------------
def gpu_matmul_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """C[b, i, j] = Σ_k A[b, i, k]·B[b, k, j], shared-memory tiled, epilogue fused into the store.

    * A block of 16×16 threads owns a 64×64 tile of C: 256 threads, and each thread computes a
      4×4 register micro-tile (a ``local`` array indexed by constants only after unrolling, so
      it lives in registers): 16 accumulators a thread give 16 FMAs per 8 shared-memory loads.
      The micro-tile is interleaved — thread ``(tx, ty)`` owns rows ``ty + 16·r`` and columns
      ``tx + 16·s`` — so in the inner loop the 16 threads of a half-warp read 16 consecutive
      words of the B tile (no bank conflicts) and a broadcast word of the A tile, and the
      epilogue's stores are coalesced along the columns.
    * The K loop steps by 16: the block cooperatively loads the 64×16 tile of A and the 16×64
      tile of B into shared memory (4 elements of each per thread, consecutive threads on
      consecutive elements of the tile's rows, so the global reads are coalesced for row-major
      operands), with bounds guards that write zeros outside the matrices; ``Barrier``; 16
      unrolled rank-1 updates of the micro-tile; ``Barrier`` (before the tiles are overwritten).
      Shared memory: 2 × 64·16 accumulator-typed words = 8 KiB (f32), well within 48 KiB, so
      several blocks fit on an SM.
    * Half-precision inputs are converted when the tiles are loaded: tiles and accumulators are
      f32, the result is rounded once in the epilogue (torch's semantics).
    * The epilogue (bias, activation, residual, ...) runs per element of the micro-tile, under a
      guard for tiles cut by the matrix edge.
    * Grid: (column tiles, row tiles, batch) — the batch dims in grid z (folded into x beyond
      CUDA's 65535 limit).

    The pieces are :class:`GemmTiles`, shared with the implicit-GEMM convolution."""
    mm = group.anchor
    a, b = mm.inputs
    *batch, m, k = a.shape
    n = b.shape[-1]
    nb = math.prod(batch)
    e, params, _ = setup_kernel(group, stored)
    tiles = GemmTiles(e, accum_dtype(mm.dtype))
    grid, (bn, bm, bz) = _grid(e, (-(-n // MM_TILE_N), -(-m // MM_TILE_M), nb))
    meta = {"mapping": "tiled", "tile": (MM_TILE_M, MM_TILE_N, MM_TILE_K), "micro_tile": (MM_MICRO_M, MM_MICRO_N)}
    if not may_be_nonzero(mm.type.numel):
        return with_grid(Kernel(name, tuple(params), (1, 1, 1), (MM_THREADS_X, MM_THREADS_Y, 1), (), meta=meta), grid)
    bidx = delinearize(bz, batch) if batch else ()
    i0, j0 = tiles.start(bm, bn)

    def operand(x: Node) -> TileElement:
        return lambda r, col: ([], lambda: e.value(x, (*bidx, r, col)))

    def load_tiles(k0: Expr) -> None:
        tiles.load_tile("As", MM_TILE_M, MM_TILE_K, i0, k0, m, k, operand(a))
        tiles.load_tile("Bs", MM_TILE_K, MM_TILE_N, k0, j0, k, n, operand(b))

    tiles.k_loop(k, load_tiles)
    tiles.store(i0, j0, m, n, mm, lambda row, col: store_epilogue(e, group, (*bidx, row, col)))
    return tiles.kernel(name, params, grid, target, meta)


# -- convolution ----------------------------------------------------------------------------------------
# Below this many output channels per group the 64-row tiles are mostly empty: the direct mapping
# (one thread per output) is used instead. At 4, a 256-thread block already computes 64 positions
# × 4 channels = 256 outputs, as many as a direct block, and reuses each loaded input 4 times.
CONV_GEMM_MIN_CHANNELS = 4


def gpu_direct_conv_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Direct convolution, one thread per output element: thread ``i = bid.x * 256 + tid.x``
    computes output element ``i`` (consecutive threads on consecutive output columns, so output
    stores and input reads along the width are coalesced; the weights are the same for most
    threads of a warp, a broadcast), summing over its group's input channels and the kernel
    window as ``conv_accumulate`` does for the CPU, then runs the fused epilogue. 256 threads a
    block, guarded by ``if i < numel``.

    The fallback of :func:`sextant.schedule.gpu_conv.gpu_conv_kernel` for convolutions with
    fewer than ``CONV_GEMM_MIN_CHANNELS`` output channels per group (depthwise ones), where the
    implicit GEMM's 64-row tiles would be mostly empty."""
    cv = group.anchor
    e, params, _ = setup_kernel(group, stored)
    numel = cv.type.numel
    acc_t = accum_dtype(cv.dtype)
    threads = _threads_for(capacity(numel), target, CONV_THREADS)
    blocks = -(-numel // threads)
    if may_be_nonzero(numel):
        i = e.bind(iadd(imul(BID_X, threads), TID_X), "i")

        def body() -> None:
            oidx = delinearize(i, cv.shape)
            acc = conv_accumulate(e, cv, oidx)
            e.regs[id(cv)] = acc if acc_t == cv.dtype else e.bind(Cast(acc, cv.dtype))
            store_epilogue(e, group, oidx)
            e.regs.pop(id(cv))

        _guarded(e, None if divisible(numel, threads) else _bool("lt", i, c(numel)), body)
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), (threads, 1, 1), tuple(e.stmts),
                            meta={"mapping": "thread-per-element"}), (blocks, 1, 1))


# (gpu_tf32 too is imported here, eagerly: a lazy import could bind a test's monkeypatched choose_tile)
from sextant.schedule.gpu_conv import gpu_conv_kernel  # noqa: E402  (built from GemmTiles above)
from sextant.schedule.gpu_mma import gpu_mma_matmul_kernel, uses_tensor_cores  # noqa: E402
from sextant.schedule.gpu_tf32 import gpu_tf32_matmul_kernel, uses_tf32  # noqa: E402
from sextant.schedule.gpu_wgmma import gpu_wgmma_matmul_kernel, uses_wgmma  # noqa: E402


def gpu_matmul(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Warpgroup MMAs fed by TMA for f16/bf16 on sm_90a when the operands allow (``gpu_wgmma``),
    tensor cores for f16/bf16 on sm_80+ (``gpu_mma``) and for f32 when tf32 is allowed
    (``gpu_tf32``), else the CUDA-core tiled GEMM (exact fp32)."""
    if uses_wgmma(group, target):
        kernel = gpu_wgmma_matmul_kernel(group, stored, target, name)
        if kernel is not None:
            return kernel
    if uses_tensor_cores(group, target):
        return gpu_mma_matmul_kernel(group, stored, target, name)
    if uses_tf32(group, target):
        return gpu_tf32_matmul_kernel(group, stored, target, name)
    return gpu_matmul_kernel(group, stored, target, name)


GPU_MAPPINGS = {
    "elementwise": gpu_elementwise_kernel,
    "reduce": gpu_reduce_kernel,
    "matmul": gpu_matmul,
    "conv": gpu_conv_kernel,
}
