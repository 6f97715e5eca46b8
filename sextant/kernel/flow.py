"""How range facts flow through a kernel's statements: launch shape, loops, branches, assignments.

:class:`Ranges` starts from facts valid everywhere (thread coordinates from the launch shape,
size arguments from their declared ranges, each register's range over all its assignments) and
walks statements updating one :class:`Env` in place: an assignment bounds its register, a loop
bounds its variable (and forgets what its body changes), an ``If`` refines its condition in each
branch and joins the two outcomes (the hull of each fact either branch changed).

The walk is linear in the kernel: a branch or loop body runs in a scope of the environment and
costs what it changes (:mod:`sextant.kernel.facts`); loop bodies' written registers are computed
once per loop; :func:`register_ranges` walks the kernel a bounded number of times.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet

from sextant.kernel.exprs import assigned_names, contains_load, free_names
from sextant.kernel.facts import Delta, Env, assume, bounds
from sextant.kernel.intervals import Interval, fit, hull, int_range, intersect, is_intlike
from sextant.kernel.ir import (
    ASYNC_COPY,
    CPU_MATRIX,
    HOPPER,
    INDEX,
    Assign,
    AtomicAdd,
    Barrier,
    Binary,
    Const,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Mma,
    Special,
    Stmt,
    Store,
    Var,
    WarpReduce,
)
from sextant.work import WorkCounter

Visit = Callable[[Stmt, Env], None]
# the statement being visited and its enclosing ones: (statement list, position, branch taken
# for an ``If`` being walked into, else None), outermost first
Frame = tuple[tuple[Stmt, ...], int, bool | None]
# walks of the kernel register_ranges makes at most: each one after the first bounds registers
# read where an earlier walk had no fact for them (after the loop that assigns them); deeper
# chains stay unknown, which is sound
MAX_REGISTER_WALKS = 3


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


def loop_range(loop: For, env: Env | Mapping[Expr, Interval],
               assigned: Collection[str] | None = None) -> Interval | bool | None:
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


def warp_bounds(s: WarpReduce, env: Env) -> Interval | None:
    b = bounds(s.value, env)
    if b is None or not s.var.dtype.is_int:
        return None
    if s.op in ("max", "min"):
        return b
    if s.op == "sum":
        return fit(b[0] * s.width, b[1] * s.width, s.var.dtype)
    return None


class Ranges:
    """How the facts change through a kernel's statements. ``base`` holds facts valid at every
    point (launch coordinates, register ranges); a register reassigned or a loop re-entered
    falls back to them. ``path`` is the statement being visited during :meth:`walk` and its
    enclosing ones (for visitors that need to know where they are)."""

    def __init__(self, base: Mapping[Expr, Interval], work: WorkCounter | None = None) -> None:
        self.base = dict(base)
        self.work = work
        self.path: list[list] = []  # [statements, position, branch] per level (see Frame)
        self._base_vars: dict[str, list[Var]] = {}  # the registers ``base`` bounds, by name
        self._assigned: dict[int, tuple[tuple[Stmt, ...], str, frozenset[str]]] = {}
        for k in self.base:
            if isinstance(k, Var):
                self._base_vars.setdefault(k.name, []).append(k)

    @classmethod
    def for_kernel(cls, kernel: Kernel, work: WorkCounter | None = None) -> Ranges:
        specials = special_ranges(kernel)
        return cls(specials | register_ranges(kernel, specials, work), work)

    def entry(self) -> Env:
        return Env(dict(self.base), work=self.work)

    def frames(self) -> tuple[Frame, ...]:
        """:attr:`path` as it is now, frozen."""
        return tuple((f[0], f[1], f[2]) for f in self.path)

    # -- single changes --------------------------------------------------------------------------
    def forget(self, env: Env, names: AbstractSet[str]) -> Env:
        """Drop what is known about values that read the registers ``names`` (they fall back to
        their base facts); updates ``env`` in place and returns it."""
        if not names:
            return env
        if self.work is not None:
            self.work.add("ranges: registers forgotten", len(names))
        env.forget(names)
        for name in names:
            for k in self._base_vars.get(name, ()):
                env.set(k, self.base[k])
        return env

    def assign(self, env: Env, var: Var, value: Expr | None, b: Interval | None = None) -> Env:
        """The facts after ``var = value`` (``value=None``: an unknown value bounded by ``b``);
        updates ``env`` in place and returns it."""
        if value is not None:
            b = bounds(value, env)
        self.forget(env, {var.name})
        b = intersect(self.base.get(var), b)
        if b is not None:
            env.set(var, b)
        if value is not None and not contains_load(value) and var.name not in env.free_names(value):
            env.define(var.name, value)
        return env

    def assigned(self, loop: For) -> frozenset[str]:
        """The registers ``loop`` writes, its variable included: computed once per loop body (each
        walk asks three times per loop, and the walk of an outer loop covers the inner ones)."""
        hit = self._assigned.get(id(loop.body))
        if hit is None or hit[1] != loop.var.name:
            names = frozenset(assigned_names(loop.body) | {loop.var.name})
            hit = self._assigned[id(loop.body)] = (loop.body, loop.var.name, names)
        return hit[2]

    # -- loops and branches, as scopes of one environment ----------------------------------------
    def enter_loop(self, env: Env, loop: For) -> bool:
        """Open the loop body's scope: the facts at the top of any iteration. ``False`` if the
        loop never runs (the scope is open all the same: :meth:`leave_loop` closes it)."""
        assigned = self.assigned(loop)
        r = loop_range(loop, env, assigned)
        env.open()
        if r is False:
            return False
        self.forget(env, assigned)
        if r is not None:
            env.set(loop.var, r)  # type: ignore[arg-type]
        return True

    def leave_loop(self, env: Env, loop: For) -> Env:
        """Close the loop body's scope: the facts after the loop (those before it, less what the
        body changes)."""
        env.close()
        return self.forget(env, self.assigned(loop))

    def enter_branch(self, env: Env, cond: Expr, truth: bool) -> bool:
        """Open a branch's scope with ``cond == truth`` assumed; ``False`` if the branch is
        unreachable (the scope is open all the same: :meth:`leave_branch` closes it)."""
        env.open()
        return assume(env, cond, truth)

    def leave_branch(self, env: Env, reachable: bool) -> Delta | None:
        """Close a branch's scope; what it changed (``None``: its end is unreachable)."""
        delta = env.delta() if reachable else None
        env.close()
        return delta

    def decided(self, env: Env, cond: Expr) -> tuple[bool, bool]:
        """Whether each branch of ``if (cond)`` can be reached: (then, else)."""
        out = []
        for truth in (True, False):
            out.append(self.enter_branch(env, cond, truth))
            env.close()
        return out[0], out[1]

    def join(self, env: Env, then: Delta | None, orelse: Delta | None) -> bool:
        """The facts after two branches merge: each fact either branch changed becomes the hull
        of its two values (dropped where one branch has none), each def survives where both
        agree. ``env`` holds the facts before the branches; ``False``: neither end is reachable."""
        if then is None or orelse is None:
            if then is None and orelse is None:
                return False
            env.apply(then if orelse is None else orelse)  # type: ignore[arg-type]
            return True
        facts, defs = env.facts, env.defs
        for key in then[0].keys() | orelse[0].keys():
            t = then[0][key] if key in then[0] else facts.get(key)
            f = orelse[0][key] if key in orelse[0] else facts.get(key)
            h = hull(t, f)
            if h is None:
                env.drop(key)
            elif h != facts.get(key):
                env.set(key, h)
        for name in then[1].keys() | orelse[1].keys():
            t = then[1][name] if name in then[1] else defs.get(name)
            f = orelse[1][name] if name in orelse[1] else defs.get(name)
            if t is None or t != f:
                env.define(name, None)
            elif t != defs.get(name):
                env.define(name, t)
        return True

    # -- walking -----------------------------------------------------------------------------------
    def walk(self, body: Iterable[Stmt], env: Env | None, visit: Visit | None = None) -> Env | None:
        """Run ``visit(stmt, facts before stmt)`` over ``body`` (nested statements included,
        unreachable ones skipped); returns the facts after ``body`` (``None``: unreachable). The
        facts are updated in place as the walk goes on: a visitor that keeps them must copy them."""
        if env is None:
            return None
        return env if self._walk(tuple(body), env, visit) else None

    def _walk(self, body: tuple[Stmt, ...], env: Env, visit: Visit | None) -> bool:
        frame: list = [body, 0, None]
        self.path.append(frame)
        try:
            for pos, s in enumerate(body):
                frame[1] = pos
                if visit is not None:
                    visit(s, env)
                if not self._step(s, env, visit, frame):
                    return False
            return True
        finally:
            self.path.pop()

    def step(self, s: Stmt, env: Env, visit: Visit | None = None) -> Env | None:
        """The facts after ``s`` (``env`` updated in place; ``None``: unreachable)."""
        return env if self._step(s, env, visit, [(s,), 0, None]) else None

    def _step(self, s: Stmt, env: Env, visit: Visit | None, frame: list) -> bool:
        if self.work is not None:
            self.work.add("ranges: steps")
        if isinstance(s, Assign):
            self.assign(env, s.var, s.value)
            return True
        if isinstance(s, WarpReduce):
            self.assign(env, s.var, None, warp_bounds(s, env))
            return True
        if isinstance(s, For):
            if self.enter_loop(env, s):
                self._walk(s.body, env, visit)
            self.leave_loop(env, s)
            return True
        if isinstance(s, If):
            ends = []
            for truth, body in ((True, s.then), (False, s.orelse)):
                frame[2] = truth
                reachable = self.enter_branch(env, s.cond, truth) and self._walk(body, env, visit)
                ends.append(self.leave_branch(env, reachable))
            frame[2] = None
            return self.join(env, ends[0], ends[1])
        # no register effect
        assert isinstance(s, (Store, AtomicAdd, Barrier, Mma, LdMatrix, *CPU_MATRIX, *ASYNC_COPY, *HOPPER)), s
        return True


