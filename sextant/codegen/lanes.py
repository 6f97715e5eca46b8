"""Which unrolled loops the CPU lowering may emit as vector code, and how (kernel-IR analysis).

A ``For(unroll=True)`` over a constant range is the schedules' way of saying "these iterations
are independent lanes": the GEMM micro-kernel's columns, the zeroing and copying of its
accumulator tile, a reduction's partial-result lanes. Unrolled one iteration at a time they
became thousands of scalar LLVM instructions per kernel that LLVM's SLP vectoriser then had to
re-discover as vectors — most of the CPU's compile time. Emitted as ``<W x T>`` operations
instead, a 256-element accumulator tile is 16 vector registers in the IR from the start.

That is only correct when the lanes are truly independent, which :func:`plan_lanes` proves on
the kernel IR before the lowering commits to it:

* the body is straight-line ``Assign``/``Store`` code (no nested loops or branches);
* no register carries a value from one iteration to the next (every read of a register the body
  assigns follows an assignment earlier in the same iteration);
* every store goes to consecutive elements (its index is ``lane + base``, coefficient 1), and
  every other access to a buffer the body stores into is too, at a base whose constant distance
  from the store's is 0 or at least the trip count, so no iteration reads or overwrites what
  another one wrote;
* a ``Select`` whose arm loads memory has a condition that is the same in every lane (its arm
  may be out of bounds when not chosen, and a vector select evaluates both arms).

Loads are classified by the coefficient of the loop variable in their index: 0 (one scalar,
broadcast), 1 (one vector load) or anything else (a gather, lane by lane).
"""

from __future__ import annotations

from dataclasses import dataclass

from sextant.codegen.simt import expr_loads, expr_vars, iter_expr
from sextant.kernel.ir import Assign, Binary, Const, Expr, For, Load, Select, Store, Var

CONTIGUOUS, UNIFORM = 1, 0


@dataclass(frozen=True)
class LanePlan:
    """How to emit one loop as vectors: ``width`` lanes at a time, ``trips // width`` chunks;
    ``varying`` are the registers holding a different value per lane (the loop variable too)."""

    width: int
    trips: int
    start: int
    varying: frozenset[str]
    linear: _Linear

    def varies(self, e: Expr) -> bool:
        """Whether ``e`` differs between lanes."""
        return self.linear.depends(e)

    def coefficient(self, e: Expr) -> int | None:
        return self.linear.coefficient(e)


class _Linear:
    """Index expressions as ``sum(coef · term) + const`` over opaque non-linear terms; the loop
    variable and the registers assigned from it are expanded, so distances between two accesses
    come out as constants when they are."""

    def __init__(self, loop_var: str, defs: dict[str, Expr]):
        self.loop_var, self.defs = loop_var, defs
        self.memo: dict[Expr, tuple[dict[Expr, int], int] | None] = {}
        self.var_memo: dict[str, bool] = {}
        self.dep_memo: dict[int, tuple[Expr, bool]] = {}  # by id; the expression is kept alive

    def form(self, e: Expr) -> tuple[dict[Expr, int], int] | None:
        """(terms, constant), or None when the loop variable enters non-linearly."""
        if e in self.memo:
            return self.memo[e]
        self.memo[e] = out = self._form(e)
        return out

    def _form(self, e: Expr) -> tuple[dict[Expr, int], int] | None:
        if isinstance(e, Const) and e.dtype.is_int:
            return {}, int(e.value)
        if isinstance(e, Var) and e.name in self.defs:
            return self.form(self.defs[e.name])
        if isinstance(e, Binary) and e.op in ("add", "sub"):
            a, b = self.form(e.a), self.form(e.b)
            if a is None or b is None:
                return None
            sign = 1 if e.op == "add" else -1
            terms = dict(a[0])
            for t, k in b[0].items():
                terms[t] = terms.get(t, 0) + sign * k
            return {t: k for t, k in terms.items() if k}, a[1] + sign * b[1]
        if isinstance(e, Binary) and e.op == "mul":
            for x, y in ((e.a, e.b), (e.b, e.a)):
                if isinstance(y, Const):
                    f = self.form(x)
                    if f is None:
                        return None
                    k = int(y.value)
                    return {t: k * v for t, v in f[0].items() if k * v}, k * f[1]
        if self.depends(e):
            return None if not (isinstance(e, Var) and e.name == self.loop_var) else ({e: 1}, 0)
        return {e: 1}, 0

    def depends(self, e: Expr) -> bool:
        """Whether ``e`` reads the loop variable (directly or through a register set from it)."""
        hit = self.dep_memo.get(id(e))
        if hit is None:
            hit = self.dep_memo[id(e)] = (e, any(self._var_depends(v) for v in expr_vars(e)))
        return hit[1]

    def _var_depends(self, name: str) -> bool:
        if name == self.loop_var:
            return True
        if name not in self.defs:
            return False
        if name not in self.var_memo:
            self.var_memo[name] = False  # the body is acyclic (checked by plan_lanes); this only bounds the walk
            self.var_memo[name] = self.depends(self.defs[name])
        return self.var_memo[name]

    def coefficient(self, e: Expr) -> int | None:
        """The loop variable's coefficient in ``e`` (0: the same in every lane), None if non-linear."""
        if not self.depends(e):
            return UNIFORM
        f = self.form(e)
        if f is None:
            return None
        return sum(k for t, k in f[0].items() if isinstance(t, Var) and t.name == self.loop_var)


