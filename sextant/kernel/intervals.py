"""Interval arithmetic on integer (and bool) values: the rules range analysis applies per node.

An interval ``(lo, hi)`` holds every value a node can take. An ``add``/``sub``/``mul``/``shl``/
``neg`` gets one only when the exact mathematical result fits the type (``fit``), so a bounded
node provably did not wrap: the simplifier relies on that to move terms between divisions and
sums. Bool intervals lie within ``[0, 1]``; ``(1, 1)`` means always true.
"""

from __future__ import annotations

from collections.abc import Callable

from sextant.graph.dtypes import DType

Interval = tuple[int, int]
INTLIKE = (DType.i32, DType.i64, DType.bool)  # the types facts are about

CMP_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
CMP_SWAP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
CMP: dict[str, Callable[[int, int], bool]] = {
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
}


def _type_range(dtype: DType) -> Interval:
    if dtype == DType.bool:
        return (0, 1)
    bits = 8 * dtype.itemsize
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)


# per type, computed once: range analysis asks for these on every node it bounds
_RANGE = {dt: _type_range(dt) for dt in DType}
_INTLIKE_SET = frozenset(INTLIKE)


def int_range(dtype: DType) -> Interval:
    """All values of an integer or bool type."""
    return _RANGE[dtype]


def is_intlike(dtype: DType) -> bool:
    return dtype in _INTLIKE_SET


def wrap(v: int, dtype: DType) -> int:
    """``v`` reduced to ``dtype`` the way two's complement hardware does."""
    if dtype == DType.bool:
        return int(bool(v))
    lo, hi = _RANGE[dtype]
    if type(v) is int and lo <= v <= hi:  # the common case: nothing to wrap
        return v
    bits = 8 * dtype.itemsize
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def tdiv(a: int, b: int) -> int:
    """Integer division rounding toward zero (C, PTX ``div.s32``, the graph's int ``div``)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def tmod(a: int, b: int) -> int:
    """C-style remainder: the sign follows the dividend (graph ``fmod`` on ints)."""
    return a - tdiv(a, b) * b


def hull(a: Interval | None, b: Interval | None) -> Interval | None:
    if a is None or b is None:
        return None
    return (min(a[0], b[0]), max(a[1], b[1]))


def intersect(a: Interval | None, b: Interval | None) -> Interval | None:
    """The tighter of two sound intervals (if they are disjoint the code is unreachable; either
    is then correct, ``b`` is returned)."""
    if a is None:
        return b
    if b is None:
        return a
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo <= hi else b


def fit(lo: int, hi: int, dtype: DType) -> Interval | None:
    dlo, dhi = int_range(dtype)
    return (lo, hi) if dlo <= lo and hi <= dhi else None


def corners(f: Callable[[int, int], int], a: Interval, b: Interval) -> Interval:
    vals = [f(x, y) for x in a for y in b]
    return (min(vals), max(vals))


# -- one node's interval from its operands' -------------------------------------------------
def cmp_bounds(op: str, a: Interval, b: Interval) -> Interval:
    def always(op: str) -> bool:
        if op == "lt":
            return a[1] < b[0]
        if op == "le":
            return a[1] <= b[0]
        if op == "gt":
            return a[0] > b[1]
        if op == "ge":
            return a[0] >= b[1]
        if op == "eq":
            return a[0] == a[1] == b[0] == b[1]
        return a[1] < b[0] or b[1] < a[0]  # ne

    if always(op):
        return (1, 1)
    if always(CMP_NEGATE[op]):
        return (0, 0)
    return (0, 1)


def unary_bounds(op: str, a: Interval, dt: DType) -> Interval | None:
    lo, hi = a
    if op == "neg":
        return fit(-hi, -lo, dt)
    if op == "abs":
        if lo >= 0:
            return a
        if hi <= 0:
            return fit(-hi, -lo, dt)
        return fit(0, max(-lo, hi), dt)
    if op == "sign":
        return (-1 if lo < 0 else 0 if lo == 0 else 1, 1 if hi > 0 else 0 if hi == 0 else -1)
    if op == "bitwise_not":
        return (1 - hi, 1 - lo) if dt == DType.bool else (-hi - 1, -lo - 1)
    if op == "logical_not":
        return (1 - hi, 1 - lo)
    if op in ("floor", "ceil", "round", "trunc"):
        return a
    return None


def binary_bounds(op: str, a: Interval, b: Interval, dt: DType) -> Interval | None:
    bits = 8 * dt.itemsize
    if op == "add":
        return fit(a[0] + b[0], a[1] + b[1], dt)
    if op == "sub":
        return fit(a[0] - b[1], a[1] - b[0], dt)
    if op == "mul":
        return fit(*corners(lambda x, y: x * y, a, b), dt)
    if op == "maximum":
        return (max(a[0], b[0]), max(a[1], b[1]))
    if op == "minimum":
        return (min(a[0], b[0]), min(a[1], b[1]))
    if dt == DType.bool:
        if op == "bitwise_and":
            return (a[0] & b[0], a[1] & b[1])
        if op == "bitwise_or":
            return (a[0] | b[0], a[1] | b[1])
        if op == "bitwise_xor" and a[0] == a[1] and b[0] == b[1]:
            return (a[0] ^ b[0], a[0] ^ b[0])
        return (0, 1)
    zero_in_b = b[0] <= 0 <= b[1]
    if op == "div" and not zero_in_b:
        return fit(*corners(tdiv, a, b), dt)
    if op == "floordiv" and not zero_in_b:
        return fit(*corners(lambda x, y: x // y, a, b), dt)
    if op == "fmod" and not zero_in_b:
        m = max(abs(b[0]), abs(b[1])) - 1  # |result| <= |divisor| - 1, sign of the dividend
        if a[0] >= 0 and a[1] < min(abs(b[0]), abs(b[1])):
            return a
        return (max(a[0], -m) if a[0] < 0 else 0, min(a[1], m) if a[1] > 0 else 0)
    if op == "remainder" and not zero_in_b:
        if b[0] > 0:
            return a if a[0] >= 0 and a[1] < b[0] else (0, b[1] - 1)
        return (b[0] + 1, 0)
    if op in ("shl", "shr") and b[0] >= 0 and b[1] < bits:
        if op == "shl":
            return fit(*corners(lambda x, s: x << s, a, b), dt)
        return corners(lambda x, s: x >> s, a, b)
    if op == "bitwise_and":
        his = [x[1] for x in (a, b) if x[0] >= 0]
        return (0, min(his)) if his else None
    if op in ("bitwise_or", "bitwise_xor") and a[0] >= 0 and b[0] >= 0:
        top = (1 << max(a[1], b[1]).bit_length()) - 1
        return (max(a[0], b[0]) if op == "bitwise_or" else 0, top)
    return None
