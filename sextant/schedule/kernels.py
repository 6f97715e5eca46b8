"""Lowering a fused group to a kernel-IR kernel, with the mapping chosen for the target.

One function per group kind; each documents its mapping. On the CPU (``target.warp == 1``)
a block is one thread and blocks are spread over the cores: a block walks a contiguous chunk
of rows with plain loops, so LLVM can vectorise the innermost one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.kernel.ir import (
    INDEX,
    Assign,
    Binary,
    Buffer,
    Cast,
    Const,
    Expr,
    For,
    Kernel,
    Load,
    Select,
    Special,
    Store,
    Var,
)
from sextant.schedule.indexing import (
    Index,
    ValueEmitter,
    accum_dtype,
    c,
    combine_op,
    delinearize,
    iadd,
    imin,
    imul,
    linearize,
    reduce_identity,
)
from sextant.schedule.partition import Group, inlinable, is_buffer
from sextant.schedule.target import TargetDesc

BID = Special("bid", "x")
MATMUL_TILE_N = 64  # columns of C per accumulator panel (a local array that stays in L1)
MATMUL_TILE_M = 4  # rows of C per block


def external_buffers(group: Group, stored: set[int]) -> list[Node]:
    """Values the kernel reads from memory: graph inputs, params, and other kernels' outputs."""
    members = {id(m) for m in group.members}
    found: list[Node] = []
    seen: set[int] = set()

    def visit(n: Node) -> None:
        if id(n) in seen:
            return
        seen.add(id(n))
        if id(n) in members:
            for i in n.inputs:
                visit(i)
        elif is_buffer(n) or id(n) in stored or not inlinable(n):
            found.append(n)
        else:
            for i in n.inputs:
                visit(i)

    for m in group.members:
        visit(m)
    return found


def _setup(group: Group, stored: set[int]) -> tuple[ValueEmitter, list[Buffer], list[Node]]:
    ins = external_buffers(group, stored)
    names = {id(n): f"in{k}" for k, n in enumerate(ins)}
    params = [Buffer(f"in{k}", n.dtype, n.type.numel, "global", "in") for k, n in enumerate(ins)]
    params += [Buffer(f"out{k}", o.dtype, o.type.numel, "global", "out") for k, o in enumerate(group.outputs)]
    return ValueEmitter(names), params, ins