def register_ranges(kernel: Kernel, base: Mapping[Expr, Interval],
                    work: WorkCounter | None = None) -> dict[Expr, Interval]:
    """Intervals valid wherever a register is read: the hull of every value assigned to it.

    Computed bottom-up: a register is bounded once all of its assignments are bounded using
    only registers already bounded, so a register that feeds itself (``acc = acc + 1``) stays
    unknown instead of getting a too-narrow interval.

    A walk with the registers bounded so far differs from the last one only where the last one
    looked a newly bounded register up and did not find it, so the walk that would only confirm
    the fixed point is skipped when no such lookup happened (for most kernels: the second).
    At most :data:`MAX_REGISTER_WALKS` walks are made."""
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
    for _ in range(MAX_REGISTER_WALKS):
        if work is not None:
            work.add("ranges: register walks")
        new: dict[Expr, Interval] = {}
        misses: set[str] = set()
        for v, ivs in _assigned_bounds(kernel, Ranges(dict(base) | resolved, work), misses).items():
            if v.name in loop_vars or v in resolved or not is_intlike(v.dtype) or any(i is None for i in ivs):
                continue
            new[v] = (min(i[0] for i in ivs), max(i[1] for i in ivs))  # type: ignore[index]
        resolved.update(new)
        if not any(v.name in misses for v in new):  # the next walk would find what this one did
            break
    return resolved


def _assigned_bounds(kernel: Kernel, walker: Ranges,
                     misses: set[str] | None = None) -> dict[Var, list[Interval | None]]:
    """The interval of every value assigned to each register (``None``: unknown); ``misses``
    collects the registers the walk looked up without finding them."""
    seen: dict[Var, list[Interval | None]] = {}
    types: dict[str, Var] = {}

    def visit(s: Stmt, env: Env) -> None:
        if isinstance(s, Assign | WarpReduce):
            b = bounds(s.value, env) if isinstance(s, Assign) else warp_bounds(s, env)
            seen.setdefault(s.var, []).append(b)
            if types.setdefault(s.var.name, s.var) != s.var:  # one name, two types: give up on it
                seen[s.var].append(None)
                seen.setdefault(types[s.var.name], []).append(None)

    env = walker.entry()
    env.misses = misses
    walker.walk(kernel.body, env, visit)
    return seen
