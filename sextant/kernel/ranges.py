"""Interval (range) analysis of integer expressions in kernel IR, and a reference evaluator.

``bounds(expr, env)`` returns ``(lo, hi)`` such that every value ``expr`` can take lies in
``[lo, hi]``, or ``None`` when nothing useful is known. Bool expressions get intervals within
``[0, 1]`` (``(1, 1)``: always true), so comparisons decide themselves. Two properties make
the result usable for rewriting:

* **sound**: an interval always contains every value the (wrapping, two's complement)
  expression takes at run time;
* **no wrap**: an ``add``/``sub``/``mul``/``shl``/``neg`` gets an interval only when the exact
  mathematical result fits the type, so a bounded node provably did not overflow — the
  simplifier relies on this to move terms between divisions and sums.

The environment maps a :class:`Var`, a :class:`Special` or any load-free expression to an
interval (facts). :class:`Ranges` builds it for a kernel — thread coordinates from the launch
shape, loop variables from ``For`` bounds, registers from their assignments — and updates it
as statements execute: an ``If`` refines the facts of its condition in each branch
(``if (i < n)`` bounds ``i`` by ``n - 1``), an assignment invalidates facts that mention the
register. :func:`eval_expr` is the concrete counterpart, used by tests and the verifier.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch

from sextant.graph.dtypes import DType
from sextant.graph.reference import _BINARY, _UNARY  # the graph IR's float semantics
from sextant.kernel.ir import (
    ASYNC_COPY,
    INDEX,
    Assign,
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
    Special,
    Stmt,
    Store,
    Unary,
    Var,
    WarpReduce,
)

Interval = tuple[int, int]
_INTLIKE = (DType.i32, DType.i64, DType.bool)  # the types facts are about
Facts = Mapping[Expr, Interval]

CMP_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
CMP_SWAP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_CMP = {
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
}


# -- integer helpers ---------------------------------------------------------------------------
def _type_range(dtype: DType) -> Interval:
    if dtype == DType.bool:
        return (0, 1)
    bits = 8 * dtype.itemsize
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)


# per type, computed once: range analysis asks for these on every node it bounds
_RANGE = {dt: _type_range(dt) for dt in DType}
_INTLIKE_SET = frozenset(_INTLIKE)


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


def _fit(lo: int, hi: int, dtype: DType) -> Interval | None:
    dlo, dhi = int_range(dtype)
    return (lo, hi) if dlo <= lo and hi <= dhi else None


def _corners(f: Callable[[int, int], int], a: Interval, b: Interval) -> Interval:
    vals = [f(x, y) for x in a for y in b]
    return (min(vals), max(vals))


# -- expression walking ------------------------------------------------------------------------
def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Unary | Cast):
        return (e.a,)
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Load):
        return (e.index,)
    return ()


def free_names(e: Expr) -> frozenset[str]:
    """Names of the registers / loop variables ``e`` reads."""
    if isinstance(e, Var):
        return frozenset((e.name,))
    out: frozenset[str] = frozenset()
    for ch in children(e):
        out |= free_names(ch)
    return out


def contains_load(e: Expr) -> bool:
    return isinstance(e, Load) or any(contains_load(ch) for ch in children(e))


def assigned_names(stmts: Iterable[Stmt]) -> set[str]:
    """Registers written anywhere in ``stmts`` (loop variables of nested loops included)."""
    out: set[str] = set()
    for s in stmts:
        if isinstance(s, Assign | WarpReduce):
            out.add(s.var.name)
        elif isinstance(s, For):
            out.add(s.var.name)
            out |= assigned_names(s.body)
        elif isinstance(s, If):
            out |= assigned_names(s.then) | assigned_names(s.orelse)
    return out


# -- bounds ------------------------------------------------------------------------------------
@dataclass
class Env:
    """Facts valid at one program point, plus ``defs``: registers whose current value is still
    the load-free expression last assigned to them (so refining the register refines that).

    ``mentioned`` is a superset of the registers named inside a fact that is not about a lone
    register, or inside a def's value: forgetting a register outside it (the first assignment
    of a fresh register, the common case) touches only that register's own entries instead of
    scanning every fact, which made range analysis quadratic in a kernel's length.

    ``memo`` holds the intervals of compound expressions computed under the current facts (by
    ``id``, the expression kept alive beside its interval): the simplifier bounds every node
    of an expression bottom-up, and without it each call re-bounded the whole subtree. Every
    change to the facts drops it."""

    facts: dict[Expr, Interval] = field(default_factory=dict)
    defs: dict[str, Expr] = field(default_factory=dict)
    mentioned: set[str] | None = field(default=None, repr=False, compare=False)  # None: not computed yet
    undo: list[tuple[Expr, Interval | None]] | None = field(default=None, repr=False, compare=False)
    memo: dict[int, tuple[Expr, Interval | None]] | None = field(default=None, repr=False, compare=False)
    # the registers each fact key or def value reads, by ``id`` (the expression kept alive beside
    # them), shared by every copy: forgetting a register tests each fact, so they were recomputed
    # for every loop left and every register reassigned
    reads: dict[int, tuple[Expr, frozenset[str]]] = field(default_factory=dict, repr=False, compare=False)
    # when not None, collects the registers looked up and not found, in this env and its copies
    # (see register_ranges)
    misses: set[str] | None = field(default=None, repr=False, compare=False)

    def copy(self) -> Env:
        return Env(dict(self.facts), dict(self.defs), None if self.mentioned is None else set(self.mentioned),
                   reads=self.reads, misses=self.misses)

    def free_names(self, e: Expr) -> frozenset[str]:
        """:func:`free_names` of ``e``, computed once per expression."""
        hit = self.reads.get(id(e))
        if hit is None:
            hit = self.reads[id(e)] = (e, free_names(e))
        return hit[1]

    def names(self) -> set[str]:
        if self.mentioned is None:
            self.mentioned = set()
            for k in self.facts:
                if not isinstance(k, Var | Special):
                    self.mentioned |= self.free_names(k)
            for v in self.defs.values():
                self.mentioned |= self.free_names(v)
        return self.mentioned

    def set(self, key: Expr, value: Interval) -> None:
        """Record a fact (logged for :func:`_assumed`'s undo when a trial is open)."""
        if self.undo is not None:
            self.undo.append((key, self.facts.get(key)))
        self.facts[key] = value
        self.memo = None
        if self.mentioned is not None and not isinstance(key, Var | Special):
            self.mentioned |= self.free_names(key)

    def define(self, name: str, value: Expr) -> None:
        self.defs[name] = value
        if self.mentioned is not None:
            self.mentioned |= self.free_names(value)


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
        return _fit(a[0], a[1], dt)
    if isinstance(e, Select):
        return _select_bounds(e, env)
    if isinstance(e, Unary):
        a = _operand(e.a, env)
        if a is None:
            return (0, 1) if dt == DType.bool else None
        return _unary_bounds(e.op, a, dt)
    if isinstance(e, Binary):
        a, b = _operand(e.a, env), _operand(e.b, env)
        if a is None or b is None:
            return (0, 1) if dt == DType.bool else None
        if e.op in _CMP:
            return _cmp_bounds(e.op, a, b)
        return _binary_bounds(e.op, a, b, dt)
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
        reachable, part = _assumed(env, e.cond, truth, lambda branch=branch: _operand(branch, env))
        if reachable:
            parts.append(part)
    if not parts or any(p is None for p in parts):
        return None
    return (min(p[0] for p in parts), max(p[1] for p in parts))


def _cmp_bounds(op: str, a: Interval, b: Interval) -> Interval:
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


def _unary_bounds(op: str, a: Interval, dt: DType) -> Interval | None:
    lo, hi = a
    if op == "neg":
        return _fit(-hi, -lo, dt)
    if op == "abs":
        if lo >= 0:
            return a
        if hi <= 0:
            return _fit(-hi, -lo, dt)
        return _fit(0, max(-lo, hi), dt)
    if op == "sign":
        return (-1 if lo < 0 else 0 if lo == 0 else 1, 1 if hi > 0 else 0 if hi == 0 else -1)
    if op == "bitwise_not":
        return (1 - hi, 1 - lo) if dt == DType.bool else (-hi - 1, -lo - 1)
    if op == "logical_not":
        return (1 - hi, 1 - lo)
    if op in ("floor", "ceil", "round", "trunc"):
        return a
    return None


def _binary_bounds(op: str, a: Interval, b: Interval, dt: DType) -> Interval | None:
    bits = 8 * dt.itemsize
    if op == "add":
        return _fit(a[0] + b[0], a[1] + b[1], dt)
    if op == "sub":
        return _fit(a[0] - b[1], a[1] - b[0], dt)
    if op == "mul":
        return _fit(*_corners(lambda x, y: x * y, a, b), dt)
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
        return _fit(*_corners(tdiv, a, b), dt)
    if op == "floordiv" and not zero_in_b:
        return _fit(*_corners(lambda x, y: x // y, a, b), dt)
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
            return _fit(*_corners(lambda x, s: x << s, a, b), dt)
        return _corners(lambda x, s: x >> s, a, b)
    if op == "bitwise_and":
        his = [x[1] for x in (a, b) if x[0] >= 0]
        return (0, min(his)) if his else None
    if op in ("bitwise_or", "bitwise_xor") and a[0] >= 0 and b[0] >= 0:
        top = (1 << max(a[1], b[1]).bit_length()) - 1
        return (max(a[0], b[0]) if op == "bitwise_or" else 0, top)
    return None


# -- refinement by conditions ------------------------------------------------------------------
_MAX_DEPTH = 12


def refine(env: Env | Facts, cond: Expr, truth: bool = True) -> Env | None:
    """``env`` plus what ``cond == truth`` implies; ``None`` when that is impossible (the code
    it guards is unreachable)."""
    out = env.copy() if isinstance(env, Env) else Env(dict(env))
    return out if _assume(out, cond, truth, 0) else None


def _assumed(env: Env, cond: Expr, truth: bool, fn: Callable[[], Interval | None]) -> tuple[bool, Interval | None]:
    """``fn()`` evaluated with ``cond == truth`` assumed: ``(False, None)`` if that is impossible.

    Like :func:`refine` without copying the facts: the assumption is recorded in ``env`` and
    undone afterwards, so bounding a ``Select`` costs what its condition implies, not the
    size of the environment."""
    outer, env.undo = env.undo, []
    memo = env.memo  # intervals under the facts without the assumption: valid again afterwards
    try:
        ok = _assume(env, cond, truth, 0)
        return (True, fn()) if ok else (False, None)
    finally:
        for key, old in reversed(env.undo):
            if old is None:
                env.facts.pop(key, None)
            else:
                env.facts[key] = old
        env.undo = outer
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
        if c.op in _CMP and c.a.dtype.is_int:
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


# -- kernel-level facts ------------------------------------------------------------------------
def special_ranges(kernel: Kernel) -> dict[Expr, Interval]:
    """Thread and block coordinates from the launch shape, and size arguments from their declared
    ranges (with sizes, ``grid`` is a capacity: the block count is at most that, and ``gdim`` unknown)."""
    out: dict[Expr, Interval] = {}
    for i, axis in enumerate("xyz"):
        out[Special("tid", axis)] = (0, kernel.block[i] - 1)
        out[Special("bid", axis)] = (0, kernel.grid[i] - 1)
        out[Special("bdim", axis)] = (kernel.block[i], kernel.block[i])
        out[Special("gdim", axis)] = (1, kernel.grid[i]) if kernel.sizes else (kernel.grid[i], kernel.grid[i])
    for s in kernel.sizes:
        out[s.var] = (s.lo, min(s.hi, int_range(INDEX)[1]))
    return out


def loop_range(loop: For, env: Env | Facts, assigned: Collection[str] | None = None) -> Interval | bool | None:
    """The values the loop variable takes: an interval, ``None`` (unknown) or ``False`` when the
    loop provably runs no iteration. ``assigned``: the registers the loop writes, if known."""
    assigned = assigned if assigned is not None else assigned_names(loop.body) | {loop.var.name}
    if (free_names(loop.start) | free_names(loop.stop)) & assigned or loop.step == 0:
        return None  # bounds the body changes: no stable interval
    s, t = bounds(loop.start, env), bounds(loop.stop, env)
    if s is None or t is None:
        return None
    lo_d, hi_d = int_range(INDEX)
    step = loop.step
    if step > 0:
        if s[0] >= t[1]:
            return False
        if t[1] - 1 + step > hi_d:
            return None  # the increment could wrap around
        hi = t[1] - 1
        if s[0] == s[1]:
            hi = s[0] + (hi - s[0]) // step * step
        elif (span := _span(loop)) is not None:  # stop = start + span: at most span - 1 past start
            hi = min(hi, s[1] + (span - 1) // step * step)
        return (s[0], hi)
    if s[1] <= t[0]:
        return False
    if t[0] + 1 + step < lo_d:
        return None
    lo = t[0] + 1
    if s[0] == s[1]:
        lo = s[0] - (s[0] - lo) // -step * -step
    return (lo, s[1])


def _span(loop: For) -> int | None:
    """``k`` when the loop runs from ``start`` to ``start + k`` (a tile of ``k`` from a variable
    origin): its variable then stays within ``k - 1`` of the origin, which the intervals of
    ``start`` and ``stop`` alone do not say."""
    stop = loop.stop
    if isinstance(stop, Binary) and stop.op == "add" and stop.a == loop.start and isinstance(stop.b, Const) \
            and isinstance(stop.b.value, int) and not isinstance(stop.b.value, bool) and stop.b.value > 0:
        return stop.b.value
    return None


def _warp_bounds(s: WarpReduce, env: Env) -> Interval | None:
    b = bounds(s.value, env)
    if b is None or not s.var.dtype.is_int:
        return None
    if s.op in ("max", "min"):
        return b
    if s.op == "sum":
        return _fit(b[0] * s.width, b[1] * s.width, s.var.dtype)
    return None


@functools.lru_cache(maxsize=4096)
def _register_keys(name: str) -> tuple[Var, ...]:
    """The fact keys a register ``name`` can have (one per integer-like type)."""
    return tuple(Var(name, dt) for dt in _INTLIKE)


class Ranges:
    """How the facts change through a kernel's statements. ``base`` holds facts valid at every
    point (launch coordinates, register ranges); a register reassigned or a loop re-entered
    falls back to them."""

    def __init__(self, base: Mapping[Expr, Interval]) -> None:
        self.base = dict(base)
        self._base_vars: dict[str, list[Var]] = {}  # the registers ``base`` bounds, by name
        self._assigned: dict[int, tuple[tuple[Stmt, ...], str, frozenset[str]]] = {}
        for k in self.base:
            if isinstance(k, Var):
                self._base_vars.setdefault(k.name, []).append(k)

    @classmethod
    def for_kernel(cls, kernel: Kernel) -> Ranges:
        specials = special_ranges(kernel)
        return cls(specials | register_ranges(kernel, specials))

    def entry(self) -> Env:
        return Env(dict(self.base))

    def forget(self, env: Env, names: AbstractSet[str]) -> Env:
        """Drop what is known about values that read the registers ``names``; updates ``env``
        in place and returns it (callers that need the old facts copy first)."""
        if not names:
            return env
        facts, defs = env.facts, env.defs
        env.memo = None
        if not names.isdisjoint(env.names()):  # some fact or def reads them: scan, recompute ``mentioned``
            free, mentioned = env.free_names, set()
            kept = {}
            for k, v in facts.items():
                if isinstance(k, Var):
                    if k.name not in names:
                        kept[k] = v
                elif isinstance(k, Special):
                    kept[k] = v
                elif names.isdisjoint(reads := free(k)):
                    kept[k] = v
                    mentioned |= reads
            facts.clear()
            facts.update(kept)
            kept_defs = {}
            for k, v in defs.items():
                if k not in names and names.isdisjoint(reads := free(v)):
                    kept_defs[k] = v
                    mentioned |= reads
            defs.clear()
            defs.update(kept_defs)
            env.mentioned = mentioned
        else:  # only the registers' own entries can mention them
            for name in names:
                defs.pop(name, None)
                for key in _register_keys(name):
                    facts.pop(key, None)
        for name in names:
            for k in self._base_vars.get(name, ()):
                facts[k] = self.base[k]
        return env

    def assign(self, env: Env, var: Var, value: Expr | None, b: Interval | None = None) -> Env:
        """The facts after ``var = value`` (``value=None``: an unknown value bounded by ``b``);
        updates ``env`` in place and returns it."""
        if value is not None:
            b = bounds(value, env)
        out = self.forget(env, {var.name})
        b = intersect(self.base.get(var), b)
        if b is not None:
            out.facts[var] = b
            out.memo = None
        if value is not None and not contains_load(value) and var.name not in out.free_names(value):
            out.define(var.name, value)
        return out

    def enter_loop(self, env: Env, loop: For) -> Env | None:
        """Facts at the top of any iteration; ``None`` if the loop never runs."""
        r = loop_range(loop, env, self.assigned(loop))
        if r is False:
            return None
        out = self.forget(env.copy(), self.assigned(loop))
        if r is not None:
            out.facts[loop.var] = r  # type: ignore[assignment]
            out.memo = None
        return out

    def leave_loop(self, env: Env, loop: For) -> Env:
        """The facts after the loop (``env``, the facts before it, is updated in place)."""
        return self.forget(env, self.assigned(loop))

    def assigned(self, loop: For) -> frozenset[str]:
        """The registers ``loop`` writes, its variable included: computed once per loop body (each
        walk asks three times per loop, and the walk of an outer loop covers the inner ones)."""
        hit = self._assigned.get(id(loop.body))
        if hit is None or hit[1] != loop.var.name:
            names = frozenset(assigned_names(loop.body) | {loop.var.name})
            hit = self._assigned[id(loop.body)] = (loop.body, loop.var.name, names)
        return hit[2]

    def join(self, a: Env | None, b: Env | None) -> Env | None:
        """Facts after control flow merges from two points (``None``: unreachable)."""
        if a is None or b is None:
            return b if a is None else a
        facts = {k: h for k, v in a.facts.items() if k in b.facts and (h := hull(v, b.facts[k])) is not None}
        defs = {k: v for k, v in a.defs.items() if b.defs.get(k) == v}
        return Env(facts, defs, reads=a.reads, misses=a.misses)

    def walk(self, body: Iterable[Stmt], env: Env | None,
             visit: Callable[[Stmt, Env], None] | None = None) -> Env | None:
        """Run ``visit(stmt, facts before stmt)`` over ``body`` (nested statements included,
        unreachable ones skipped); returns the facts after ``body``. The facts are updated in
        place as the walk goes on: a visitor that keeps them must copy them."""
        for s in body:
            if env is None:
                return None
            if visit is not None:
                visit(s, env)
            env = self.step(s, env, visit)
        return env

    def step(self, s: Stmt, env: Env, visit: Callable[[Stmt, Env], None] | None = None) -> Env | None:
        if isinstance(s, Assign):
            return self.assign(env, s.var, s.value)
        if isinstance(s, WarpReduce):
            return self.assign(env, s.var, None, _warp_bounds(s, env))
        if isinstance(s, For):
            inner = self.enter_loop(env, s)
            if inner is not None:
                self.walk(s.body, inner, visit)
            return self.leave_loop(env, s)
        if isinstance(s, If):
            t = self.walk(s.then, refine(env, s.cond, True), visit)
            f = self.walk(s.orelse, refine(env, s.cond, False), visit)
            return self.join(t, f)
        assert isinstance(s, (Store, Barrier, Mma, LdMatrix, *ASYNC_COPY)), s  # no register effect
        return env


def register_ranges(kernel: Kernel, base: Mapping[Expr, Interval]) -> dict[Expr, Interval]:
    """Intervals valid wherever a register is read: the hull of every value assigned to it.

    Computed bottom-up: a register is bounded once all of its assignments are bounded using
    only registers already bounded, so a register that feeds itself (``acc = acc + 1``) stays
    unknown instead of getting a too-narrow interval.

    A walk with the registers bounded so far differs from the last one only where the last one
    looked a newly bounded register up and did not find it, so the walk that would only confirm
    the fixed point is skipped when no such lookup happened (for most kernels: the second)."""
    loop_vars: set[str] = set()

    def loops(stmts: Iterable[Stmt]) -> None:
        for s in stmts:
            if isinstance(s, For):
                loop_vars.add(s.var.name)
                loops(s.body)
            elif isinstance(s, If):
                loops(s.then)
                loops(s.orelse)

    loops(kernel.body)
    resolved: dict[Expr, Interval] = {}
    while True:
        new: dict[Expr, Interval] = {}
        misses: set[str] = set()
        for v, ivs in _assigned_bounds(kernel, Ranges(dict(base) | resolved), misses).items():
            if v.name in loop_vars or v in resolved or not is_intlike(v.dtype) or any(i is None for i in ivs):
                continue
            new[v] = (min(i[0] for i in ivs), max(i[1] for i in ivs))  # type: ignore[index]
        resolved.update(new)
        if not any(v.name in misses for v in new):  # the next walk would find what this one did
            return resolved


def _assigned_bounds(kernel: Kernel, walker: Ranges,
                     misses: set[str] | None = None) -> dict[Var, list[Interval | None]]:
    """The interval of every value assigned to each register (``None``: unknown); ``misses``
    collects the registers the walk looked up without finding them."""
    seen: dict[Var, list[Interval | None]] = {}
    types: dict[str, Var] = {}

    def visit(s: Stmt, env: Env) -> None:
        if isinstance(s, Assign | WarpReduce):
            b = bounds(s.value, env) if isinstance(s, Assign) else _warp_bounds(s, env)
            seen.setdefault(s.var, []).append(b)
            if types.setdefault(s.var.name, s.var) != s.var:  # one name, two types: give up on it
                seen[s.var].append(None)
                seen.setdefault(types[s.var.name], []).append(None)

    env = walker.entry()
    env.misses = misses
    walker.walk(kernel.body, env, visit)
    return seen


# -- concrete evaluation -----------------------------------------------------------------------
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
    if op in _CMP:
        return _CMP[op](a, b)
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
        fn = _UNARY[op]
        return lambda values, load: fn(_float(fa(values, load), src)).item()
    raise TypeError(f"not an expression: {expr!r}")


def _compile_binary(e: Binary) -> Compiled:
    fa, fb, dt = compile_expr(e.a), compile_expr(e.b), e.a.dtype
    if not is_intlike(dt):
        da, db = e.a.dtype, e.b.dtype
        fn = _BINARY[e.op] if e.op != "div" else lambda x, y: torch.div(x, y)

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
    if op in _CMP:
        return _CMP[op]
    if dt != DType.bool and op in _WRAPPING:
        f, (lo, hi) = _WRAPPING[op], _RANGE[dt]

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