def _chunks(rows: int, target: TargetDesc, work_per_row: int) -> tuple[int, int]:
    """(blocks, rows per block): enough blocks to feed every core a few times, none too small."""
    min_rows = max(1, 4096 // max(work_per_row, 1))  # ~4k elements of work per block at least
    blocks = max(1, min(rows, 4 * target.cores, math.ceil(rows / min_rows)))
    per = math.ceil(rows / blocks)
    return math.ceil(rows / per), per


def _row_loop(e: ValueEmitter, rows: int, per: int, body: Callable[[Var], None]) -> None:
    """``for r in [bid*per, min(bid*per+per, rows))``: body(r)."""
    r = e.var("r")
    start = imul(BID, per)
    with e.scope() as stmts:
        body(r)
    stop = imin(iadd(start, c(per)), c(rows)) if rows % per else iadd(start, c(per))
    e.emit(For(r, start, stop, 1, tuple(stmts)))


def _loop(e: ValueEmitter, n: int, body: Callable[[Var], None], prefix: str = "j", *,
          start: Expr | None = None, stop: Expr | None = None) -> None:
    v = e.var(prefix)
    with e.scope() as stmts:
        body(v)
    e.emit(For(v, start if start is not None else c(0), stop if stop is not None else c(n), 1, tuple(stmts)))


# -- elementwise -------------------------------------------------------------------------------
def elementwise_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Each block takes a chunk of the output's rows (all dims but the last); the last dim is
    the innermost loop, contiguous in the output."""
    out = group.outputs[0]
    e, params, _ = _setup(group, stored)
    shape = out.shape or (1,)
    inner = shape[-1]
    rows = math.prod(shape[:-1])
    blocks, per = _chunks(rows, target, inner)

    def row(r: Var) -> None:
        outer = delinearize(r, shape[:-1])

        def elem(j: Var) -> None:
            idx = (outer + (j,))[-len(out.shape):] if out.shape else ()
            for k, o in enumerate(group.outputs):
                e.emit(Store(f"out{k}", linearize(idx, o.shape), e.value(o, idx)))

        _loop(e, inner, elem)

    if out.type.numel:
        _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts))


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
    e, params, _ = _setup(group, stored)
    blocks, per = _chunks(rows, target, n_red * len(group.members))
    row_shape = tuple(1 if d in axes else s for d, s in enumerate(shape))

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

            def step(q: Var, m: Node = m, acc: Var = acc, fn: str = fn, acc_t: DType = acc_t) -> None:
                v = e.value(m.inputs[0], full_index(row_idx, red_index(q)))
                v = v if v.dtype == acc_t else Cast(v, acc_t)
                e.emit(Assign(acc, Binary(combine_op(fn), acc, v, acc_t)))

            _loop(e, n_red, step, "q")
            result = acc if acc_t == m.dtype else e.bind(Cast(acc, m.dtype))
            e.regs[id(m)] = result
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

    if rows:
        _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts))


# -- matmul ------------------------------------------------------------------------------------
def _store_epilogue(e: ValueEmitter, group: Group, lin: Expr) -> None:
    """Store every output of a contraction group for the element at ``lin`` (row-major offset in
    the anchor's shape; epilogue members are pointwise, reshapes included)."""
    for k, o in enumerate(group.outputs):
        idx = delinearize(lin, o.shape)
        e.emit(Store(f"out{k}", linearize(idx, o.shape), e.value(o, idx)))


def matmul_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """C[b, i, j] = Σ_k A[b, i, k]·B[b, k, j] with the epilogue fused into the store.

    A block takes ``MATMUL_TILE_M`` rows of one batch entry. For each panel of
    ``MATMUL_TILE_N`` columns an accumulator panel (a local array) is zeroed, then for each k the
    row's A value is broadcast against B's row k (contiguous in j when B is row-major, so the
    j loop vectorises), then the epilogue runs per element and stores."""
    mm = group.anchor
    a, b = mm.inputs
    *batch, m, k = a.shape
    n = b.shape[-1]
    nb = math.prod(batch)
    e, params, _ = _setup(group, stored)
    acc_t = accum_dtype(mm.dtype)
    tiles_m = math.ceil(m / MATMUL_TILE_M)
    tn = min(MATMUL_TILE_N, n)
    panel = Buffer("acc", acc_t, tn, "local")

    def body(t: Var) -> None:
        bidx = delinearize(e.bind(Binary("div", t, c(tiles_m), INDEX), "b"), batch) if batch else ()
        mt = e.bind(Binary("fmod", t, c(tiles_m), INDEX), "mt") if batch else t
        i0 = imul(mt, MATMUL_TILE_M)

        def row(i: Var) -> None:
            def panel_loop(j0: Var) -> None:
                width = e.bind(imin(c(tn), Binary("sub", c(n), j0, INDEX)), "w")
                _loop(e, tn, lambda j: e.emit(Store("acc", j, Const(0.0 if acc_t.is_float else 0, acc_t))),
                      stop=width)

                def kstep(kk: Var) -> None:
                    av = e.value(a, (*bidx, i, kk))
                    av = e.bind(av if av.dtype == acc_t else Cast(av, acc_t))

                    def fma(j: Var) -> None:
                        bv = e.value(b, (*bidx, kk, iadd(j0, j)))
                        bv = bv if bv.dtype == acc_t else Cast(bv, acc_t)
                        e.emit(Store("acc", j, Binary("add", Load("acc", j, acc_t),
                                                      Binary("mul", av, bv, acc_t), acc_t)))

                    _loop(e, tn, fma, stop=width)

                _loop(e, k, kstep, "k")

                def epilogue(j: Var) -> None:
                    val = Load("acc", j, acc_t)
                    e.regs[id(mm)] = e.bind(val if acc_t == mm.dtype else Cast(val, mm.dtype), "c")
                    col = iadd(j0, j)
                    lin = iadd(linearize((*bidx, i, c(0)), mm.shape), col)
                    _store_epilogue(e, group, lin)
                    e.regs.pop(id(mm))

                _loop(e, tn, epilogue, stop=width)

            jv = e.var("j0")
            with e.scope() as stmts:
                panel_loop(jv)
            e.emit(For(jv, c(0), c(n), tn, tuple(stmts)))

        stop = imin(iadd(i0, c(MATMUL_TILE_M)), c(m))
        _loop(e, m, row, "i", start=i0, stop=stop)

    blocks = nb * tiles_m
    if mm.type.numel:
        t = BID
        body(t)  # type: ignore[arg-type]
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), local=(panel,))


# -- convolution ----------------------------------------------------------------------------------
def conv_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Direct convolution: a block computes output rows (batch, out channel, leading spatial
    dims) and loops over the last spatial dim; each output sums over (in channels of its group,
    kernel offsets), reading the input through a bounds check that stands for zero padding."""
    cv = group.anchor
    x, w = cv.inputs
    stride, padding, dilation, groups = (cv.attr(k) for k in ("stride", "padding", "dilation", "groups"))
    out_shape = cv.shape
    nsp = len(out_shape) - 2
    cin_g = w.shape[1]
    cout_g = w.shape[0] // groups
    e, params, _ = _setup(group, stored)
    acc_t = accum_dtype(cv.dtype)
    rows = math.prod(out_shape[:-1])
    blocks, per = _chunks(rows, target, out_shape[-1] * cin_g * math.prod(w.shape[2:]))
    ksp = w.shape[2:]

    def row(r: Var) -> None:
        lead = delinearize(r, out_shape[:-1])

        def col(ow: Var) -> None:
            oidx = (*lead, ow)
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
            e.regs[id(cv)] = acc if acc_t == cv.dtype else e.bind(Cast(acc, cv.dtype))
            _store_epilogue(e, group, linearize(oidx, out_shape))
            e.regs.pop(id(cv))

        _loop(e, out_shape[-1], col, "ow")

    if rows:
        _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts))


MAPPINGS = {
    "elementwise": elementwise_kernel,
    "reduce": reduce_kernel,
    "matmul": matmul_kernel,
    "conv": conv_kernel,
}
