"""Symbolic dimensions: sizes known at capture time only by name and range (batch, sequence).

A :class:`SymDim` is an integer polynomial over named symbols (``batch``, ``2*seq + 1``,
``batch*seq``) that carries the declared range of each of its symbols (torch.export's
``Dim("seq", min=1, max=512)``), so it is self-contained: no global symbol table. It behaves like
an ``int`` where the answer does not depend on the value — arithmetic gives another ``SymDim``
(or an ``int`` once the symbols cancel), ``==`` is symbolic identity (``batch*seq == seq*batch``;
``seq == 1`` is False: the type of a ``seq``-long tensor is not that of a 1-long one), and an
order comparison is answered from the ranges when they decide it. Asking for a concrete value
(``int(d)``, ``range(d)``, a comparison the ranges cannot decide) raises
:class:`SymbolicShapeError` naming the size, so a step that needs a concrete size says so.

Shapes in the graph IR are tuples of ``int | SymDim`` (:data:`Dim`); :func:`bind` substitutes
values for every symbol of a graph and gives an ordinary static graph.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, Union

import sympy

from sextant.errors import SextantError


class SymbolicShapeError(SextantError):
    """A step needed the concrete value of a symbolic size, or sizes broke their declared ranges."""


Bounds = tuple[tuple[str, int, int], ...]  # (symbol name, min, max), sorted by name


def sympy_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


class SymDim:
    """An integer polynomial over symbols with declared ranges; immutable, hashable."""

    __slots__ = ("bounds", "expr")

    expr: sympy.Expr
    bounds: Bounds

    def __init__(self, expr: sympy.Expr, bounds: Bounds) -> None:
        object.__setattr__(self, "expr", expr)
        object.__setattr__(self, "bounds", bounds)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("SymDim is immutable")

    # -- construction ---------------------------------------------------------------------
    @staticmethod
    def symbol(name: str, lo: int, hi: int) -> SymDim:
        if not (0 <= lo <= hi):
            raise SymbolicShapeError(f"symbol {name}: range [{lo}, {hi}] is empty or negative")
        return SymDim(sympy_symbol(name), ((name, int(lo), int(hi)),))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _, _ in self.bounds)

    def _lift(self, other: object) -> tuple[sympy.Expr, Bounds] | None:
        if isinstance(other, SymDim):
            return other.expr, _merge(self.bounds, other.bounds)
        if isinstance(other, int) and not isinstance(other, bool):
            return sympy.Integer(other), self.bounds
        return None

    def _op(self, other: object, fn: Any) -> Dim:
        lifted = self._lift(other)
        if lifted is None:
            return NotImplemented
        return make_dim(fn(self.expr, lifted[0]), lifted[1])

    def __add__(self, o: object) -> Dim: return self._op(o, lambda a, b: a + b)
    def __radd__(self, o: object) -> Dim: return self._op(o, lambda a, b: b + a)
    def __sub__(self, o: object) -> Dim: return self._op(o, lambda a, b: a - b)
    def __rsub__(self, o: object) -> Dim: return self._op(o, lambda a, b: b - a)
    def __mul__(self, o: object) -> Dim: return self._op(o, lambda a, b: a * b)
    def __rmul__(self, o: object) -> Dim: return self._op(o, lambda a, b: b * a)
    def __floordiv__(self, o: object) -> Dim: return self._op(o, lambda a, b: sympy.floor(a / b))
    def __rfloordiv__(self, o: object) -> Dim: return self._op(o, lambda a, b: sympy.floor(b / a))
    def __mod__(self, o: object) -> Dim: return self._op(o, lambda a, b: sympy.Mod(a, b))
    def __rmod__(self, o: object) -> Dim: return self._op(o, lambda a, b: sympy.Mod(b, a))

    def __truediv__(self, o: object) -> Any:
        raise SymbolicShapeError(f"a true division of the size {self} (a float scale from a symbolic size)")

    __rtruediv__ = __truediv__

    def __float__(self) -> float:
        raise SymbolicShapeError(f"the size {self} as a float ({describe(self.bounds)})")

    def __neg__(self) -> Dim:
        return make_dim(-self.expr, self.bounds)

    # -- identity and order -----------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        lifted = self._lift(other)
        if lifted is None:
            return NotImplemented
        return sympy.expand(self.expr - lifted[0]) == 0

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self.expr)

    def range(self) -> tuple[int | float, int | float]:
        """The least and greatest value the declared ranges allow."""
        return _range(self.expr, self.bounds)

    def _decide(self, other: object, op: str) -> bool:
        lifted = self._lift(other)
        if lifted is None:
            return NotImplemented
        diff = make_dim(self.expr - lifted[0], lifted[1])
        lo, hi = (diff, diff) if isinstance(diff, int) else diff.range()
        verdict = {"<": (hi < 0, lo >= 0), "<=": (hi <= 0, lo > 0),
                   ">": (lo > 0, hi <= 0), ">=": (lo >= 0, hi < 0)}[op]
        if verdict[0]:
            return True
        if verdict[1]:
            return False
        raise SymbolicShapeError(f"cannot decide {self} {op} {other} for {describe(self.bounds)}: "
                                 "the answer depends on the size")

    def __lt__(self, o: object) -> bool: return self._decide(o, "<")
    def __le__(self, o: object) -> bool: return self._decide(o, "<=")
    def __gt__(self, o: object) -> bool: return self._decide(o, ">")
    def __ge__(self, o: object) -> bool: return self._decide(o, ">=")

    def __bool__(self) -> bool:
        return bool(self._decide(0, ">"))  # sizes are never negative: non-zero means positive

    def __index__(self) -> int:
        raise SymbolicShapeError(f"size {self} is symbolic ({describe(self.bounds)}); this step needs a "
                                 "concrete size")

    __int__ = __index__

    # -- values -------------------------------------------------------------------------------
    def subs(self, values: Mapping[str, int]) -> int:
        missing = [n for n in self.names if n not in values]
        if missing:
            raise SymbolicShapeError(f"no value for symbol(s) {', '.join(missing)} of size {self}")
        v = self.expr.subs({sympy_symbol(n): int(values[n]) for n in self.names})
        return int(v)

    def __str__(self) -> str:
        return str(self.expr).replace(" ", "")

    def __repr__(self) -> str:
        return f"SymDim({self})"

    def __reduce__(self) -> tuple:  # pickles as its text and ranges (sympy objects pickle too, slower)
        return (parse_dim, (str(self), self.bounds))


Dim = Union[int, SymDim]  # noqa: UP007


@functools.lru_cache(maxsize=8192)
def _range(expr: sympy.Expr, bounds: Bounds) -> tuple[int | float, int | float]:
    """:meth:`SymDim.range`, once per size: the schedule asks the same sizes' ranges over and over
    (capacities, comparisons), and interval arithmetic on sympy expressions is not cheap."""
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    ranges = {sympy_symbol(n): ValueRanges(lo, hi) for n, lo, hi in bounds}
    vr = bound_sympy(expr, ranges)
    lo, hi = _num(vr.lower), _num(vr.upper)
    factored = sympy.factor(expr)  # interval arithmetic is tighter on products: batch*(seq-1)
    if factored != expr:
        vf = bound_sympy(factored, ranges)
        lo, hi = max(lo, _num(vf.lower)), min(hi, _num(vf.upper))
    if expr.has(sympy.floor):  # floor(p/q) = p/q - t with t in [0, (q-1)/q]: the floors of a
        # difference such as floor(L/2) - floor((L+1)/2) cancel up to bounded terms
        rest, extra = expr, dict(ranges)
        for k, f in enumerate(sorted(expr.atoms(sympy.floor), key=str)):
            _, den = sympy.fraction(sympy.together(f.args[0]))
            if not den.is_Integer:
                break
            t = sympy.Symbol(f"_frac{k}")
            extra[t] = ValueRanges(sympy.Integer(0), sympy.Rational(int(den) - 1, int(den)))
            rest = rest.xreplace({f: f.args[0] - t})
        else:
            vr2 = bound_sympy(sympy.expand(rest), extra)  # the size is an integer: round inwards
            lo2 = int(sympy.ceiling(vr2.lower)) if vr2.lower.is_finite else lo
            lo, hi = max(lo, lo2), min(hi, _num_floor(vr2.upper, hi))
    return lo, hi


def _num_floor(v: Any, default: int | float) -> int | float:
    """The greatest integer at most ``v`` (a sympy bound), or ``default`` when unbounded."""
    if not v.is_finite:
        return default
    return int(sympy.floor(v))


def _num(v: Any) -> int | float:
    if v in (sympy.oo, -sympy.oo) or (hasattr(v, "is_infinite") and v.is_infinite):
        return float(v)
    return int(v)


def _merge(a: Bounds, b: Bounds) -> Bounds:
    if a == b:
        return a
    out = dict((n, (lo, hi)) for n, lo, hi in a)
    for n, lo, hi in b:
        if n in out and out[n] != (lo, hi):
            raise SymbolicShapeError(f"symbol {n} declared with two ranges: {list(out[n])} and {[lo, hi]}")
        out[n] = (lo, hi)
    return tuple((n, *out[n]) for n in sorted(out))


def make_dim(expr: sympy.Expr, bounds: Bounds) -> Dim:
    """``expr`` as a dimension: an ``int`` when it is a number, else a ``SymDim`` carrying the
    ranges of the symbols it still mentions."""
    expr = _canonical_floors(sympy.expand(expr))
    if expr.is_Integer:
        return int(expr)
    if expr.is_number:
        raise SymbolicShapeError(f"size {expr} is not an integer")
    free = {s.name for s in expr.free_symbols}
    return SymDim(expr, tuple(b for b in bounds if b[0] in free))


def _canonical_floors(expr: sympy.Expr) -> sympy.Expr:
    """``floor((A + c)/d)`` with the constant ``c`` of the integer polynomial ``A + c`` reduced into
    ``[0, d)`` and the rest pulled out: ``floor((L-5)/2) = floor((L+1)/2) - 3``. Sizes that differ by
    a constant then share one floor term, and their difference is a number (a strided
    convolution's output lengths, compared by the lowering, are decidable)."""
    if not expr.has(sympy.floor, sympy.ceiling):
        return expr

    def canon(e: sympy.Expr) -> sympy.Expr:
        arg = e.args[0] if not isinstance(e, sympy.ceiling) else -e.args[0]
        num, den = sympy.fraction(sympy.together(arg))
        num = sympy.expand(num)
        if den.is_Integer and int(den) > 1 and not isinstance(e, sympy.ceiling):
            # floor((floor(y) + Q)/d) = floor((y + Q)/d) for an integer polynomial Q and d > 0: a
            # stride-5 then stride-2 length is floor(s/10), however torch or a lowering nests it
            inner = [t for t in sympy.Add.make_args(num) if isinstance(t, sympy.floor)]
            if len(inner) == 1 and (num - inner[0]).is_polynomial() and not (num - inner[0]).has(sympy.floor):
                return canon(sympy.floor((inner[0].args[0] + num - inner[0]) / den))
        if not (den.is_Integer and int(den) > 1 and num.is_polynomial()):
            return e
        const = num.as_coeff_add()[0]
        if not const.is_Integer:
            return e
        k, r = divmod(int(const), int(den))
        out = sympy.floor((num - const + r) / den) + k
        return -out if isinstance(e, sympy.ceiling) else out

    return sympy.expand(expr.replace(lambda e: isinstance(e, (sympy.floor, sympy.ceiling)), canon))


def is_dim(v: object) -> bool:
    return isinstance(v, SymDim) or (isinstance(v, int) and not isinstance(v, bool))


def is_symbolic(v: object) -> bool:
    """Whether ``v`` (a dim, or nested tuples of them) mentions a symbol."""
    if isinstance(v, SymDim):
        return True
    if isinstance(v, tuple):
        return any(is_symbolic(x) for x in v)
    return False


def symbols_of(values: Iterable[object]) -> Bounds:
    """The symbols (with ranges) mentioned anywhere in ``values`` (dims, nested tuples)."""
    out: Bounds = ()
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, SymDim):
            out = _merge(out, v.bounds)
        elif isinstance(v, tuple):
            stack.extend(v)
    return out


