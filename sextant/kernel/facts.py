"""Facts at one program point — intervals of integer values — and what conditions add to them.

``bounds(expr, env)`` returns ``(lo, hi)`` such that every value ``expr`` can take lies in
``[lo, hi]``, or ``None`` when nothing useful is known; it is **sound** (the interval holds
every value of the wrapping, two's complement expression) and bounds a node only when it does
not wrap (:mod:`sextant.kernel.intervals`). Bool expressions get intervals within ``[0, 1]``.

An :class:`Env` maps a :class:`Var`, a :class:`Special` or any load-free expression to an
interval, and keeps ``defs``: registers whose current value is still the load-free expression
last assigned to them (so refining the register refines that). :func:`assume` records what
``cond == truth`` implies (``if (i < n)`` bounds ``i`` by ``n - 1``), :meth:`Env.forget` drops
what an assignment invalidates.

Every change costs what it touches, never the size of the environment, so analysing a kernel
is linear in its length:

* **scopes** instead of copies: a branch or loop body opens a scope, its changes are undone
  when it closes (each key's value before the scope is kept once), and the changes a branch
  made are read back from its scope to join two branches;
* an **index** from each register to the facts and defs that read it: forgetting a register
  visits those, not every fact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from sextant.graph.dtypes import DType
from sextant.kernel.exprs import contains_load, free_names
from sextant.kernel.intervals import (
    CMP,
    CMP_NEGATE,
    CMP_SWAP,
    INTLIKE,
    Interval,
    binary_bounds,
    cmp_bounds,
    fit,
    int_range,
    intersect,
    is_intlike,
    unary_bounds,
)
from sextant.kernel.ir import Binary, Cast, Const, Expr, Load, Select, Special, Unary, Var
from sextant.work import WorkCounter

Facts = Mapping[Expr, Interval]
# per open scope: the value each fact and def had when the scope opened (None: absent)
Scope = tuple[dict[Expr, Interval | None], dict[str, Expr | None]]
# what one branch changed: the new value of each fact and def it touched (None: removed)
Delta = tuple[dict[Expr, Interval | None], dict[str, Expr | None]]

_REGISTER_KEYS: dict[str, tuple[Var, ...]] = {}


def register_keys(name: str) -> tuple[Var, ...]:
    """The fact keys a register ``name`` can have (one per integer-like type)."""
    keys = _REGISTER_KEYS.get(name)
    if keys is None:
        if len(_REGISTER_KEYS) > 1 << 16:
            _REGISTER_KEYS.clear()
        keys = _REGISTER_KEYS[name] = tuple(Var(name, dt) for dt in INTLIKE)
    return keys


class Env:
    """Facts valid at one program point (see the module doc). Updated in place; a visitor that
    keeps an environment copies it (:meth:`copy`, linear in its size).

    ``memo`` holds the intervals of compound expressions computed under the current facts (by
    ``id``, the expression kept alive beside its interval): the simplifier bounds every node of
    an expression bottom-up. Every change to the facts or defs drops it. ``misses``, when not
    None, collects the registers looked up and not found (see ``register_ranges``); ``work``
    counts the entries changed (``"ranges: fact changes"``)."""

    __slots__ = ("_def_index", "_index", "_reads", "_scopes", "defs", "facts", "memo", "misses", "work")

    def __init__(self, facts: dict[Expr, Interval] | None = None, defs: dict[str, Expr] | None = None, *,
                 reads: dict[int, tuple[Expr, frozenset[str]]] | None = None, misses: set[str] | None = None,
                 work: WorkCounter | None = None) -> None:
        self.facts: dict[Expr, Interval] = facts if facts is not None else {}
        self.defs: dict[str, Expr] = defs if defs is not None else {}
        self.memo: dict[int, tuple[Expr, Interval | None]] | None = None
        self.misses = misses
        self.work = work
        # the registers each fact key or def value reads, by ``id``, shared by copies
        self._reads: dict[int, tuple[Expr, frozenset[str]]] = reads if reads is not None else {}
        # register -> compound fact keys / def names that may read it (a superset: checked on use)
        self._index: dict[str, set[Expr]] = {}
        self._def_index: dict[str, set[str]] = {}
        self._scopes: list[Scope] = []
        for k in self.facts:
            if not isinstance(k, Var | Special):
                self._index_key(k)
        for name, v in self.defs.items():
            self._index_def(name, v)

    def copy(self) -> Env:
        if self.work is not None:
            self.work.add("ranges: facts copied", len(self.facts) + len(self.defs))
        return Env(dict(self.facts), dict(self.defs), reads=self._reads, misses=self.misses, work=self.work)

    def free_names(self, e: Expr) -> frozenset[str]:
        """:func:`free_names` of ``e``, computed once per expression."""
        hit = self._reads.get(id(e))
        if hit is None:
            hit = self._reads[id(e)] = (e, free_names(e))
        return hit[1]

    def _index_key(self, key: Expr) -> None:
        for name in self.free_names(key):
            self._index.setdefault(name, set()).add(key)

    def _index_def(self, name: str, value: Expr) -> None:
        for n in self.free_names(value):
            self._def_index.setdefault(n, set()).add(name)

    # -- changes (recorded in the innermost scope) ------------------------------------------------
    def _changed(self, n: int = 1) -> None:
        self.memo = None
        if self.work is not None:
            self.work.add("ranges: fact changes", n)

    def set(self, key: Expr, value: Interval) -> None:
        """Record a fact."""
        if self._scopes:
            old = self._scopes[-1][0]
            if key not in old:
                old[key] = self.facts.get(key)
        self.facts[key] = value
        if not isinstance(key, Var | Special):
            self._index_key(key)
        self._changed()

    def drop(self, key: Expr) -> None:
        """Forget the fact about ``key`` (if any)."""
        facts = self.facts
        if key not in facts:
            return
        if self._scopes:
            old = self._scopes[-1][0]
            if key not in old:
                old[key] = facts[key]
        del facts[key]
        self._changed()

    def define(self, name: str, value: Expr | None) -> None:
        """Set (``None``: drop) the load-free expression register ``name`` currently holds."""
        defs = self.defs
        if value is None and name not in defs:
            return
        if self._scopes:
            old = self._scopes[-1][1]
            if name not in old:
                old[name] = defs.get(name)
        if value is None:
            del defs[name]
        else:
            defs[name] = value
            self._index_def(name, value)
        self._changed()

    def forget(self, names: Iterable[str]) -> None:
        """Drop what is known about values that read the registers ``names`` (base facts are the
        caller's: see ``Ranges.forget``)."""
        facts, defs = self.facts, self.defs
        for name in names:
            for key in register_keys(name):
                if key in facts:
                    self.drop(key)
            for key in self._index.pop(name, ()):
                if key in facts:
                    self.drop(key)
            self.define(name, None)
            for d in self._def_index.pop(name, ()):
                v = defs.get(d)
                if v is not None and name in self.free_names(v):
                    self.define(d, None)
        self.memo = None

    # -- scopes ------------------------------------------------------------------------------------
    def open(self) -> None:
        """Start recording changes, to undo them (:meth:`close`) or read them back (:meth:`delta`)."""
        self._scopes.append(({}, {}))

    def delta(self) -> Delta:
        """The current value of every fact and def changed since the innermost scope opened."""
        facts_old, defs_old = self._scopes[-1]
        facts, defs = self.facts, self.defs
        if self.work is not None:
            self.work.add("ranges: scope entries", len(facts_old) + len(defs_old))
        return {k: facts.get(k) for k in facts_old}, {k: defs.get(k) for k in defs_old}

    def close(self) -> None:
        """Undo every change since the innermost scope opened, and close it."""
        facts_old, defs_old = self._scopes.pop()
        facts, defs = self.facts, self.defs
        for key, old in facts_old.items():
            if old is None:
                facts.pop(key, None)
            else:
                facts[key] = old
                if not isinstance(key, Var | Special):
                    self._index_key(key)
        for name, value in defs_old.items():
            if value is None:
                defs.pop(name, None)
            else:
                defs[name] = value
                self._index_def(name, value)
        self.memo = None
        if self.work is not None:
            self.work.add("ranges: scope entries", len(facts_old) + len(defs_old))

    def apply(self, delta: Delta) -> None:
        """Redo the changes ``delta`` read from a scope (after it was closed)."""
        facts, defs = delta
        for key, value in facts.items():
            if value is None:
                self.drop(key)
            else:
                self.set(key, value)
        for name, v in defs.items():
            self.define(name, v)


def _facts(env: Env | Facts | None) -> Facts:
    if env is None:
        return {}
    return env.facts if isinstance(env, Env) else env


def bounds(expr: Expr, env: Env | Facts | None = None) -> Interval | None:
    """A sound interval of the integer/bool ``expr`` given ``env``; ``None`` when unknown (and
    for float expressions)."""
    if isinstance(expr, Var | Special):
        known = _facts(env).get(expr)
        if known is None:
            if isinstance(env, Env) and env.misses is not None and isinstance(expr, Var):
                env.misses.add(expr.name)
            if expr.dtype == DType.bool:
                return (0, 1)
        return known
    if not is_intlike(expr.dtype):
        return None
    if isinstance(expr, Const):
        return _compute(expr, env)  # type: ignore[arg-type]  # a constant reads no facts
    if not isinstance(env, Env):
        env = Env(dict(_facts(env)))
    memo = env.memo
    if memo is None:
        memo = env.memo = {}
    else:
        hit = memo.get(id(expr))
        if hit is not None:
            return hit[1]
    out = intersect(_compute(expr, env), env.facts.get(expr))
    memo[id(expr)] = (expr, out)  # valid: a trial assumption inside _compute restored the facts
    return out


def _operand(e: Expr, env: Env) -> Interval | None:
    """An operand's interval; an unknown integer is still somewhere in its type's range."""
    b = bounds(e, env)
    if b is None and is_intlike(e.dtype):
        return int_range(e.dtype)
    return b


def _compute(e: Expr, env: Env) -> Interval | None:
    dt = e.dtype
    if isinstance(e, Const):
        if isinstance(e.value, bool | int):
            return (int(e.value), int(e.value))
        return None
    if isinstance(e, Load):
        return (0, 1) if dt == DType.bool else None
    if isinstance(e, Cast):
        a = _operand(e.a, env)
        if a is None:
            return None
        if dt == DType.bool:
            return (0, 0) if a == (0, 0) else (1, 1) if a[0] > 0 or a[1] < 0 else (0, 1)
        return fit(a[0], a[1], dt)
    if isinstance(e, Select):
        return _select_bounds(e, env)
    if isinstance(e, Unary):
        a = _operand(e.a, env)
        if a is None:
            return (0, 1) if dt == DType.bool else None
        return unary_bounds(e.op, a, dt)
    if isinstance(e, Binary):
        a, b = _operand(e.a, env), _operand(e.b, env)
        if a is None or b is None:
            return (0, 1) if dt == DType.bool else None
        if e.op in CMP:
            return cmp_bounds(e.op, a, b)
        return binary_bounds(e.op, a, b, dt)
    return None


def _select_bounds(e: Select, env: Env) -> Interval | None:
    c = bounds(e.cond, env)
    if c == (1, 1):
        return _operand(e.a, env)
    if c == (0, 0):
        return _operand(e.b, env)
    # each branch's value only matters where the condition selects it
    parts = []
    for truth, branch in ((True, e.a), (False, e.b)):
        reachable, part = assumed(env, e.cond, truth, lambda branch=branch: _operand(branch, env))
        if reachable:
            parts.append(part)
    if not parts or any(p is None for p in parts):
        return None
    return (min(p[0] for p in parts), max(p[1] for p in parts))  # type: ignore[index]


# -- refinement by conditions ------------------------------------------------------------------
_MAX_DEPTH = 12


def refine(env: Env | Facts, cond: Expr, truth: bool = True) -> Env | None:
    """A copy of ``env`` plus what ``cond == truth`` implies; ``None`` when that is impossible
    (the code it guards is unreachable). The analyses use :func:`assume` in a scope instead."""
    out = env.copy() if isinstance(env, Env) else Env(dict(env))
    return out if assume(out, cond, truth) else None


def assume(env: Env, cond: Expr, truth: bool) -> bool:
    """Add to ``env`` what ``cond == truth`` implies; ``False`` when that is impossible (``env``
    is then partly updated: callers assume inside a scope and close it)."""
    return _assume(env, cond, truth, 0)


def assumed(env: Env, cond: Expr, truth: bool, fn: Callable[[], Interval | None]) -> tuple[bool, Interval | None]:
    """``fn()`` evaluated with ``cond == truth`` assumed: ``(False, None)`` if that is impossible.
    The assumption lives in a scope closed afterwards, so it costs what the condition implies."""
    memo = env.memo  # intervals under the facts without the assumption: valid again afterwards
    env.open()
    try:
        ok = _assume(env, cond, truth, 0)
        return (True, fn()) if ok else (False, None)
    finally:
        env.close()
        env.memo = memo


def _assume(env: Env, c: Expr, truth: bool, depth: int) -> bool:
    b = bounds(c, env)
    if b == (int(not truth), int(not truth)):
        return False
    if depth > _MAX_DEPTH:
        return True
    if not contains_load(c) and not isinstance(c, Const):
        env.set(c, (int(truth), int(truth)))
    if isinstance(c, Var) and c.name in env.defs:
        return _assume(env, env.defs[c.name], truth, depth + 1)
    if isinstance(c, Unary) and c.op in ("logical_not", "bitwise_not") and c.dtype == DType.bool:
        return _assume(env, c.a, not truth, depth + 1)
    if isinstance(c, Binary) and c.dtype == DType.bool:
        if (c.op in ("bitwise_and", "minimum") and truth) or (c.op in ("bitwise_or", "maximum") and not truth):
            return _assume(env, c.a, truth, depth + 1) and _assume(env, c.b, truth, depth + 1)
        if c.op in CMP and c.a.dtype.is_int:
            return _assume_cmp(env, c.op if truth else CMP_NEGATE[c.op], c.a, c.b, depth)
    return True


def _assume_cmp(env: Env, op: str, x: Expr, y: Expr, depth: int) -> bool:
    a, b = _operand(x, env), _operand(y, env)
    assert a is not None and b is not None
    dlo, dhi = int_range(x.dtype)
    if op in ("gt", "ge"):
        op, x, y, a, b = CMP_SWAP[op], y, x, b, a
    if op == "lt":
        return _constrain(env, x, dlo, b[1] - 1, depth) and _constrain(env, y, a[0] + 1, dhi, depth)
    if op == "le":
        return _constrain(env, x, dlo, b[1], depth) and _constrain(env, y, a[0], dhi, depth)
    if op == "eq":
        return _constrain(env, x, b[0], b[1], depth) and _constrain(env, y, a[0], a[1], depth)
    # ne: only an excluded endpoint narrows an interval
    for e, i, o in ((x, a, b), (y, b, a)):
        if o[0] == o[1] and o[0] in i and not _constrain(
            env, e, i[0] + (i[0] == o[0]), i[1] - (i[1] == o[0]), depth
        ):
            return False
    return True


def _constrain(env: Env, e: Expr, lo: int, hi: int, depth: int) -> bool:
    """Record ``lo <= e <= hi`` and push it into the operands of ``e`` where that is exact."""
    cur = _operand(e, env)
    assert cur is not None
    nlo, nhi = max(lo, cur[0]), min(hi, cur[1])
    if nlo > nhi:
        return False
    if (nlo, nhi) == cur or contains_load(e) or depth > _MAX_DEPTH:
        return True
    exact = isinstance(e, Var | Special) or _compute(e, env) is not None  # the node itself never wraps
    env.set(e, (nlo, nhi))
    depth += 1
    if isinstance(e, Var) and e.name in env.defs:
        return _constrain(env, env.defs[e.name], nlo, nhi, depth)
    if isinstance(e, Cast) and e.a.dtype.is_int and exact:
        return _constrain(env, e.a, nlo, nhi, depth)
    if not isinstance(e, Binary) or not exact:  # a wrapped value says nothing about its operands
        return True
    a, b = _operand(e.a, env), _operand(e.b, env)
    assert a is not None and b is not None
    if e.op == "add":
        return _constrain(env, e.a, nlo - b[1], nhi - b[0], depth) and \
            _constrain(env, e.b, nlo - a[1], nhi - a[0], depth)
    if e.op == "sub":
        return _constrain(env, e.a, nlo + b[0], nhi + b[1], depth) and \
            _constrain(env, e.b, a[0] - nhi, a[1] - nlo, depth)
    if e.op == "mul":
        for x, k in ((e.a, e.b), (e.b, e.a)):
            if isinstance(k, Const) and isinstance(k.value, int) and k.value > 0:
                return _constrain(env, x, -((-nlo) // k.value), nhi // k.value, depth)
    return True
