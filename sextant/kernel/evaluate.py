"""Concrete evaluation of kernel IR expressions for one thread, with the graph IR's op semantics.

The counterpart of range analysis: tests check intervals against it, and the verifier's
witness search runs threads with it. Integers wrap like the hardware; floats are computed by
torch on scalars of the exact dtype, with the same functions as the reference executor
(:mod:`sextant.graph.torch_ops`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from sextant.graph.dtypes import DType
from sextant.graph.torch_ops import BINARY, UNARY
from sextant.kernel.intervals import CMP, int_range, is_intlike, tdiv, tmod, wrap
from sextant.kernel.ir import Binary, Cast, Const, Expr, Load, Select, Special, Unary, Var


class EvalError(Exception):
    """An expression has no defined value (``Undefined``) or depends on something not given
    (``Unknown``)."""


class Undefined(EvalError):
    """Division by zero, ``INT_MIN / -1``, a shift by ≥ the bit width, a float→int cast out of
    range: the code generators give such operations no defined result."""


class Unknown(EvalError):
    """A register, coordinate or memory value the caller did not provide."""


Value = int | float | bool


def _float(v: Value, dtype: DType) -> torch.Tensor:
    return torch.tensor(v, dtype=dtype.torch)


def int_binary(op: str, a: int, b: int, dt: DType) -> Value:
    """``a op b`` on integers or bools of type ``dt``, as the hardware computes it."""
    bits = 8 * dt.itemsize
    lo, _ = int_range(dt)
    if op in CMP:
        return CMP[op](a, b)
    if op in ("div", "floordiv", "fmod", "remainder"):
        if b == 0 or (a == lo and b == -1 and dt != DType.bool):
            raise Undefined(f"{op}({a}, {b})")
        r = {"div": tdiv, "floordiv": lambda x, y: x // y, "fmod": tmod, "remainder": lambda x, y: x % y}[op](a, b)
    elif op in ("shl", "shr"):
        if not 0 <= b < bits:
            raise Undefined(f"{op} by {b}")
        r = a << b if op == "shl" else a >> b
    elif op == "pow":
        if b < 0:
            raise Undefined(f"integer pow with exponent {b}")
        r = pow(a, b, 1 << 64)
    else:
        r = {"add": a + b, "sub": a - b, "mul": a * b, "maximum": max(a, b), "minimum": min(a, b),
             "bitwise_and": a & b, "bitwise_or": a | b, "bitwise_xor": a ^ b}[op]
    return bool(r) if dt == DType.bool else wrap(r, dt)


def int_unary(op: str, a: int, dt: DType) -> Value:
    """``op(a)`` on an integer or bool of type ``dt``."""
    if op in ("isnan", "isinf"):
        return False
    if op == "logical_not":
        return not a
    if dt == DType.bool:
        if op == "bitwise_not":
            return not a
        raise Undefined(f"{op} on bool")
    r = {"neg": -a, "abs": abs(a), "sign": (a > 0) - (a < 0), "bitwise_not": ~a,
         "floor": a, "ceil": a, "round": a, "trunc": a}.get(op)
    if r is None:
        raise Undefined(f"{op} on an integer")
    return wrap(r, dt)


def cast_value(v: Value, src: DType, dst: DType) -> Value:
    """``v`` of type ``src`` converted to ``dst`` (float to int truncates, like torch)."""
    if dst == DType.bool:
        return bool(v)  # NaN is non-zero: true, as in torch
    if dst.is_int:
        if src.is_float:
            lo, hi = int_range(dst)
            if math.isnan(v) or math.isinf(v) or not lo <= math.trunc(v) <= hi:
                raise Undefined(f"cast of {v} to {dst.value}")
            return math.trunc(v)
        return wrap(int(v), dst)
    holder = src if src.is_float else DType.bool if src == DType.bool else DType.i64
    return _float(v, holder).to(dst.torch).item()


Load_ = Callable[[str, int], Value]
Compiled = Callable[[Mapping[str, Value], Load_ | None], Value]


def eval_expr(expr: Expr, values: Mapping[str, Value] | None = None,
              load: Callable[[str, int], Value] | None = None) -> Value:
    """The value of ``expr`` for one thread, with the graph IR's op semantics.

    ``values`` maps register names and coordinates (``"tid.x"``, ``"bdim.y"``) to values;
    ``load(buffer, index)`` reads memory. Integers wrap like the hardware; floats are computed
    by torch on scalars of the exact dtype (like the reference executor). Raises
    :class:`Undefined` or :class:`Unknown` (see there)."""
    return compile_expr(expr)(values or {}, load)


def compile_expr(expr: Expr) -> Compiled:
    """``expr`` as a closure ``f(values, load)`` computing what :func:`eval_expr` does, in the same
    order (so the same error is raised first). The verifier's witness search evaluates the same
    few expressions for thousands of threads and loop iterations: dispatching on every node's
    type each time was most of its cost."""
    if isinstance(expr, Binary):
        return _compile_binary(expr)
    if isinstance(expr, Var | Special):
        key = expr.name if isinstance(expr, Var) else f"{expr.kind}.{expr.axis}"

        def var(values: Mapping[str, Value], load: Load_ | None) -> Value:
            if key not in values:
                raise Unknown(key)
            return values[key]

        return var
    if isinstance(expr, Const):
        dt = expr.dtype
        value: Value = bool(expr.value) if dt == DType.bool else wrap(int(expr.value), dt) if dt.is_int \
            else _float(expr.value, dt).item()
        return lambda values, load: value
    if isinstance(expr, Load):
        index, buf = compile_expr(expr.index), expr.buffer

        def load_(values: Mapping[str, Value], load: Load_ | None) -> Value:
            i = index(values, load)
            if load is None:
                raise Unknown(f"{buf}[{i}]")
            return load(buf, i)

        return load_
    if isinstance(expr, Select):
        fc, fa, fb = compile_expr(expr.cond), compile_expr(expr.a), compile_expr(expr.b)

        def select(values: Mapping[str, Value], load: Load_ | None) -> Value:
            c, a, b = fc(values, load), fa(values, load), fb(values, load)  # both sides, as on the GPU
            return a if c else b

        return select
    if isinstance(expr, Cast):
        fa, src, dst = compile_expr(expr.a), expr.a.dtype, expr.dtype
        return lambda values, load: cast_value(fa(values, load), src, dst)
    if isinstance(expr, Unary):
        fa, op, src = compile_expr(expr.a), expr.op, expr.a.dtype
        if is_intlike(src):
            return lambda values, load: int_unary(op, int(fa(values, load)), src)
        fn = UNARY[op]
        return lambda values, load: fn(_float(fa(values, load), src)).item()
    raise TypeError(f"not an expression: {expr!r}")


def _compile_binary(e: Binary) -> Compiled:
    fa, fb, dt = compile_expr(e.a), compile_expr(e.b), e.a.dtype
    if not is_intlike(dt):
        da, db = e.a.dtype, e.b.dtype
        fn = BINARY[e.op] if e.op != "div" else lambda x, y: torch.div(x, y)

        def floats(values: Mapping[str, Value], load: Load_ | None) -> Value:
            a, b = fa(values, load), fb(values, load)
            return fn(_float(a, da), _float(b, db)).item()

        return floats
    op = _int_op(e.op, dt)

    def ints(values: Mapping[str, Value], load: Load_ | None) -> Value:
        a, b = fa(values, load), fb(values, load)
        return op(int(a), int(b))

    return ints


_WRAPPING = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
             "maximum": max, "minimum": min, "bitwise_and": lambda a, b: a & b,
             "bitwise_or": lambda a, b: a | b, "bitwise_xor": lambda a, b: a ^ b}


def _int_op(op: str, dt: DType) -> Callable[[int, int], Value]:
    """:func:`int_binary` for one op and type, with the common index ops inlined."""
    if op in CMP:
        return CMP[op]
    if dt != DType.bool and op in _WRAPPING:
        f, (lo, hi) = _WRAPPING[op], int_range(dt)

        def wrapping(a: int, b: int) -> Value:
            r = f(a, b)
            return r if lo <= r <= hi else wrap(r, dt)

        return wrapping
    if dt != DType.bool and op in ("shl", "shr"):
        bits = 8 * dt.itemsize

        def shift(a: int, b: int) -> Value:
            if not 0 <= b < bits:
                raise Undefined(f"{op} by {b}")
            return wrap(a << b if op == "shl" else a >> b, dt)

        return shift
    return lambda a, b: int_binary(op, a, b, dt)
