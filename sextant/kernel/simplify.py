"""Exact simplification of kernel IR: constant folding, index algebra, bounds-check elision.

Every rewrite preserves what the kernel computes bit for bit, including integer wrap-around:

* **Ring identities** (``x + 0``, ``x * 1``, ``x * 0``, ``(x + a) + b``, ``(x * a) * b``,
  ``x - x``) hold for wrapping integers unconditionally, so they need no range facts.
* **Division identities** do not survive overflow, so they use :mod:`sextant.kernel.ranges`:
  writing the dividend as ``M + R`` where every term of ``M`` is a multiple of ``k``,
  ``(M + R) / k == M/k + R/k`` and ``(M + R) % k == R % k`` when neither part nor their sum
  overflows and ``M`` and ``R`` have the same sign (truncating division); ``x / k == 0`` and
  ``x % k == x`` when ``|x| < k``. ``x >> s`` and ``x & (2^s - 1)`` have the same rules without
  the sign condition (floor semantics; the mask needs no range at all).
* **Strength reduction**: ``x / 2^s`` → ``x >> s`` and ``x % 2^s`` → ``x & (2^s - 1)`` only
  when ``x >= 0`` is proved (they differ on negative numbers).
* **Facts**: an integer/bool expression whose interval is one value becomes a constant, so a
  comparison decided by the ranges folds, a ``Select`` on it picks its side, and an ``If``
  that is always true (the ``i < n`` guard of a launch that exactly covers ``n``) is replaced
  by its body.
* **Floats** are only touched where the result is bit-identical: a ``Select`` with a known
  condition, a cast to the same type, ``-(-x)``. ``x + 0.0`` is *not* ``x`` (``-0.0``), and
  folding would have to reproduce f16/bf16 rounding and the GPU's flush-to-zero modes.

``Select`` evaluates both operands on the GPU, so its operands are never simplified under its
condition (that could turn a clamped, safe load into an out-of-bounds one).
"""

from __future__ import annotations

import dataclasses
import math

from sextant.graph.dtypes import DType
from sextant.kernel.evaluate import Undefined, cast_value, int_binary, int_unary
from sextant.kernel.facts import Env, Facts, assume, bounds
from sextant.kernel.flow import Ranges, loop_range
from sextant.kernel.intervals import CMP_NEGATE, CMP_SWAP, Interval, int_range, is_intlike, wrap
from sextant.kernel.ir import (
    ASYNC_COPY,
    CPU_MATRIX,
    HOPPER,
    Assign,
    AtomicAdd,
    Barrier,
    Binary,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Load,
    Mma,
    Select,
    Stmt,
    Store,
    Unary,
    WarpReduce,
    map_operands,
)
from sextant.work import WorkCounter

_COMMUTATIVE = frozenset({"add", "mul", "maximum", "minimum", "bitwise_and", "bitwise_or", "bitwise_xor",
                          "eq", "ne"})
_CMPS = frozenset(CMP_NEGATE)
Terms = list[tuple[int, Expr]]


def _k(e: Expr) -> int | None:
    """The value of an integer constant (bools count as 0/1)."""
    if isinstance(e, Const) and is_intlike(e.dtype) and isinstance(e.value, bool | int):
        return int(e.value)
    return None


def _const(v: int | bool, dt: DType) -> Const:
    return Const(bool(v), dt) if dt == DType.bool else Const(wrap(int(v), dt), dt)


def _log2(k: int) -> int | None:
    return k.bit_length() - 1 if k > 0 and k & (k - 1) == 0 else None