def substitute(v: Any, values: Mapping[str, int]) -> Any:
    """``v`` with every ``SymDim`` in it (nested tuples too) replaced by its value."""
    if isinstance(v, SymDim):
        return v.subs(values)
    if isinstance(v, tuple):
        return tuple(substitute(x, values) for x in v)
    return v


def graph_symbols(graph: Any) -> Bounds:
    """Every symbol a graph's types and attributes mention, with its range, sorted by name."""
    return symbols_of([n.type.shape for n in graph.nodes] + [v for n in graph.nodes for _, v in n.attrs])


def describe(bounds: Bounds) -> str:
    return ", ".join(f"{n} in [{lo}, {hi}]" for n, lo, hi in bounds)


def parse_dim(text: str, bounds: Bounds) -> Dim:
    """A dimension from its printed form (``7``, ``seq``, ``2*seq+1``), over symbols of ``bounds``."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    local = {n: sympy_symbol(n) for n, _, _ in bounds}
    try:
        expr = sympy.sympify(text, locals=local)
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise SymbolicShapeError(f"cannot read the size {text!r}: {e}") from None
    unknown = sorted(s.name for s in expr.free_symbols if s.name not in local)
    if unknown:
        raise SymbolicShapeError(f"size {text!r} mentions undeclared symbol(s) {', '.join(unknown)}")
    return make_dim(expr.subs({s: local[s.name] for s in expr.free_symbols}), bounds)