def plan_lanes(loop: For, max_width: int) -> LanePlan | None:
    """A plan to emit ``loop`` ``max_width`` lanes (or a smaller power of two dividing its trip
    count) at a time, or None when it must stay scalar (see the module docstring)."""
    if not (loop.unroll and loop.step == 1 and isinstance(loop.start, Const) and isinstance(loop.stop, Const)):
        return None
    start, trips = int(loop.start.value), int(loop.stop.value) - int(loop.start.value)
    width = max_width
    while width > 1 and trips % width:
        width //= 2
    if width < 4 or not loop.body:
        return None
    u = loop.var.name

    # straight-line code; no value carried between iterations
    if not all(isinstance(s, (Assign, Store)) for s in loop.body):
        return None
    body_assigns = {s.var.name for s in loop.body if isinstance(s, Assign)}
    assigned: set[str] = set()
    defs: dict[str, Expr] = {}
    for s in loop.body:
        reads = expr_vars(s.value) | (expr_vars(s.index) if isinstance(s, Store) else set())
        if reads & (body_assigns - assigned):
            return None  # read before this iteration assigns it: carried from the previous one
        if isinstance(s, Assign):
            if s.var.name == u or s.var.name in assigned:
                return None  # the loop variable, or a register assigned twice (one definition per lane)
            assigned.add(s.var.name)
            defs[s.var.name] = s.value
    lin = _Linear(u, defs)
    varying = frozenset({u} | {v for v, e in defs.items() if lin.depends(e)})

    stores: dict[str, list[Expr]] = {}
    accesses: dict[str, list[Expr]] = {}
    for s in loop.body:
        exprs = (s.value,) if isinstance(s, Assign) else (s.index, s.value)
        if isinstance(s, Store):
            if lin.coefficient(s.index) != CONTIGUOUS:
                return None
            stores.setdefault(s.buffer, []).append(s.index)
            accesses.setdefault(s.buffer, []).append(s.index)
        for e in exprs:
            for x in iter_expr(e):
                if isinstance(x, Load):
                    accesses.setdefault(x.buffer, []).append(x.index)
                elif isinstance(x, Select) and lin.depends(x.cond) and (expr_loads(x.a) or expr_loads(x.b)):
                    return None
    for buf, idxs in stores.items():
        forms = []
        for idx in accesses[buf]:
            if lin.coefficient(idx) != CONTIGUOUS:
                return None
            forms.append(lin.form(idx))
        for st in idxs:
            fs = lin.form(st)
            for f in forms:
                if fs is None or f is None or fs[0] != f[0]:
                    return None  # distance not a known constant
                d = abs(fs[1] - f[1])
                if 0 < d < trips:
                    return None
    return LanePlan(width, trips, start, varying, lin)
