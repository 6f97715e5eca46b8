"""Inlining graph values into kernel IR: movement ops become index arithmetic.

:class:`ValueEmitter` answers "what is graph node ``n`` at multi-index ``idx``?" with kernel-IR
expressions, emitting three-address assignments into the current statement list. Stored values
are loads from their buffer; ``reshape/permute/expand/slice/pad/concat/gather`` only rewrite
the index (``pad``/``concat`` select between clamped loads, so no load is ever out of bounds);
elementwise ops become scalar math. Values already held in registers (a reduction's result for
the current row, a matmul accumulator) are looked up in ``regs``.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.ops import BINARY, UNARY
from sextant.graph.symbolic import Dim, SymDim
from sextant.kernel.ir import INDEX, Assign, Binary, Cast, Const, Expr, Load, Select, Stmt, Unary, Var
from sextant.kernel.sizes import dim_expr

Index = tuple[Expr, ...]
Operand = tuple[Node, Index]  # what a computation asks for: a graph node at an index


def c(v: Dim) -> Const:
    """An index constant; a symbolic size becomes arithmetic over the kernel's size arguments."""
    if isinstance(v, SymDim):
        return dim_expr(v)  # type: ignore[return-value]
    return Const(v, INDEX)


def may_be_nonzero(*dims: Dim) -> bool:
    """Whether a loop over these sizes can have any iteration (a symbolic size: yes, unless its range
    says it is always 0) — for skipping the loops of empty tensors."""
    return all(d.range()[1] > 0 if isinstance(d, SymDim) else d != 0 for d in dims)


def divisible(d: Dim, k: int) -> bool:
    """Whether ``d`` is a multiple of ``k`` at every size (a symbolic size usually is not known to be)."""
    r = d % k
    return isinstance(r, int) and r == 0


def iadd(a: Expr, b: Expr) -> Expr:
    if isinstance(b, Const) and b.value == 0:
        return a
    if isinstance(a, Const) and a.value == 0:
        return b
    if isinstance(a, Const) and isinstance(b, Const):
        return c(a.value + b.value)
    return Binary("add", a, b, INDEX)


def imul(a: Expr, k: Dim) -> Expr:
    if isinstance(k, SymDim):
        return c(0) if isinstance(a, Const) and a.value == 0 else Binary("mul", a, dim_expr(k), INDEX)
    if k == 0:
        return c(0)
    if k == 1:
        return a
    if isinstance(a, Const):
        return c(a.value * k)
    return Binary("mul", a, c(k), INDEX)