class _Simplifier:
    def __init__(self, env: Env) -> None:
        self.env = env
        self.memo: dict[Expr, Expr] = {}

    def expr(self, e: Expr) -> Expr:
        out = self.memo.get(e)
        if out is None:
            out = self.memo[e] = self._expr(e)
        return out

    def _expr(self, e: Expr) -> Expr:
        if isinstance(e, Load):
            out: Expr = Load(e.buffer, self.expr(e.index), e.dtype)
        elif isinstance(e, Cast):
            out = self.cast(self.expr(e.a), e.dtype)
        elif isinstance(e, Unary):
            out = self.unary(e.op, self.expr(e.a), e.dtype)
        elif isinstance(e, Binary):
            out = self.binary(e.op, self.expr(e.a), self.expr(e.b), e.dtype)
        elif isinstance(e, Select):
            out = self.select(self.expr(e.cond), self.expr(e.a), self.expr(e.b), e.dtype)
        else:
            out = e
        return self.known(out)

    def known(self, e: Expr) -> Expr:
        """A constant if the facts pin ``e`` to one value."""
        if isinstance(e, Const) or not is_intlike(e.dtype):
            return e
        b = bounds(e, self.env)
        return _const(b[0], e.dtype) if b is not None and b[0] == b[1] else e

    # -- smart constructors (operands already simplified) --------------------------------------
    def cast(self, a: Expr, dt: DType) -> Expr:
        if a.dtype == dt:
            return a
        if isinstance(a, Const):
            try:
                v = cast_value(a.value, a.dtype, dt)
            except Undefined:
                return Cast(a, dt)
            return _const(v, dt) if is_intlike(dt) else Const(float(v), dt)
        if isinstance(a, Cast) and a.a.dtype == dt and is_intlike(dt) and a.dtype.is_int:
            lo, hi = int_range(dt)
            mlo, mhi = int_range(a.dtype)
            if mlo <= lo and hi <= mhi:  # widened then narrowed back
                return a.a
        return Cast(a, dt)

    def unary(self, op: str, a: Expr, dt: DType) -> Expr:
        if isinstance(a, Unary) and a.op == op and op in ("neg", "bitwise_not", "logical_not"):
            return a.a  # involutions (bit-exact for floats too: neg flips the sign bit)
        if not is_intlike(a.dtype):
            return Unary(op, a, dt)
        if (k := _k(a)) is not None:
            try:
                return _const(int_unary(op, k, a.dtype), dt)
            except Undefined:
                pass
        if op == "logical_not" and isinstance(a, Binary) and a.op in _CMPS and is_intlike(a.a.dtype):
            return self.binary(CMP_NEGATE[a.op], a.a, a.b, dt)
        if op in ("floor", "ceil", "round", "trunc"):
            return a
        if op == "abs" and (b := bounds(a, self.env)) is not None and b[0] >= 0:
            return a
        return Unary(op, a, dt)

    def select(self, c: Expr, a: Expr, b: Expr, dt: DType) -> Expr:
        if (k := _k(c)) is not None:
            return a if k else b
        if a == b:
            return a
        if dt == DType.bool and _k(a) is not None and _k(b) is not None:
            return c if _k(a) else self.unary("logical_not", c, dt)
        return Select(c, a, b, dt)

    def binary(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        if not is_intlike(a.dtype):
            return Binary(op, a, b, dt)
        ka, kb = _k(a), _k(b)
        if ka is not None and kb is not None:
            try:
                return _const(int_binary(op, ka, kb, a.dtype), dt)
            except Undefined:
                return Binary(op, a, b, dt)
        if ka is not None and (op in _COMMUTATIVE or op in _CMPS):  # constants go right
            return self.binary(CMP_SWAP.get(op, op), b, a, dt)
        rule = _RULES.get(op)
        return self.known(rule(self, op, a, b, dt) if rule is not None else Binary(op, a, b, dt))

    def node(self, op: str, a: Expr, b: Expr) -> Expr:
        return self.binary(op, a, b, DType.bool if op in _CMPS else a.dtype)

    def c(self, v: int, like: Expr) -> Const:
        return _const(v, like.dtype)

    def with_offset(self, x: Expr, off: int) -> Expr:
        """``x + off``, written ``x - n`` for a negative offset."""
        off = wrap(off, x.dtype)
        if off == 0:
            return x
        if off < 0 and off != int_range(x.dtype)[0]:
            return Binary("sub", x, self.c(-off, x), x.dtype)
        return Binary("add", x, self.c(off, x), x.dtype)

    # -- rules -------------------------------------------------------------------------------
    def r_add(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        if dt == DType.bool:
            return Binary("add", a, b, dt)
        (x, c1), (y, c2) = _offset(a), _offset(b)
        if (k := _k(b)) is not None:
            return self.with_offset(x, c1 + k)
        if c1 or c2:  # hoist constants outward: (x + 1) + (y + 2) -> (x + y) + 3
            return self.with_offset(self.node("add", x, y), c1 + c2)
        if a == b:
            return self.node("mul", a, self.c(2, a))
        if (merged := self.recombine(a, b, dt)) is not None:
            return merged
        return Binary("add", a, b, dt)

    def recombine(self, a: Expr, b: Expr, dt: DType) -> Expr | None:
        """``(x / k) * k + x % k`` → ``x`` (and ``(x >> s) << s + (x & (2^s - 1))`` → ``x``): the
        quotient-remainder identity, exact for every ``x`` when ``k > 0`` (truncating division and
        remainder share ``x``'s sign; floor shift and mask likewise), so it needs no ranges. It
        undoes ``linearize(delinearize(i))`` — an index split into coordinates and put back."""
        if not dt.is_int:
            return None
        terms, const = _linear(Binary("add", a, b, dt))
        for i, (ci, ti) in enumerate(terms):
            if not isinstance(ti, Binary) or (k := _k(ti.b)) is None or k <= 0:
                continue
            if ti.op == "div" and ci == k:
                rem = Binary("fmod", ti.a, ti.b, dt)
            elif ti.op == "shr" and k < 8 * dt.itemsize - 1 and ci == 1 << k:
                rem = Binary("bitwise_and", ti.a, self.c((1 << k) - 1, ti.a), dt)
            else:
                continue
            for j, (cj, tj) in enumerate(terms):
                if j != i and cj == 1 and tj == rem:
                    rest = [t for n, t in enumerate(terms) if n not in (i, j)]
                    return self.expr(self.build([(1, ti.a), *rest], const, dt))
        return None

    def r_sub(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        if a == b:
            return self.c(0, a)
        (x, c1), (y, c2) = _offset(a), _offset(b)
        if (k := _k(b)) is not None:
            return self.with_offset(x, c1 - k)
        if c1 or c2:
            return self.with_offset(self.node("sub", x, y), c1 - c2)
        return Binary("sub", a, b, dt)

    def r_mul(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        k = _k(b)
        if k == 0:
            return self.c(0, a)
        if k == 1:
            return a
        if k is not None and isinstance(a, Binary) and a.op == "mul" and (k1 := _k(a.b)) is not None:
            return self.node("mul", a.a, self.c(k1 * k, a))
        return Binary("mul", a, b, dt)

    def r_div(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        k = _k(b)
        if k == 1:
            return a
        if k is None or k <= 0:
            return Binary("div", a, b, dt)
        if (split := self.split(a, k, same_sign=True)) is not None:
            q, r = split
            return self.node("add", q, self.node("div", r, b))
        if isinstance(a, Binary) and a.op == "div" and (k1 := _k(a.b)) is not None and k1 > 0 \
                and k1 * k <= int_range(dt)[1]:
            return self.node("div", a.a, self.c(k1 * k, a))
        ba = bounds(a, self.env)
        if (scaled := self.common_factor(a, k, ba)) is not None:
            return scaled
        if ba is not None and -k < ba[0] and ba[1] < k:
            return self.c(0, a)
        if ba is not None and ba[0] >= 0 and (s := _log2(k)) is not None:
            return self.node("shr", a, self.c(s, a))
        return Binary("div", a, b, dt)

    def r_fmod(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        k = _k(b)
        if k is not None and k < 0 and k != int_range(dt)[0]:
            return self.node("fmod", a, self.c(-k, a))  # C remainder ignores the divisor's sign
        if k is None or k <= 0:
            return Binary("fmod", a, b, dt)
        if k == 1:
            return self.c(0, a)
        ba = bounds(a, self.env)
        if ba is not None and -k < ba[0] and ba[1] < k:
            return a
        if (split := self.split(a, k, same_sign=True)) is not None:
            return self.node("fmod", split[1], b)
        if isinstance(a, Binary) and a.op == "fmod" and (k1 := _k(a.b)) is not None and k1 > 0 and k1 % k == 0:
            return self.node("fmod", a.a, b)
        if ba is not None and ba[0] >= 0 and _log2(k) is not None:
            return self.node("bitwise_and", a, self.c(k - 1, a))
        return Binary("fmod", a, b, dt)

    def r_floordiv(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        k, ba = _k(b), bounds(a, self.env)
        if k is not None and k > 0 and ba is not None and ba[0] >= 0:  # floor == trunc here
            return self.node("div" if op == "floordiv" else "fmod", a, b)
        return Binary(op, a, b, dt)

    def r_shr(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        s = _k(b)
        if s == 0:
            return a
        bits = 8 * dt.itemsize
        if s is None or not 0 < s < bits:
            return Binary("shr", a, b, dt)
        if isinstance(a, Binary) and a.op == "shr" and (s1 := _k(a.b)) is not None and s1 >= 0 and s1 + s < bits:
            return self.node("shr", a.a, self.c(s1 + s, a))
        if (split := self.split(a, 1 << s, same_sign=False)) is not None:
            q, r = split
            return self.node("add", q, self.node("shr", r, b))
        return Binary("shr", a, b, dt)

    def r_shl(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        return a if _k(b) == 0 else Binary("shl", a, b, dt)

    def r_and(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        k = _k(b)
        if a == b:
            return a
        if dt == DType.bool:
            return b if k == 0 else a if k == 1 else Binary("bitwise_and", a, b, dt)
        if k == 0:
            return b
        if k == -1:
            return a
        if k is not None and (p := _log2(k + 1)) is not None:
            ba = bounds(a, self.env)
            if ba is not None and ba[0] >= 0 and ba[1] <= k:
                return a
            terms, const = _linear(a)
            kept = [(c, t) for c, t in terms if c % (1 << p)]
            if len(kept) < len(terms) or const != const & k:  # the low p bits ignore multiples of 2^p
                return self.node("bitwise_and", self.build(kept, const & k, a.dtype), b)
        return Binary("bitwise_and", a, b, dt)

    def r_or(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        k = _k(b)
        if k == 0 or a == b:
            return a
        if dt == DType.bool and k == 1:
            return b
        return Binary("bitwise_or", a, b, dt)

    def r_xor(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        if _k(b) == 0:
            return a
        if a == b:
            return self.c(0, a)
        return Binary("bitwise_xor", a, b, dt)

    def r_minmax(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        if a == b:
            return a
        ba, bb = bounds(a, self.env), bounds(b, self.env)
        if ba is not None and bb is not None:
            a_le_b = ba[1] <= bb[0]
            b_le_a = bb[1] <= ba[0]
            if a_le_b or b_le_a:
                return a if a_le_b == (op == "minimum") else b
        return Binary(op, a, b, dt)

    def r_cmp(self, op: str, a: Expr, b: Expr, dt: DType) -> Expr:
        op = op
        if a == b:
            return _const(op in ("eq", "le", "ge"), dt)
        (x, c1), k = _offset(a), _k(b)
        if c1 and k is not None and bounds(a, self.env) is not None:  # x + c < k  <=>  x < k - c
            lo, hi = int_range(a.dtype)
            if lo <= k - c1 <= hi:
                return self.node(op, x, self.c(k - c1, x))
        return Binary(op, a, b, dt)

    # -- the linear-form rule -----------------------------------------------------------------
    def build(self, terms: Terms, const: int, dt: DType) -> Expr:
        out: Expr | None = None
        for coef, t in terms:
            if out is not None and coef == -1:
                out = Binary("sub", out, t, dt)
                continue
            term = t if coef == 1 else Binary("mul", t, _const(coef, dt), dt)
            out = term if out is None else Binary("add", out, term, dt)
        return _const(const, dt) if out is None else self.with_offset(out, const)

    def common_factor(self, a: Expr, k: int, ba: Interval | None) -> Expr | None:
        """``(g·X + t) / k`` → ``X / (k/g)`` where ``g > 1`` divides ``k`` and every coefficient of
        ``a`` (the constant split as ``g·q + t``, ``q`` into ``X``), ``0 ≤ t < g`` and ``X ≥ 0``
        (so ``a`` is too and both divisions floor): an unrolled tap ``(7·k + 3) / 49`` of a 7×7
        window becomes ``k / 7``, the same for every tap of the trip. ``ba``: ``a``'s bounds, which
        the caller has. ``None`` where the rule does not apply."""
        dt = a.dtype
        terms, const = _linear(a)
        g = math.gcd(k, *(cf for cf, _ in terms)) if terms else 1
        if g <= 1:
            return None
        q, t = divmod(const, g)
        x = self.build([(cf // g, term) for cf, term in terms], q, dt)
        bx = bounds(x, self.env)
        if ba is None or bx is None or ba[0] < 0 or bx[0] < 0 or bx[1] * g + t > int_range(dt)[1]:
            return None
        return self.node("div", self.expr(x), self.c(k // g, a))

    def split(self, a: Expr, k: int, *, same_sign: bool) -> tuple[Expr, Expr] | None:
        """``(M/k, R)`` with ``a == M + R``, ``k`` dividing every term of ``M``, when that is
        exact: ``M``, ``R`` and ``M + R`` do not overflow (and, for truncating division,
        ``M`` and ``R`` have the same sign). ``None`` if ``M`` would be empty."""
        dt = a.dtype
        terms, const = _linear(a)
        mult = [(c, t) for c, t in terms if c % k == 0]
        rest = [(c, t) for c, t in terms if c % k]
        mconst, rconst = (const, 0) if const % k == 0 else (0, const)
        if not mult and not mconst:
            return None
        bm = bounds(self.build(mult, mconst, dt), self.env)
        br = bounds(self.build(rest, rconst, dt), self.env)
        if bm is None or br is None:
            return None
        lo, hi = int_range(dt)
        if not (lo <= bm[0] + br[0] and bm[1] + br[1] <= hi):
            return None
        if same_sign and br != (0, 0) and not ((bm[0] >= 0 and br[0] >= 0) or (bm[1] <= 0 and br[1] <= 0)):
            return None
        q = self.build([(c // k, t) for c, t in mult], mconst // k, dt)
        return self.expr(q), self.expr(self.build(rest, rconst, dt))


def _offset(e: Expr) -> tuple[Expr, int]:
    """``e`` as ``x + c`` (``c`` may be 0)."""
    if isinstance(e, Binary) and e.op in ("add", "sub") and (k := _k(e.b)) is not None and e.dtype.is_int:
        return e.a, k if e.op == "add" else -k
    return e, 0


def _linear(e: Expr) -> tuple[Terms, int]:
    """``e`` as ``sum(coef * term) + const`` over the wrapping integers (exact mod 2^bits)."""
    dt = e.dtype
    if (k := _k(e)) is not None:
        return [], k
    if isinstance(e, Binary) and e.op in ("add", "sub"):
        ta, ca = _linear(e.a)
        tb, cb = _linear(e.b)
        sign = 1 if e.op == "add" else -1
        return ta + [(wrap(sign * c, dt), t) for c, t in tb], wrap(ca + sign * cb, dt)
    scale = None
    if isinstance(e, Binary) and e.op == "mul":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if (k := _k(y)) is not None:
                scale, inner = k, x
                break
    elif isinstance(e, Binary) and e.op == "shl" and (s := _k(e.b)) is not None and 0 <= s < 8 * dt.itemsize:
        scale, inner = 1 << s, e.a
    elif isinstance(e, Unary) and e.op == "neg":
        scale, inner = -1, e.a
    if scale is not None:
        t, c = _linear(inner)
        return [(wrap(scale * cf, dt), x) for cf, x in t], wrap(scale * c, dt)
    return [(1, e)], 0


_RULES = {
    "add": _Simplifier.r_add, "sub": _Simplifier.r_sub, "mul": _Simplifier.r_mul,
    "div": _Simplifier.r_div, "fmod": _Simplifier.r_fmod, "shr": _Simplifier.r_shr, "shl": _Simplifier.r_shl,
    "floordiv": _Simplifier.r_floordiv, "remainder": _Simplifier.r_floordiv,
    "bitwise_and": _Simplifier.r_and, "bitwise_or": _Simplifier.r_or, "bitwise_xor": _Simplifier.r_xor,
    "maximum": _Simplifier.r_minmax, "minimum": _Simplifier.r_minmax,
    **{op: _Simplifier.r_cmp for op in CMP_NEGATE},
}


# -- public entry points -----------------------------------------------------------------------
def simplify_expr(expr: Expr, ranges: Env | Facts | None = None) -> Expr:
    """``expr`` simplified, using the facts ``ranges`` (see :func:`sextant.kernel.ranges.bounds`)."""
    env = ranges if isinstance(ranges, Env) else Env(dict(ranges or {}))
    return _Simplifier(env).expr(expr)


def simplify_kernel(kernel: Kernel, work: WorkCounter | None = None) -> Kernel:
    """``kernel`` with every expression simplified under the facts that hold where it runs,
    decided ``If``s replaced by the branch taken, and loops that never run (or do nothing)
    removed. One walk, linear in the kernel (``work`` counts it: ``"simplify: statements"``
    and range analysis's items)."""
    ranges = Ranges.for_kernel(kernel, work)
    body, _ = _block(kernel.body, ranges.entry(), ranges)
    return dataclasses.replace(kernel, body=body, meta=dict(kernel.meta))


def _block(stmts: tuple[Stmt, ...], env: Env, ranges: Ranges) -> tuple[tuple[Stmt, ...], bool]:
    """``stmts`` simplified, ``env`` updated to the facts after them; ``False``: the end is
    unreachable (the statements after the point where that became known are kept as they are)."""
    out: list[Stmt] = []
    for i, s in enumerate(stmts):
        new, reachable = _stmt(s, env, ranges)
        out.extend(new)
        if not reachable:
            return (*out, *stmts[i + 1:]), False
    return tuple(out), True


def _stmt(s: Stmt, env: Env, ranges: Ranges) -> tuple[list[Stmt], bool]:
    if ranges.work is not None:
        ranges.work.add("simplify: statements")
    simp = _Simplifier(env).expr
    if isinstance(s, Assign):
        value = simp(s.value)
        ranges.assign(env, s.var, value)
        return [Assign(s.var, value)], True
    if isinstance(s, Store):
        return [Store(s.buffer, simp(s.index), simp(s.value))], True
    if isinstance(s, AtomicAdd):
        return [AtomicAdd(s.buffer, simp(s.index), simp(s.value))], True
    if isinstance(s, WarpReduce):
        new = dataclasses.replace(s, value=simp(s.value))
        ranges.step(new, env)
        return [new], True
    if isinstance(s, (Barrier, Mma, LdMatrix, *CPU_MATRIX, *ASYNC_COPY, *HOPPER)):
        return [map_operands(s, simp)], True
    if isinstance(s, For):
        loop = dataclasses.replace(s, start=simp(s.start), stop=simp(s.stop))
        if loop_range(loop, env, ranges.assigned(loop)) is False:
            return [], True  # no iteration
        runs = ranges.enter_loop(env, loop)
        body = _block(loop.body, env, ranges)[0] if runs else loop.body
        ranges.leave_loop(env, loop)
        return ([dataclasses.replace(loop, body=body)] if body else []), True
    assert isinstance(s, If), s
    cond = simp(s.cond)
    then_ok, else_ok = ranges.decided(env, cond)
    if not (then_ok and else_ok):  # decided: only one branch can run (its facts hold after it)
        if not then_ok and not else_ok:
            return list(s.then), False
        assume(env, cond, then_ok)
        new, reachable = _block(s.then if then_ok else s.orelse, env, ranges)
        return list(new), reachable
    negated = _Simplifier(env).unary("logical_not", cond, DType.bool)  # under the facts before the If
    ranges.enter_branch(env, cond, True)
    then, t_end = _block(s.then, env, ranges)
    t_delta = ranges.leave_branch(env, t_end)
    ranges.enter_branch(env, cond, False)
    orelse, f_end = _block(s.orelse, env, ranges)
    f_delta = ranges.leave_branch(env, f_end)
    reachable = ranges.join(env, t_delta, f_delta)
    if not then and not orelse:
        return [], reachable
    if not then:
        return [If(negated, orelse)], reachable
    return [If(cond, then, orelse)], reachable
