"""Lowering a fused group to a kernel-IR kernel, with the mapping chosen for the target.

One function per group kind; each documents its mapping. On the CPU (``target.warp == 1``)
a block is one thread and blocks are spread over the cores: a block walks a contiguous chunk
of rows with plain loops, so LLVM can vectorise the innermost one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.symbolic import Dim, SymDim
from sextant.kernel.ir import (
    INDEX,
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
    Special,
    Stmt,
    Store,
    Var,
)
from sextant.kernel.sizes import capacity
from sextant.schedule.cpu_amx import amx_matmul_kernel, uses_amx
from sextant.schedule.cpu_conv import conv_gemm_kernel, depthwise_kernel, is_depthwise
from sextant.schedule.cpu_gemm import Gemm, gemm_kernel
from sextant.schedule.cpu_gemv import gemv_kernel, uses_gemv
from sextant.schedule.cpu_pairs import pair_lanes, uses_pair_dot
from sextant.schedule.cpu_panels import uses_panels
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
    imul,
    linearize,
    may_be_nonzero,
    reduce_identity,
)
from sextant.schedule.partition import Group, inlinable, is_buffer
from sextant.schedule.target import TargetDesc

BID = Special("bid", "x")
MATMUL_BLOCK_M, MATMUL_BLOCK_N = 128, 64  # C tile per block (rounded to whole micro-tiles)
MATMUL_BLOCK_K = 256  # K walked in blocks of this many ... (0: never)
MATMUL_BLOCKED_K_FROM = 1024  # ... when K is at least this (see matmul_kernel)
MATMUL_BLOCK_M_PACKED = 256  # ... when B is packed: more row tiles share one packing pass
PACK_ALIAS_BYTES = 4096  # B is packed when its row stride is a multiple of this (see matmul_kernel)
MICRO_M: int | None = None  # register tile rows; None: chosen by :func:`micro_tile`
MICRO_N: int | None = None  # register tile columns (a multiple of the f32 vector width)


@dataclass(frozen=True)
class KernelChain:
    """A group computed by several kernels, launched in order, that hand values on through scratch
    buffers (split-key attention: partials, then their combine). Every kernel takes the group's
    canonical parameters with one buffer per ``scratch`` node between its reads and its outputs.
    A scratch node is a ``full`` marked ``scratch`` that the schedule appends to the program's graph
    (so artifacts and dumps name the buffer, as every buffer is named by a node) and never
    computes: the chain's first kernel writes it, the memory planner places it like any temporary."""

    kernels: tuple[Kernel, ...]
    scratch: tuple[Node, ...]


def external_buffers(group: Group, stored: set[int]) -> list[Node]:
    """Values the kernel reads from memory: graph inputs, params, and other kernels' outputs."""
    return buffers_read(group.members, stored, {id(m) for m in group.members}, group.packed)


def buffers_read(roots: Sequence[Node], stored: set[int], members: Container[int] = (),
                 packed: Mapping[int, Node] | None = None) -> list[Node]:
    """The buffers computing ``roots`` reads (depth-first, in the order of the operands): graph
    inputs, params, stored values; ``members`` are computed by the kernel itself, and read the
    compile-time layouts ``packed`` names instead of the operands they replace."""
    found: list[Node] = []
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if id(n) not in members and (is_buffer(n) or id(n) in stored or not inlinable(n)):
            found.append(n)
        else:
            ins = [packed.get(id(i), i) for i in n.inputs] if packed and id(n) in members else n.inputs
            stack.extend(reversed(ins))
    return found


def setup_kernel(group: Group, stored: set[int]) -> tuple[ValueEmitter, list[Buffer], list[Node]]:
    """The canonical parameters of a group's kernel (``in0..`` for the buffers it reads, ``out0..``
    for its stored outputs) and a value emitter over them: shared by the CPU and GPU mappings."""
    ins = external_buffers(group, stored)
    names = {id(n): f"in{k}" for k, n in enumerate(ins)}
    params = [Buffer(f"in{k}", n.dtype, n.type.numel, "global", "in") for k, n in enumerate(ins)]
    params += [Buffer(f"out{k}", o.dtype, o.type.numel, "global", "out") for k, o in enumerate(group.outputs)]
    return ValueEmitter(names), params, ins