def idiv(a: Expr, k: Dim) -> Expr:
    if isinstance(k, SymDim):
        return Binary("div", a, dim_expr(k), INDEX)
    if k == 1:
        return a
    if isinstance(a, Const):
        return c(a.value // k)
    return Binary("div", a, c(k), INDEX)


def imod(a: Expr, k: Dim) -> Expr:
    if isinstance(k, SymDim):
        return Binary("fmod", a, dim_expr(k), INDEX)
    if k == 1:
        return c(0)
    if isinstance(a, Const):
        return c(a.value % k)
    return Binary("fmod", a, c(k), INDEX)


def imin(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and isinstance(b, Const):
        return c(min(a.value, b.value))
    return Binary("minimum", a, b, INDEX)


def strides(shape: Sequence[Dim]) -> list[Dim]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def linearize(idx: Index, shape: Sequence[Dim]) -> Expr:
    """Row-major offset of ``idx`` in ``shape`` (size-1 dims contribute nothing)."""
    if any(isinstance(d, SymDim) for d in shape):
        idx, shape = _merge_split(idx, shape)
    out: Expr = c(0)
    for i, d, s in zip(idx, shape, strides(shape)):
        if d != 1:
            out = iadd(out, imul(i, s))
    return out


def _merge_split(idx: Index, shape: Sequence[Dim]) -> tuple[Index, list[Dim]]:
    """Adjacent components that :func:`delinearize` split off one value, merged back: ``(q / n, q % n)``
    over ``[m, n]`` is ``q`` over ``[m*n]``. With constant sizes the kernel simplifier folds such pairs
    (its rules know constant divisors); over a symbolic ``n`` it cannot, and every element would pay a
    division by a run-time size."""
    comps = [(i, d) for i, d in zip(idx, shape) if d != 1]
    merged = True
    while merged:
        merged = False
        for k in range(len(comps) - 1):
            (a, d0), (b, d1) = comps[k], comps[k + 1]
            if not (isinstance(b, Binary) and b.op == "fmod" and b.b == dim_expr(d1)):
                continue
            q = b.a
            if a == Binary("div", q, dim_expr(d1), INDEX):
                whole: Expr | None = q
            elif isinstance(a, Binary) and a.op == "fmod" and a.a == Binary("div", q, dim_expr(d1), INDEX) \
                    and a.b == dim_expr(d0):
                whole = Binary("fmod", q, dim_expr(d0 * d1), INDEX)
            else:
                whole = None
            if whole is not None:
                comps[k:k + 2] = [(whole, d0 * d1)]
                merged = True
                break
    return tuple(i for i, _ in comps), [d for _, d in comps]


def delinearize(lin: Expr, shape: Sequence[Dim]) -> Index:
    """The multi-index of row-major offset ``lin`` (assumed < numel) in ``shape``."""
    if any(isinstance(d, SymDim) for d in shape):  # innermost first, in the form _merge_split undoes
        out: list[Expr] = []
        q, first = lin, next((k for k, d in enumerate(shape) if d != 1), len(shape))
        for k in reversed(range(len(shape))):
            d = shape[k]
            if d == 1:
                out.append(c(0))
            elif k == first:
                out.append(q)
            else:
                out.append(imod(q, d))
                q = idiv(q, d)
        return tuple(reversed(out))
    st = strides(shape)
    first = next((k for k, d in enumerate(shape) if d != 1), len(shape))
    out = []
    for k, (d, s) in enumerate(zip(shape, st)):
        if d == 1:
            out.append(c(0))
        elif k == first:
            out.append(idiv(lin, s))
        else:
            out.append(imod(idiv(lin, s), d))
    return tuple(out)


def reshape_index(idx: Index, out_shape: Sequence[Dim], in_shape: Sequence[Dim]) -> Index:
    """Map an index of the reshaped value to one of its input, group by group of matching
    products, so splitting or merging dims costs only the arithmetic those dims need."""
    result: list[Expr] = []
    i = j = 0
    n_out, n_in = len(out_shape), len(in_shape)
    while i < n_out or j < n_in:
        gi, gj = [i], [j]
        pi = out_shape[i] if i < n_out else 1
        pj = in_shape[j] if j < n_in else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if _smaller(pi, pj):
                gi.append(i)
                pi *= out_shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= in_shape[j]
                j += 1
        gi = [k for k in gi if k < n_out]
        gj = [k for k in gj if k < n_in]
        lin = linearize(tuple(idx[k] for k in gi), [out_shape[k] for k in gi])
        result += delinearize(lin, [in_shape[k] for k in gj])
    return tuple(result)


def _smaller(a: Dim, b: Dim) -> bool:
    """Whether a reshape group's product ``a`` must grow to meet ``b``: by divisibility when sizes are
    symbolic (``[batch*seq, d]`` from ``[batch, seq, d]``: ``batch`` divides ``batch*seq``)."""
    if isinstance(a, SymDim) or isinstance(b, SymDim):
        if _divides(a, b):
            return True
        if _divides(b, a):
            return False
    return a < b


def _divides(a: Dim, b: Dim) -> bool:
    """Whether ``b / a`` is a polynomial with integer coefficients other than 1."""
    import sympy

    ea = a.expr if isinstance(a, SymDim) else sympy.Integer(a)
    eb = b.expr if isinstance(b, SymDim) else sympy.Integer(b)
    if ea == 0:
        return False
    q = sympy.cancel(eb / ea)
    return q != 1 and sympy.fraction(q)[1] == 1 and q.is_polynomial() and all(
        coeff.is_Integer for coeff in sympy.Poly(q, *q.free_symbols).coeffs()) if q.free_symbols else \
        (q != 1 and q.is_Integer)


_REDUCE_COMBINE = {"sum": "add", "prod": "mul", "max": "maximum", "min": "minimum"}


def reduce_identity(fn: str, dtype: DType) -> int | float | bool:
    if fn == "sum":
        return False if dtype == DType.bool else 0
    if fn == "prod":
        return 1
    if dtype == DType.bool:
        return fn == "min"
    if dtype.is_float:
        return -math.inf if fn == "max" else math.inf
    bits = 8 * dtype.itemsize - 1
    return -(1 << bits) if fn == "max" else (1 << bits) - 1


def combine_op(fn: str) -> str:
    return _REDUCE_COMBINE[fn]


def accum_dtype(dtype: DType) -> DType:
    """Reductions and matmuls of half types accumulate in f32 (torch's CPU semantics)."""
    return DType.f32 if dtype in (DType.f16, DType.bf16) else dtype


def _plus_zero(e: Expr) -> bool:
    """``e`` is the float constant ``+0.0``."""
    return isinstance(e, Const) and e.dtype.is_float and e.value == 0 and math.copysign(1.0, e.value) > 0


class ValueEmitter:
    """Emit the computation of inlined graph values at given indices into kernel IR."""

    def __init__(self, buffers: dict[int, str], regs: dict[int, Expr] | None = None) -> None:
        self.buffers = buffers  # stored node -> kernel buffer name
        self.regs: dict[int, Expr] = regs if regs is not None else {}
        self._stmts: list[list[Stmt]] = [[]]
        self._memo: list[dict] = [{}]
        self._count = 0
        self._plus_zero: set[Var] = set()  # registers bound to ``x + 0.0`` (see _add)

    # -- statement lists and scopes ------------------------------------------------------
    @property
    def stmts(self) -> list[Stmt]:
        return self._stmts[-1]

    def emit(self, stmt: Stmt) -> None:
        self.stmts.append(stmt)

    @contextmanager
    def scope(self) -> Iterator[list[Stmt]]:
        """A nested statement list (a loop or branch body); values computed inside stay inside."""
        self._stmts.append([])
        self._memo.append(dict(self._memo[-1]))
        try:
            yield self._stmts[-1]
        finally:
            self._stmts.pop()
            self._memo.pop()

    def var(self, prefix: str, dtype: DType = INDEX) -> Var:
        self._count += 1
        return Var(f"{prefix}{self._count}", dtype)

    def bind(self, e: Expr, prefix: str = "v") -> Expr:
        """Assign a non-trivial expression to a fresh register (three-address form)."""
        if isinstance(e, (Const, Var)):
            return e
        v = self.var(prefix, e.dtype)
        self.emit(Assign(v, e))
        if isinstance(e, Binary) and e.op == "add" and (_plus_zero(e.a) or _plus_zero(e.b)):
            self._plus_zero.add(v)
        return v

    def _add(self, a: Expr, b: Expr, dt: DType) -> Expr:
        """``a + b``, where adding ``+0.0`` to a value that already is ``x + 0.0`` is that value:
        ``(x + 0.0) + 0.0 == x + 0.0`` bit for bit (only ``-0.0`` changes, and only once). A pooling
        window over ceil-mode padding adds thousands of padding zeros in a row: one add, not one each."""
        if _plus_zero(b) and a in self._plus_zero:
            return a
        if _plus_zero(a) and b in self._plus_zero:
            return b
        return Binary("add", a, b, dt)

    # -- values ------------------------------------------------------------------------------
    def value(self, n: Node, idx: Index) -> Expr:
        """``n`` at ``idx``, computed once per scope.

        Iterative, so a chain of thousands of inlined ops does not hit Python's recursion limit:
        :meth:`_compute` is a generator that yields each ``(operand, index)`` it needs and is
        sent the operand's value, and this loop keeps the pending computations on a stack. The
        statements come out in the order the recursive evaluation would emit them."""
        memo = self._memo[-1]
        key = (id(n), idx)
        hit = memo.get(key)  # one lookup, not two: hashing the index is most of a hit's cost
        if hit is not None:
            return hit
        stack: list[tuple[tuple, Generator[Operand, Expr, Expr]]] = [(key, self._compute(n, idx))]
        sent: Expr | None = None
        while stack:
            key, gen = stack[-1]
            try:
                operand, at = gen.send(sent)  # type: ignore[arg-type]
            except StopIteration as done:
                stack.pop()
                e = done.value
                if not isinstance(e, (Const, Var)):
                    e = self.bind(e)
                memo[key] = sent = e
                continue
            sub = (id(operand), at)
            sent = memo.get(sub)
            if sent is None:
                stack.append((sub, self._compute(operand, at)))
        assert sent is not None
        return sent

    def _compute(self, n: Node, idx: Index) -> Generator[Operand, Expr, Expr]:
        if id(n) in self.regs:
            return self.regs[id(n)]
        if id(n) in self.buffers:
            return Load(self.buffers[id(n)], linearize(idx, n.shape), n.dtype)
        op, dt = n.op, n.dtype
        if op == "full":
            value = n.attr("value")
            if isinstance(value, SymDim):  # a size used as a value (``seq`` as a count)
                return dim_expr(value) if dt == INDEX else Cast(dim_expr(value), dt)
            return Const(value, dt)
        if op == "iota":
            return Cast(idx[n.attr("axis")], dt) if dt != INDEX else idx[n.attr("axis")]
        if op in UNARY:
            return Unary(op, (yield n.inputs[0], idx), dt)
        if op == "copy":  # the value itself (only its buffer is its own: see in_place_updates)
            return (yield n.inputs[0], idx)
        if op in BINARY:
            a = yield n.inputs[0], idx
            b = yield n.inputs[1], idx
            return self._add(a, b, dt) if op == "add" and dt.is_float else Binary(op, a, b, dt)
        if op == "where":
            operands = []
            for i in n.inputs:
                operands.append((yield i, idx))
            return Select(*operands, dt)
        if op == "cast":
            return Cast((yield n.inputs[0], idx), dt)
        src = n.inputs[0] if n.inputs else None
        if op == "reshape":
            return (yield src, reshape_index(idx, n.shape, src.shape))
        if op == "permute":
            out: list[Expr] = [c(0)] * len(idx)
            for i, p in enumerate(n.attr("perm")):
                out[p] = idx[i]
            return (yield src, tuple(out))
        if op == "expand":
            return (yield src, tuple(c(0) if s == 1 and d != 1 else i for i, s, d in zip(idx, src.shape, n.shape)))
        if op == "slice":  # along a dim of size 1 the index is 0: the start itself, a constant
            return (yield src, tuple(iadd(c(st), imul(i, sp)) if sz != 1 else c(st)
                                     for i, st, sp, sz in zip(idx, n.attr("start"), n.attr("step"),
                                                              n.attr("size"))))
        if op == "pad":
            return (yield from self._pad(n, idx))
        if op == "concat":
            return (yield from self._concat(n, idx))
        if op == "gather":
            return (yield from self._gather(n, idx))
        raise NotImplementedError(f"{op} cannot be inlined into a kernel (it must be stored first)")

    def in_range(self, i: Expr, lo: int, hi: int) -> Expr:
        """``lo <= i < hi`` (a side a constant ``i`` satisfies is left out)."""
        conds = []
        if not (isinstance(i, Const) and i.value >= lo):
            conds.append(Binary("ge", i, c(lo), DType.bool))
        if not (isinstance(i, Const) and i.value < hi):
            conds.append(Binary("lt", i, c(hi), DType.bool))
        out: Expr = Const(True, DType.bool)
        for cond in conds:
            out = cond if isinstance(out, Const) else Binary("bitwise_and", out, cond, DType.bool)
        return out

    def _pad(self, n: Node, idx: Index) -> Generator[Operand, Expr, Expr]:
        src = n.inputs[0]
        shifted = [iadd(i, c(-lo)) for i, lo in zip(idx, n.attr("low"))]
        if any(isinstance(i, Const) and isinstance(d, int) and not 0 <= i.value < d
               for i, d in zip(shifted, src.shape)):
            return Const(n.attr("value"), n.dtype)  # a constant index in the padding: no load
        conds = [self.in_range(i, 0, d) for i, d in zip(shifted, src.shape)]
        inb: Expr = Const(True, DType.bool)
        inner = []
        for i, cond in zip(shifted, conds):
            if not isinstance(cond, Const):
                cond = self.bind(cond, "inb")
                i = self.bind(Select(cond, i, c(0), INDEX), "i")
                inb = cond if isinstance(inb, Const) else self.bind(Binary("bitwise_and", inb, cond, DType.bool))
            inner.append(i)
        v = yield src, tuple(inner)
        if isinstance(inb, Const):
            return v
        return Select(inb, v, Const(n.attr("value"), n.dtype), n.dtype)

    def _concat(self, n: Node, idx: Index) -> Generator[Operand, Expr, Expr]:
        axis = n.attr("axis")
        offsets, off = [], 0
        for part in n.inputs:
            offsets.append(off)
            off += part.shape[axis]
        i = idx[axis]
        result: Expr | None = None
        for part, start in reversed(list(zip(n.inputs, offsets))):
            local = iadd(i, c(-start))
            if result is None:  # the last part: everything past the earlier parts
                clamped = self.bind(Binary("maximum", local, c(0), INDEX), "i")
                result = yield part, idx[:axis] + (clamped,) + idx[axis + 1:]
                continue
            inside = self.bind(Binary("lt", i, c(start + part.shape[axis]), DType.bool), "inb")
            clamped = self.bind(Select(inside, Binary("maximum", local, c(0), INDEX), c(0), INDEX), "i")
            v = yield part, idx[:axis] + (clamped,) + idx[axis + 1:]
            result = self.bind(Select(inside, v, result, n.dtype))
        assert result is not None
        return result

    def _gather(self, n: Node, idx: Index) -> Generator[Operand, Expr, Expr]:
        src, index = n.inputs
        axis = n.attr("axis")
        raw = yield index, idx
        k = raw if index.dtype == INDEX else Cast(raw, INDEX)
        # out-of-range indices are clamped: a kernel cannot raise, and must not read out of bounds
        k = self.bind(Binary("minimum", Binary("maximum", k, c(0), INDEX), c(src.shape[axis] - 1), INDEX), "i")
        return (yield src, idx[:axis] + (k,) + idx[axis + 1:])