def _chunks(rows: Dim, target: TargetDesc, work_per_row: Dim) -> tuple[int, int | Expr]:
    """(blocks, rows per block): enough blocks to feed every core a few times, none too small.

    Over a symbolic number of rows the block count is fixed (as for the rows' upper bound) and each
    block's share is computed in the kernel from the size: blocks past the rows do nothing."""
    min_rows = max(1, 4096 // max(capacity(work_per_row), 1))  # ~4k elements of work per block at least
    if isinstance(rows, SymDim):
        hi = capacity(rows)
        blocks = max(1, min(hi, 4 * target.cores, math.ceil(hi / min_rows)))
        per = Binary("maximum", c(min_rows), idiv(iadd(c(rows), c(blocks - 1)), blocks), INDEX)
        return blocks, per
    blocks = max(1, min(rows, 4 * target.cores, math.ceil(rows / min_rows)))
    per = math.ceil(rows / blocks)
    return math.ceil(rows / per), per


def _row_loop(e: ValueEmitter, rows: Dim, per: int | Expr, body: Callable[[Var], None]) -> None:
    """``for r in [bid*per, min(bid*per+per, rows))``: body(r)."""
    r = e.var("r")
    if isinstance(per, int):
        start = imul(BID, per)
        whole = divisible(rows, per)
    else:
        per = e.bind(per, "per")
        start, whole = e.bind(Binary("mul", BID, per, INDEX), "r0"), False
    with e.scope() as stmts:
        body(r)
    stop = iadd(start, c(per) if isinstance(per, int) else per)
    e.emit(For(r, start, stop if whole else imin(stop, c(rows)), 1, tuple(stmts)))


def _loop(e: ValueEmitter, n: int, body: Callable[[Var], None], prefix: str = "j", *,
          start: Expr | None = None, stop: Expr | None = None, unroll: bool = False) -> None:
    v = e.var(prefix)
    with e.scope() as stmts:
        body(v)
    e.emit(For(v, start if start is not None else c(0), stop if stop is not None else c(n), 1, tuple(stmts),
               unroll))


# -- elementwise -------------------------------------------------------------------------------
def elementwise_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Each block takes a chunk of the output's rows (all dims but the last); the last dim is
    the innermost loop, contiguous in the output."""
    out = group.outputs[0]
    e, params, _ = setup_kernel(group, stored)
    shape = out.shape or (1,)
    inner = shape[-1]
    rows = math.prod(shape[:-1])
    blocks, per = _chunks(rows, target, inner)

    def row(r: Var) -> None:
        outer = delinearize(r, shape[:-1])
        if _row_concat(group):
            _concat_row(e, out, outer, inner)
            return
        if _row_pad(group):
            _pad_row(e, out, outer)
            return

        def elem(j: Var) -> None:
            idx = (outer + (j,))[-len(out.shape):] if out.shape else ()
            for k, o in enumerate(group.outputs):
                e.emit(Store(f"out{k}", linearize(idx, o.shape), e.value(o, idx)))

        _loop(e, inner, elem)

    if may_be_nonzero(out.type.numel):
        _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts))


def _row_concat(group: Group) -> bool:
    """Whether the kernel's one output is a concat along an outer dim: each row then lies in one
    part, chosen once per row rather than per element."""
    out = group.outputs[0]
    return len(group.outputs) == 1 and out.op == "concat" and len(out.shape) >= 2 and \
        out.attr("axis") < len(out.shape) - 1


def _concat_row(e: ValueEmitter, out: Node, outer: Index, inner: int) -> None:
    """One row of an outer-dim concat: ``if i < end0 {part 0} else if ... else {last part}``, each
    arm a loop over the row computing only its own part. (The element-wise form, a select per
    part, computes every part's value — SegFormer's head concatenates four bilinear resizes, and
    paid for all four at every element: 2.7 ms of its 6.)"""
    axis = out.attr("axis")
    i = outer[axis]
    starts = list(itertools.accumulate((p.shape[axis] for p in out.inputs), initial=0))

    def arm(k: int) -> tuple[Stmt, ...]:
        part = out.inputs[k]
        with e.scope() as body:
            local = (iadd(i, c(-starts[k])),)

            def elem(j: Var) -> None:
                idx = outer[:axis] + local + outer[axis + 1:] + (j,)
                e.emit(Store("out0", linearize(outer + (j,), out.shape), e.value(part, idx)))

            _loop(e, inner, elem)
        return tuple(body)

    chain = arm(len(out.inputs) - 1)
    for k in reversed(range(len(out.inputs) - 1)):
        chain = (If(Binary("lt", i, c(starts[k + 1]), DType.bool), arm(k), chain),)
    for stmt in chain:
        e.emit(stmt)


def _row_pad(group: Group) -> bool:
    """Whether the kernel's one output is a constant ``pad`` of static sizes (a convolution's
    explicitly padded input): its rows are then filled and copied range by range."""
    out = group.outputs[0]
    return (len(group.outputs) == 1 and out.op == "pad" and len(out.shape) >= 1
            and all(isinstance(d, int) for d in (*out.shape, *out.inputs[0].shape))
            and min(*out.attr("low"), *out.attr("high")) >= 0)


def _pad_row(e: ValueEmitter, out: Node, outer: Index) -> None:
    """One row of a pad: the padding value where an outer index lies in the padding, else the
    value over ``[0, low)`` and ``[low + n, N)`` and the source row, shifted, in between — a plain
    copy LLVM vectorises. (Per element, each read was a select of a clamped index and a select of
    the value: a gather. MobileNet-V2's padded 144×56×56 input 0.27 → 0.05 ms on 2 Zen 4 cores,
    the model 6.7 → 6.2 ms in fp32, 7.1 → 6.1 in bf16.)"""
    x = out.inputs[0]
    low, inner = out.attr("low"), out.shape[-1]
    lo, n = low[-1], x.shape[-1]
    fill = Const(out.attr("value"), out.dtype)

    def fill_range(a: int, b: int) -> None:
        if b > a:
            _loop(e, 0, lambda j: e.emit(Store("out0", linearize(outer + (j,), out.shape), fill)), "j",
                  start=c(a), stop=c(b))

    src_outer = tuple(iadd(i, c(-lo_d)) for i, lo_d in zip(outer, low[:-1]))
    with e.scope() as inside:
        fill_range(0, lo)

        def copy(j: Var) -> None:
            e.emit(Store("out0", linearize(outer + (j,), out.shape), e.value(x, src_outer + (iadd(j, c(-lo)),))))

        _loop(e, 0, copy, "j", start=c(lo), stop=c(lo + n))
        fill_range(lo + n, inner)
    conds = [e.in_range(i, 0, d) for i, d, od in zip(src_outer, x.shape[:-1], out.shape[:-1]) if od != d]
    if not conds:
        e.stmts.extend(inside)
        return
    cond = conds[0]
    for more in conds[1:]:
        cond = Binary("bitwise_and", cond, more, DType.bool)
    with e.scope() as outside:
        fill_range(0, inner)
    e.emit(If(cond, tuple(inside), tuple(outside)))


# -- reductions --------------------------------------------------------------------------------
def reduce_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """One row (a point of the non-reduced dims) at a time: each reduction of the group is a loop
    over the reduced dims into a register, in order, so later ones (softmax's sum, LayerNorm's
    variance) use earlier ones; then the row's outputs are stored. Full-shape values used by
    several reductions are recomputed per loop rather than stored."""
    shape, axes = group.domain
    row_dims = [d for d in range(len(shape)) if d not in axes]
    red_shape = [shape[d] for d in axes]
    n_red = math.prod(red_shape)
    rows = math.prod(shape[d] for d in row_dims)
    e, params, _ = setup_kernel(group, stored)
    blocks, per = _chunks(rows, target, n_red * len(group.members))
    row_shape = tuple(1 if d in axes else s for d, s in enumerate(shape))
    members = {id(m) for m in group.members}

    def full_index(row_idx: Index, red_idx: Index) -> Index:
        out: list[Expr] = [c(0)] * len(shape)
        for d, i in zip(row_dims, row_idx):
            out[d] = i
        for d, i in zip(axes, red_idx):
            out[d] = i
        return tuple(out)

    def red_index(q: Var) -> Index:
        return delinearize(q, red_shape)

    def row(r: Var) -> None:
        row_idx = delinearize(r, [shape[d] for d in row_dims])
        zero_red = tuple(c(0) for _ in axes)
        at_row = full_index(row_idx, zero_red)
        for m in group.members:
            if m.op != "reduce":
                continue
            fn = m.attr("fn")
            acc_t = accum_dtype(m.dtype)
            acc = e.var("acc", acc_t)
            e.emit(Assign(acc, Const(reduce_identity(fn, acc_t), acc_t)))

            def term(q: Expr, m: Node = m, acc_t: DType = acc_t) -> Expr:
                v = e.value(m.inputs[0], full_index(row_idx, red_index(q)))
                return v if v.dtype == acc_t else Cast(v, acc_t)

            def step(q: Var, acc: Var = acc, fn: str = fn, acc_t: DType = acc_t) -> None:
                e.emit(Assign(acc, Binary(combine_op(fn), acc, term(q), acc_t)))

            lanes = reduce_lanes(target, acc_t, n_red)
            if lanes > 1:
                buf = local_lanes.setdefault(acc_t, Buffer(f"lanes_{acc_t.name}", acc_t, lanes, "local"))
                _lane_split(e, buf.name, lanes, n_red, acc, fn, acc_t, term)
            else:
                _loop(e, n_red, step, "q")
            result = acc if acc_t == m.dtype else e.bind(Cast(acc, m.dtype))
            e.regs[id(m)] = result
            for v in group.members:  # row values computable now: once per row, not per element
                if v.op != "reduce" and v.shape == row_shape and regs_ready(v, e.regs, members, e.buffers):
                    e.value(v, at_row)
        for k, o in enumerate(group.outputs):
            if o.shape == row_shape:
                e.emit(Store(f"out{k}", linearize(at_row, o.shape), e.value(o, at_row)))
        full_outs = [(k, o) for k, o in enumerate(group.outputs) if o.shape != row_shape]
        if full_outs:
            def store(q: Var) -> None:
                idx = full_index(row_idx, red_index(q))
                for k, o in full_outs:
                    e.emit(Store(f"out{k}", linearize(idx, o.shape), e.value(o, idx)))

            _loop(e, n_red, store, "q")
        for m in group.members:  # registers are per row
            e.regs.pop(id(m), None)

    local_lanes: dict[DType, Buffer] = {}
    if may_be_nonzero(rows):
        _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), local=tuple(local_lanes.values()))


def reduce_lanes(target: TargetDesc, acc_t: DType, n_red: Dim) -> int:
    """Independent partial results a CPU reduction keeps: two vectors' worth of lanes (two chains
    in flight hide the add's latency), or 1 (a plain sequential loop) for short rows."""
    lanes = 2 * max(1, target.vector_bytes // max(1, acc_t.itemsize))
    return lanes if capacity(n_red) >= 2 * lanes else 1


def _lane_split(e: ValueEmitter, buf: str, lanes: int, n_red: int, acc: Var, fn: str, acc_t: DType,
                term: Callable[[Expr], Expr]) -> None:
    """``acc = fn(term(q) for q < n_red)`` as ``lanes`` partial results, lane ``l`` taking ``q ≡ l``
    (mod lanes) — the CPU's version of a GPU warp's lanes: the lanes are a local array with constant
    indices, so LLVM keeps them in vector registers and the loop becomes vector loads and vector
    adds (a sequential float sum cannot be vectorised: its order is fixed). The lanes are then
    combined in order, and the ``n_red % lanes`` remaining terms added last."""
    op, ident = combine_op(fn), Const(reduce_identity(fn, acc_t), acc_t)
    _loop(e, lanes, lambda u: e.emit(Store(buf, u, ident)), "u", unroll=True)
    main = n_red - n_red % lanes

    def chunk(q0: Var) -> None:
        def lane(u: Var) -> None:
            e.emit(Store(buf, u, Binary(op, Load(buf, u, acc_t), term(iadd(q0, u)), acc_t)))

        _loop(e, lanes, lane, "u", unroll=True)

    v = e.var("q0")
    with e.scope() as body:
        chunk(v)
    e.emit(For(v, c(0), c(main), lanes, tuple(body)))
    for u in range(lanes):
        e.emit(Assign(acc, Binary(op, acc, Load(buf, c(u), acc_t), acc_t)))
    if isinstance(main, SymDim) or main < n_red:
        _loop(e, n_red, lambda q: e.emit(Assign(acc, Binary(op, acc, term(q), acc_t))), "q", start=c(main))


def regs_ready(n: Node, regs: dict, members: set[int], loaded: Container[int] = ()) -> bool:
    """Whether every reduction of the group that ``n`` depends on has its register set.

    An iterative walk that visits each node once (the recursion it replaces was exponential on
    diamond-shaped graphs) and stops at the values the kernel loads (``loaded``: a kernel's
    buffers never depend on its own reductions) and at other kernels' anchors."""
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if id(x) in members:
            if x.op == "reduce":
                if id(x) not in regs:
                    return False
                continue
        elif id(x) in loaded or not inlinable(x):
            continue
        stack.extend(x.inputs)
    return True


# -- matmul ------------------------------------------------------------------------------------
def micro_tile(target: TargetDesc) -> tuple[int, int]:
    """(rows, columns) of the matmul register tile: two vectors of B per k and as many rows of A
    as the registers allow, so each broadcast of A feeds two FMAs and enough independent
    accumulator chains (mr·2) are in flight to cover the FMA latency on both FMA pipes.
    AVX-512 (32 zmm): 8 × 32 = 16 accumulators; AVX2 (16 ymm): 6 × 16 = 12 accumulators, two
    for B, one broadcast. Measured on one Zen 5 core (AVX-512, Linear 768→768 on 128 rows):
    4×16 (the previous tile: 4 zmm accumulator chains, latency-bound) ~105 GFLOP/s, 8×32 ~195."""
    lanes = max(1, target.vector_bytes // 4)
    mr = MICRO_M or (8 if lanes >= 16 else 6)
    nr = MICRO_N or 2 * lanes
    return mr, nr


WIDE_ROWS = 6  # rows of A in the wide f32 register tile (see :func:`wide_tile`)


def wide_tile(target: TargetDesc, n: int) -> bool:
    """Whether an f32 GEMM over ``n`` columns of a compile-time laid-out weight (a Linear's panels,
    a convolution's strips) takes the wide register tile: with 16 f32 lanes, four vectors of B and
    ``WIDE_ROWS`` rows of A — 24 accumulators, 10 loads per 24 FMAs rather than 10 per 16 — where
    the matrix is at least that wide and a ragged N pads under an eighth of the strips' columns.

    Measured on 2 Ice Lake Xeon cores (two 512-bit FMA pipes), GFLOP/s, 8 × 32 → 6 × 64: Linear
    layers on 256 rows 768→3072 238 → 266, 3072→768 243 → 258, 197 rows 768→768 230 → 277, 128 rows
    768→768 214 → 244 (MKL's ``a @ b`` beside them 244–274); 4 × 64 and 8 × 48 in between, 12 × 32,
    14 × 32 and 7 × 64 (33 registers: spills) below 8 × 32; ResNet-50's convolutions 3×3 256→256 at
    14×14 215 → 225, 128→128 at 28×28 198 → 238, 1×1 256→1024 at 14×14 134 → 151, 1024→256 129 →
    155, 2048→512 at 7×7 88 → 102. B computed per call and attention keep :func:`micro_tile` (their
    strips are packed per block in that tile's width), and so do the bf16 pair dot kernels."""
    wide = wide_columns(target)
    return not (MICRO_M or MICRO_N) and wide >= 64 and n >= wide and (n % wide == 0 or n >= 8 * wide)


def wide_columns(target: TargetDesc) -> int:
    """Columns of the wide register tile: four vectors of f32 lanes."""
    return 4 * max(1, target.vector_bytes // 4)


def panel_tile(target: TargetDesc, n: int) -> tuple[int, int]:
    """(rows, columns) of the f32 register tile when B is a weight laid out in panels
    (``cpu_panels``): :func:`wide_tile`'s where it applies, else :func:`micro_tile`'s."""
    if wide_tile(target, n):
        return WIDE_ROWS, wide_columns(target)
    mr, nr = micro_tile(target)
    return mr, narrow_columns(n, nr)


def tile_rows(target: TargetDesc, nr: int) -> int:
    """The register tile's rows for a strip of ``nr`` columns: ``WIDE_ROWS`` for the wide tile's
    four vectors (a strip, never wider than that, takes :func:`wide_tile` exactly when it is that
    wide), else :func:`micro_tile`'s."""
    return WIDE_ROWS if wide_tile(target, nr) else micro_tile(target)[0]


def pair_columns(target: TargetDesc, n: int, weight: bool = True) -> int:
    """Columns of the bf16 pair-dot micro-tile (``cpu_pairs``): three vectors of B per pair step
    where the CPU has 16 f32 lanes — 8 broadcasts of A, 3 loads of B and 24 ``vdpbf16ps`` a step
    rather than 8, 2 and 16; measured on 2 Zen 4 cores, bf16 Linear layers (GFLOP/s, 8 × 32 →
    8 × 48): 256 rows 768→3072 369 → 435, 3072→768 355 → 438, 197 rows 768→768 371 → 394; 12 × 32
    and 6 × 64 in between. The f32 micro-kernel measured even across the same shapes and keeps two
    vectors. A matrix narrower than that keeps the f32 tile's columns, and so does a B laid out per
    call (``weight`` False), whose element-by-element layout kernel took 0.14 → 0.24 ms for 48-column
    strips (a 1×1 64→256 layer at 56×56 as ``W @ x``: 162 → 139 GFLOP/s with it)."""
    lanes = max(1, target.vector_bytes // 4)
    wide = weight and not MICRO_N and lanes >= 16 and n >= 3 * lanes
    return 3 * lanes if wide else narrow_columns(n, micro_tile(target)[1])


def narrow_columns(n: int, nr: int) -> int:
    """The register tile's columns for a matrix narrower than one strip (attention's ``P·V`` with a
    head size of 8 or 16): the widest power of two ≥ 4 that divides ``n``, so the micro-kernel
    computes no padded lanes (a full-width strip would be a zero-padded copy, half of it zeros)."""
    if n >= nr:
        return nr
    w = nr
    while w > 4 and (w > n or n % w):
        w //= 2
    return w if w <= n and n % w == 0 else nr


def _whole_tiles(x: int, to: int) -> int:
    return max(to, x // to * to)


def store_epilogue(e: ValueEmitter, group: Group, idx: Index) -> None:
    """Store every output of a contraction group for the element at ``idx`` (an index of the
    anchor; epilogue members are pointwise, so a reshaped output is the same element)."""
    anchor = group.anchor
    lin = linearize(idx, anchor.shape)
    for k, o in enumerate(group.outputs):
        oidx = idx if o.shape == anchor.shape else delinearize(lin, o.shape)
        e.emit(Store(f"out{k}", lin, e.value(o, oidx)))


def matmul_epilogue(e: ValueEmitter, group: Group, idx: Index, value: Expr) -> None:
    """Store a matmul group's outputs for C's element ``idx``, whose accumulated ``value`` (f32 for
    half types) is cast to the product's dtype: the fused epilogue of every CPU GEMM mapping."""
    mm = group.anchor
    e.regs[id(mm)] = e.bind(value if value.dtype == mm.dtype else Cast(value, mm.dtype), "c")
    store_epilogue(e, group, idx)
    e.regs.pop(id(mm))


def matmul_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """C[b, i, j] = Σ_k A[b, i, k]·B[b, k, j] with the epilogue fused into the store.

    A block owns a ``MATMUL_BLOCK_M`` × ``MATMUL_BLOCK_N`` tile of C and walks it strip by strip
    of ``nr`` columns, each strip top to bottom in ``mr`` × ``nr`` micro-tiles (:func:`micro_tile`):
    the accumulators are a local array with constant indices only, which LLVM keeps in vector
    registers; per k, row by row, one value of A is broadcast against ``nr`` contiguous values of
    B (a weight is laid out in panels by the scheduler). 128 rows per block: the strip of B
    (k × ``nr``) is re-read from L2 by 16 row tiles, A's rows by both strips (measured: 64 rows
    ~5% slower).

    A constant B (a weight) is laid out in panels at compile time (``cpu_panels``): each strip
    contiguous over K, read sequentially, no copy at run time. A B computed per call is read in
    place, and **packed** when its row stride is a multiple of 4 KiB (``n`` = 1024, 3072, ...): those
    rows all map to the same few L1/L2 sets, so the strip did not stay in L2 and 768→3072 ran at
    ~60% of 768→768. The block's first row tile of a strip copies what it reads into a local
    ``[strip][k][nr]`` buffer while it computes (no separate packing pass, whose exposed memory
    latency cost more than it saved), the later row tiles read the copy; blocks are then 256 rows
    to share each copy. For other strides packing measured 5–10% slower, so it is not done.
    From K = 1024 on, K is walked in blocks of 256 (``MATMUL_BLOCK_K``): for each block every
    row tile of the strip accumulates, keeping its partial sums in a local buffer between blocks,
    so the block's rows of A (128 × 256 floats) stay in L2 while the strip moves down. Without it
    a 128-row block of A is 128·K·4 bytes — 1.5 MB at K = 3072, past a 512 KiB L2: on a 2-core
    Rocket Lake Xeon GPT-2's 3072→768 product ran 3.5× eager, 1.5× with it (128×3072×768:
    6.5 → 2.6 ms); at K = 768 it measured ±10 % either way, so shorter K are not blocked. Not
    done: packing A (8 broadcast streams, each sequential in k).
    Rows past M are computed on a clamped row and not stored; a strip cut by the matrix edge runs
    the micro-kernel from a zero-padded copy of its columns (``cpu_gemm._pad_strip``). The
    epilogue runs per element, a row's columns as vector lanes (C is contiguous along them;
    MobileNet's 32→192 pointwise layer, ``W @ x`` with K = 32, 528 → 349 µs: with so short a K the
    scalar epilogue had cost more than the k loop). The loops are ``cpu_gemm.gemm_kernel``,
    shared with the convolution's implicit GEMM.

    A Linear layer on a few rows (a decode step: M ≤ ``cpu_gemv.GEMV_MAX_ROWS``, B a weight
    ``permute``) is a matrix-vector product instead, reading the weight in place (``cpu_gemv``)."""
    if uses_gemv(group, target):
        return gemv_kernel(group, stored, target, name)
    if uses_amx(group, target):
        return amx_matmul_kernel(group, stored, name)
    mm = group.anchor
    a, b = mm.inputs
    *batch, m, k = a.shape
    n = b.shape[-1]
    e, params, _ = setup_kernel(group, stored)
    acc_t = accum_dtype(mm.dtype)
    mr, nr = micro_tile(target)
    nr = narrow_columns(n, nr)
    pack = divisible(n * b.dtype.itemsize, PACK_ALIAS_BYTES)

    def rows(bidx: Index, i0: Expr, count: int) -> list[Callable[[Expr], Expr]]:
        return [lambda kk, r=r: e.value(a, (*bidx, iadd(i0, c(r)), kk)) for r in range(count)]

    def epilogue(bidx: Index, i: Expr, j: Expr, value: Expr) -> None:
        matmul_epilogue(e, group, (*bidx, i, j), value)

    k_block = MATMUL_BLOCK_K if capacity(k) >= MATMUL_BLOCKED_K_FROM else 0
    if uses_pair_dot(group, target):  # B laid out in pairs of K (cpu_pairs)
        p = group.packed[id(b)]
        strips, nr = p.shape[-4], p.shape[-2]  # [*batch, N/nr, K/2, nr, 2]: cpu_panels.strip_columns

        def pairs(bidx: Index, strip: Expr) -> tuple[str, Expr]:
            return e.buffers[id(p)], linearize((*bidx, strip, c(0), c(0), c(0)), p.shape)

        spec = Gemm(tuple(batch), m, strips * nr, k, acc_t, rows, lambda *_: c(0), epilogue, mr, nr, MATMUL_BLOCK_M,
                    MATMUL_BLOCK_N, n_store=n, k_block=k_block, pairs=pairs, pair_lanes=pair_lanes(target, nr),
                    vector_epilogue=True)
        kernel = gemm_kernel(e, spec, name, params, BID)
        kernel.meta.update(mapping="cpu-pair-dot", weight="[" + ", ".join(map(str, p.shape)) + "] in pairs of K")
        return kernel
    if uses_panels(group, target):  # B a weight laid out strip by strip at compile time (cpu_panels)
        p = group.packed[id(b)]
        strips, nr = p.shape[-3], p.shape[-1]  # [*batch, N/nr, K, nr]: cpu_panels.strip_columns
        mr = tile_rows(target, nr)
        panel = e.buffers[id(p)]

        def col(bidx: Index, kk: Expr, j0: Expr, j: Expr, strip: Expr | None) -> Expr:
            assert strip is not None, "whole strips only: the panels are padded"
            return Load(panel, linearize((*bidx, strip, kk, j), p.shape), p.dtype)

        spec = Gemm(tuple(batch), m, strips * nr, k, acc_t, rows, col, epilogue, mr, nr, MATMUL_BLOCK_M_PACKED,
                    MATMUL_BLOCK_N, n_store=n, k_block=k_block, vector_epilogue=True)
        kernel = gemm_kernel(e, spec, name, params, BID)
        kernel.meta.update(weight="[" + ", ".join(map(str, p.shape)) + "] in panels")
        return kernel
    spec = Gemm(tuple(batch), m, n, k, acc_t, rows, lambda bidx, kk, j0, j, _: e.value(b, (*bidx, kk, iadd(j0, j))),
                epilogue,
                mr, nr, MATMUL_BLOCK_M_PACKED if pack else MATMUL_BLOCK_M, MATMUL_BLOCK_N, pack,
                k_block=k_block, vector_epilogue=True)
    return gemm_kernel(e, spec, name, params, BID)


# -- convolution ----------------------------------------------------------------------------------
def conv_accumulate(e: ValueEmitter, cv: Node, oidx: Index) -> Var:
    """Emit the direct-convolution sum for the output element ``oidx`` of conv node ``cv``:
    a loop over (in channels of its group, kernel offsets), reading the input through a bounds
    check that stands for zero padding. Returns the accumulator register (f32 for half types)."""
    x, w = cv.inputs
    stride, padding, dilation, groups = (cv.attr(k) for k in ("stride", "padding", "dilation", "groups"))
    nsp = len(cv.shape) - 2
    cin_g = w.shape[1]
    cout_g = w.shape[0] // groups
    ksp = w.shape[2:]
    acc_t = accum_dtype(cv.dtype)
    nn, co = oidx[0], oidx[1]
    g = e.bind(Binary("div", co, c(cout_g), INDEX), "g") if groups > 1 else c(0)
    acc = e.var("acc", acc_t)
    e.emit(Assign(acc, Const(0.0, acc_t)))

    def red(q: Var) -> None:
        ci, *kk = delinearize(q, (cin_g, *ksp))
        inb: Expr = Const(True, DType.bool)
        pos = []
        for d in range(nsp):
            p = iadd(iadd(imul(oidx[2 + d], stride[d]), c(-padding[d])), imul(kk[d], dilation[d]))
            p = e.bind(p, "p")
            if padding[d]:
                ok = e.bind(Binary("bitwise_and", Binary("ge", p, c(0), DType.bool),
                                   Binary("lt", p, c(x.shape[2 + d]), DType.bool), DType.bool), "inb")
                p = e.bind(Select(ok, p, c(0), INDEX), "p")
                inb = ok if isinstance(inb, Const) else e.bind(Binary("bitwise_and", inb, ok, DType.bool))
            pos.append(p)
        xc = iadd(imul(g, cin_g), ci)
        xv = e.value(x, (nn, xc, *pos))
        wv = e.value(w, (co, ci, *kk))
        xv = xv if xv.dtype == acc_t else Cast(xv, acc_t)
        wv = wv if wv.dtype == acc_t else Cast(wv, acc_t)
        prod: Expr = Binary("mul", xv, wv, acc_t)
        if not isinstance(inb, Const):
            prod = Select(inb, prod, Const(0.0, acc_t), acc_t)
        e.emit(Assign(acc, Binary("add", acc, prod, acc_t)))

    _loop(e, cin_g * math.prod(ksp), red, "q")
    return acc


def conv_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Direct convolution: a block computes output rows (batch, out channel, leading spatial
    dims) and loops over the last spatial dim; each output sums over (in channels of its group,
    kernel offsets), reading the input through a bounds check that stands for zero padding."""
    cv = group.anchor
    w = cv.inputs[1]
    out_shape = cv.shape
    e, params, _ = setup_kernel(group, stored)
    acc_t = accum_dtype(cv.dtype)
    rows = math.prod(out_shape[:-1])
    blocks, per = _chunks(rows, target, out_shape[-1] * w.shape[1] * math.prod(w.shape[2:]))

    def row(r: Var) -> None:
        lead = delinearize(r, out_shape[:-1])

        def col(ow: Var) -> None:
            oidx = (*lead, ow)
            acc = conv_accumulate(e, cv, oidx)
            e.regs[id(cv)] = acc if acc_t == cv.dtype else e.bind(Cast(acc, cv.dtype))
            store_epilogue(e, group, oidx)
            e.regs.pop(id(cv))

        _loop(e, out_shape[-1], col, "ow")

    if may_be_nonzero(rows):
        _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts))


def cpu_conv_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """An implicit GEMM (``cpu_conv``) when the scheduler laid out the weights for it, the row-vectorised
    depthwise mapping for one channel per group, else direct."""
    if id(group.anchor.inputs[1]) in group.packed:
        return conv_gemm_kernel(group, stored, target, name)
    if is_depthwise(group.anchor):
        return depthwise_kernel(group, stored, target, name)
    return conv_kernel(group, stored, target, name)


MAPPINGS = {
    "elementwise": elementwise_kernel,
    "reduce": reduce_kernel,
    "matmul": matmul_kernel,
    "conv": cpu_conv_kernel,
}
