"""SIMT on a sequential machine: how a block's threads run one after another on the CPU.

A GPU runs a block's threads together; a barrier (or a warp reduction) makes every thread
finish the code before it before any thread runs the code after it. On the CPU a block's
threads become a loop, so each barrier *cuts* the body (loop fission): the body becomes a
sequence of **phases**, and each phase is wrapped in its own loop over the block's threads.

* A ``For`` or ``If`` that contains a barrier cannot sit inside a thread loop, so it stays
  outside (a :class:`UniformFor` / :class:`UniformIf`) and its body is cut recursively. That is
  only correct when every thread takes the same path, so its bounds / condition must be
  thread-uniform (no ``tid``, no loads); anything else is rejected.
* A ``WarpReduce`` is a cut too: at the end of one phase each thread writes its operand into a
  per-thread exchange array (:class:`XchgStore`); the next phase starts with each thread
  reducing the lanes of its group (:class:`XchgReduce`).
* A thread-dependent ``If`` may hold warp reductions (``if tid < 32: WarpReduce``, as in a
  block reduction's last step; all lanes of a warp must agree): its condition is saved per
  thread and each phase of its branches runs under it. A barrier there is rejected.
* A register whose value flows from one phase into another (a read not preceded, in the same
  phase, by the same thread's assignment) cannot be one scalar shared by the thread loop: it
  becomes a per-thread array indexed by the linear thread id. Registers only used within a
  phase stay scalars. ``local`` buffers used by more than one phase, or in a phase that runs
  repeatedly inside a uniform loop, become per-thread arrays too.

* An ``Mma`` or ``LdMatrix`` (a warp computing together) is a cut as well: the phase before it
  ends with each lane publishing its operands (:class:`MmaStage` scatters its A/B fragments into
  per-warp matrices by the PTX ISA's layout; :class:`LdmStage` stores its row address), and the
  next phase starts with each lane computing what the hardware would give it (:class:`MmaCompute`
  — its D fragment from the warp's matrices and its own C; :class:`LdmRead` — its elements of
  the rows its warp's lanes addressed). ``cp.async`` copies complete at once on the CPU. A
  ``Wgmma`` whose A is in registers is cut the same way (:class:`WgmmaStage` publishes each
  thread's A fragment into its warpgroup's 64×16 matrix, :class:`WgmmaCompute` computes).

* An ``MbarrierWait`` is a cut like a barrier (asynchronous copies complete at once on the CPU, so
  every thread having run the code before it is what the wait guarantees); it stays at the start
  of the next phase, where the checked build verifies that the awaited phase did complete.

* Barriers leave no trace in the plan unless asked (``mark_barriers``): then a :class:`Sync`
  marks each, because the race checker (``race_check``) must tell a barrier, which orders
  shared memory, from a phase boundary cut by a ``WarpReduce``, which does not.

This module only analyses the kernel IR; ``llvm_cpu`` emits the loops.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from sextant.codegen.errors import CodegenError
from sextant.graph.dtypes import DType
from sextant.kernel.fragments import WARP, MmaShape, mma_shape
from sextant.kernel.ir import (
    Assign,
    AtomicAdd,
    Barrier,
    Binary,
    Cast,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Load,
    MbarrierWait,
    Mma,
    RegMatrix,
    Select,
    Special,
    Stmt,
    Store,
    Unary,
    Var,
    WarpReduce,
    Wgmma,
    iter_stmts,
    stmt_operands,
)
from sextant.kernel.wgmma import WARPGROUP, WGMMA_M

WARP_OPS = ("sum", "max", "min", "prod")
_AXES = {"x": 0, "y": 1, "z": 2}


# -- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class XchgStore:
    """End of a phase: this thread's ``WarpReduce`` operand goes to ``slot[linear tid]``."""

    slot: str
    value: Expr


@dataclass(frozen=True, slots=True)
class XchgReduce:
    """Start of a phase: ``var = op(slot[lane] for the lanes of this thread's group)``."""

    var: Var
    op: str
    width: int
    slot: str


@dataclass(frozen=True, slots=True)
class MmaStage:
    """End of a phase: this lane scatters its A and B fragments of ``mma`` into its warp's
    ``slot_a`` (M×K) and ``slot_b`` (K×N) matrices."""

    mma: Mma
    slot_a: str
    slot_b: str


@dataclass(frozen=True, slots=True)
class MmaCompute:
    """Start of a phase: this lane's D fragment = its warp's A·B (from the slots) + its own C."""

    mma: Mma
    slot_a: str
    slot_b: str


@dataclass(frozen=True, slots=True)
class LdmStage:
    """End of a phase: this lane's ``ldmatrix`` row address goes to ``slot[linear tid]``."""

    ldm: LdMatrix
    slot: str


@dataclass(frozen=True, slots=True)
class LdmRead:
    """Start of a phase: this lane reads its elements of the rows its warp's lanes addressed."""

    ldm: LdMatrix
    slot: str


@dataclass(frozen=True, slots=True)
class WgmmaStage:
    """End of a phase: this thread scatters its register A fragment of ``wgmma`` into its
    warpgroup's 64×16 matrix in ``slot``."""

    wgmma: Wgmma
    slot: str


@dataclass(frozen=True, slots=True)
class WgmmaCompute:
    """Start of a phase: this thread's accumulators of ``wgmma``, A read from its warpgroup's
    matrix in ``slot``."""

    wgmma: Wgmma
    slot: str


PhaseStmt = Stmt | XchgStore | XchgReduce | MmaStage | MmaCompute | LdmStage | LdmRead | WgmmaStage | WgmmaCompute


@dataclass
class Phase:
    """Statements that run, for each thread of the block in turn, without synchronising."""

    stmts: tuple[PhaseStmt, ...]
    index: int
    in_loop: bool  # inside a UniformFor: runs once per iteration


@dataclass
class UniformFor:
    """A loop with a barrier in its body; runs outside the thread loops (thread-uniform bounds)."""

    loop: For
    body: list[Item]


@dataclass
class UniformIf:
    cond: Expr
    then: list[Item]
    orelse: list[Item]


@dataclass(frozen=True, slots=True)
class Sync:
    """Where a ``Barrier`` was (only in plans made with ``mark_barriers=True``): nothing to run on
    the CPU, where the phase boundary already orders the threads, but the race checker starts a
    new epoch of shared memory here."""


Item = Phase | UniformFor | UniformIf | Sync


@dataclass
class SimtPlan:
    """How one kernel's body runs on the CPU."""

    threads: int
    items: list[Item]
    var_types: dict[str, DType]
    per_thread_vars: frozenset[str] = frozenset()  # registers live across a phase boundary
    uniform_loop_vars: frozenset[str] = frozenset()  # loop variables of UniformFor loops
    per_thread_locals: frozenset[str] = frozenset()  # local buffers that need one copy per thread
    exchanges: dict[str, DType] = field(default_factory=dict)  # WarpReduce/Mma/LdMatrix exchange arrays
    exchange_sizes: dict[str, int] = field(default_factory=dict)  # elements, where not one per thread


# -- expression helpers -----------------------------------------------------------------------
def iter_expr(e: Expr) -> Iterator[Expr]:
    """Every sub-expression of ``e`` once (shared sub-trees are visited once)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        if isinstance(x, Unary | Cast):
            stack.append(x.a)
        elif isinstance(x, Binary):
            stack += (x.a, x.b)
        elif isinstance(x, Select):
            stack += (x.cond, x.a, x.b)
        elif isinstance(x, Load):
            stack.append(x.index)


def expr_vars(e: Expr) -> set[str]:
    return {x.name for x in iter_expr(e) if isinstance(x, Var)}


def expr_loads(e: Expr) -> set[str]:
    return {x.buffer for x in iter_expr(e) if isinstance(x, Load)}


def stmt_exprs(s: PhaseStmt) -> tuple[Expr, ...]:
    """The expressions a statement evaluates itself (not those of nested bodies)."""
    if isinstance(s, Assign):
        return (s.value,)
    if isinstance(s, Store | AtomicAdd):
        return (s.index, s.value)
    if isinstance(s, For):
        return (s.start, s.stop)
    if isinstance(s, If):
        return (s.cond,)
    if isinstance(s, WarpReduce | XchgStore):
        return (s.value,)
    if isinstance(s, MmaStage):
        return (s.mma.a_off, s.mma.b_off)
    if isinstance(s, MmaCompute):
        return (s.mma.c_off, s.mma.d_off)
    if isinstance(s, LdmStage):
        return (s.ldm.index,)
    if isinstance(s, LdmRead):
        return (s.ldm.dst_off,)
    if isinstance(s, WgmmaStage):
        return (s.wgmma.a.offset,)
    if isinstance(s, WgmmaCompute):
        return (s.wgmma.d_off, s.wgmma.b.offset)
    return stmt_operands(s)  # type: ignore[arg-type]


def has_sync(s: Stmt) -> bool:
    if isinstance(s, Barrier | WarpReduce | Mma | LdMatrix | MbarrierWait):
        return True
    if isinstance(s, Wgmma) and isinstance(s.a, RegMatrix):  # A gathered from the warpgroup's registers
        return True
    if isinstance(s, For):
        return any(has_sync(x) for x in s.body)
    if isinstance(s, If):
        return any(has_sync(x) for x in (*s.then, *s.orelse))
    return False


def jam_roles(s: If) -> tuple[Stmt, ...] | None:
    """A thread-dependent ``If`` whose branches each run one synchronising loop over the same
    variable and bounds — warp-specialised roles (a producer's loop, the consumers') — as one loop
    whose body branches, the rest of each branch before and after it (straight-line code, whose
    waits and warp reductions the predicated branches handle). The roles then advance
    iteration by iteration, which is one of the interleavings a GPU may run (each role's waits
    still checked); run as written, the first role would wait on the second before it started.
    A branch whose loop lost its waits (the schedule's simplifier can prove them never taken) runs
    whole before the other's loop. None when ``s`` is not of that form."""
    def parts(body: tuple[Stmt, ...]) -> tuple[tuple[Stmt, ...], For | None, tuple[Stmt, ...]] | None:
        at = [i for i, x in enumerate(body) if isinstance(x, For) and has_sync(x)]
        if not at:
            return body, None, ()
        if len(at) != 1:
            return None
        loop = body[at[0]]
        assert isinstance(loop, For)
        return body[:at[0]], loop, body[at[0] + 1:]

    a, b = parts(s.then), parts(s.orelse)
    if a is None or b is None or (a[1] is None and b[1] is None):
        return None
    (pre_t, lt, post_t), (pre_e, le, post_e) = a, b
    loop = lt or le
    assert loop is not None
    if lt is not None and le is not None and (lt.var, lt.start, lt.stop, lt.step) != (
            le.var, le.start, le.stop, le.step):
        return None
    body = If(s.cond, lt.body if lt is not None else (), le.body if le is not None else ())
    return (If(s.cond, pre_t, pre_e), For(loop.var, loop.start, loop.stop, loop.step, (body,)),
            If(s.cond, post_t, post_e))


def strip_sync(stmts: Sequence[Stmt]) -> tuple[Stmt, ...]:
    """The body as a one-thread block runs it: barriers vanish, a warp reduction of one lane
    is its operand."""
    out: list[Stmt] = []
    for s in stmts:
        if isinstance(s, Barrier):
            continue
        if isinstance(s, WarpReduce):
            out.append(Assign(s.var, s.value))
        elif isinstance(s, For):
            out.append(For(s.var, s.start, s.stop, s.step, strip_sync(s.body), s.unroll))
        elif isinstance(s, If):
            out.append(If(s.cond, strip_sync(s.then), strip_sync(s.orelse)))
        else:
            out.append(s)
    return tuple(out)


# -- uniformity ---------------------------------------------------------------------------------
class _Uniformity:
    """Which registers hold the same value in every thread of a block (optimistic fixpoint:
    a register is uniform unless some assignment to it is thread-dependent)."""

    def __init__(self, body: Sequence[Stmt], block: tuple[int, int, int], sizes: Sequence[str] = ()):
        self.block = block
        self.sizes = frozenset(sizes)  # size arguments: the same in every thread, never assigned
        self.vars: set[str] = {v.name for s in iter_stmts(body) for v in _defined(s)} | self.sizes
        changed = True
        while changed:
            before = len(self.vars)
            self._walk(body, True)
            changed = len(self.vars) != before

    def expr(self, e: Expr) -> bool:
        for x in iter_expr(e):
            if isinstance(x, Load):
                return False
            if isinstance(x, Var) and x.name not in self.vars:
                return False
            if isinstance(x, Special) and x.kind == "tid" and self.block[_AXES[x.axis]] != 1:
                return False
        return True

    def _walk(self, stmts: Sequence[Stmt], ctx: bool) -> None:
        for s in stmts:
            if isinstance(s, Assign):
                if not (ctx and self.expr(s.value)):
                    self.vars.discard(s.var.name)
            elif isinstance(s, WarpReduce):
                self.vars.discard(s.var.name)
            elif isinstance(s, For):
                inner = ctx and self.expr(s.start) and self.expr(s.stop)
                if not inner:
                    self.vars.discard(s.var.name)
                self._walk(s.body, inner)
            elif isinstance(s, If):
                inner = ctx and self.expr(s.cond)
                self._walk(s.then, inner)
                self._walk(s.orelse, inner)


def _defined(s: Stmt) -> tuple[Var, ...]:
    if isinstance(s, Assign | WarpReduce):
        return (s.var,)
    if isinstance(s, For):
        return (s.var,)
    return ()


# -- planning -------------------------------------------------------------------------------------
def plan_kernel(kernel: Kernel, *, mark_barriers: bool = False) -> SimtPlan:
    """Cut ``kernel``'s body into phases and decide where each register and local buffer lives.

    ``mark_barriers`` keeps a :class:`Sync` item where each ``Barrier`` was, which the race
    checker needs to tell a barrier from a phase boundary made by a ``WarpReduce``."""
    threads = kernel.threads_per_block
    body = strip_sync(kernel.body) if threads == 1 else kernel.body
    var_types = register_types(kernel, body)
    if threads == 1 or not any(has_sync(s) for s in body):
        return SimtPlan(threads, [Phase(tuple(body), 0, False)] if body else [], var_types)
    planner = _Planner(kernel, _Uniformity(body, kernel.block, [s.var.name for s in kernel.sizes]), mark_barriers)
    items = planner.split(body, False)
    live = _Liveness(planner.uniform_loop_vars)
    live.items(items, frozenset())
    per_thread_locals = frozenset(
        name for name, phases in live.local_phases.items()
        if len(phases) > 1 or name in live.local_in_loop
    )
    locals_ = {b.name for b in kernel.local}
    sizes = {s.var.name for s in kernel.sizes}  # set once on entry and never written: one slot for all threads
    return SimtPlan(threads, items, var_types | planner.extra_vars,
                    frozenset(live.cross - planner.uniform_loop_vars - sizes),
                    frozenset(planner.uniform_loop_vars), per_thread_locals & locals_, planner.exchanges,
                    planner.exchange_sizes)


def register_types(kernel: Kernel, body: Sequence[Stmt]) -> dict[str, DType]:
    """Every register's dtype (one per name), checking that each is assigned somewhere; shared by the
    CPU (SIMT) and NVPTX lowerings."""
    types: dict[str, DType] = {}
    assigned: set[str] = {s.var.name for s in kernel.sizes}  # size arguments: set on entry

    def note(v: Var) -> None:
        if types.setdefault(v.name, v.dtype) != v.dtype:
            raise CodegenError(f"kernel {kernel.name}: register {v.name!r} is used both as "
                               f"{types[v.name].value} and {v.dtype.value}")

    for s in iter_stmts(body):
        for v in _defined(s):
            note(v)
            assigned.add(v.name)
        for e in stmt_exprs(s):
            for x in iter_expr(e):
                if isinstance(x, Var):
                    note(x)
    unassigned = sorted(set(types) - assigned)
    if unassigned:
        raise CodegenError(f"kernel {kernel.name}: register(s) {', '.join(unassigned)} are read but never assigned")
    return types


class _Planner:
    def __init__(self, kernel: Kernel, uniform: _Uniformity, mark_barriers: bool = False):
        self.kernel = kernel
        self.mark_barriers = mark_barriers
        self.uniform = uniform
        self.uniform_loop_vars: set[str] = set()
        self.exchanges: dict[str, DType] = {}
        self.exchange_sizes: dict[str, int] = {}
        self.extra_vars: dict[str, DType] = {}  # predicates saved across phases
        self._phases = 0

    def _fail(self, what: str, e: Expr) -> CodegenError:
        return CodegenError(
            f"kernel {self.kernel.name}: {what} contains a barrier or WarpReduce, so on the CPU it runs outside "
            f"the loop over the block's threads and must be thread-uniform, but {e!r} is not (it reads tid, "
            "memory, or a thread-dependent register)")

    def split(self, stmts: Sequence[Stmt], in_loop: bool) -> list[Item]:
        items: list[Item] = []
        cur: list[PhaseStmt] = []

        def flush() -> None:
            if cur:
                items.append(Phase(tuple(cur), self._phases, in_loop))
                self._phases += 1
                cur.clear()

        for s in stmts:
            if not has_sync(s):
                cur.append(s)
            elif isinstance(s, Barrier):
                flush()
                if self.mark_barriers:
                    items.append(Sync())
            elif isinstance(s, MbarrierWait):  # every thread ran what precedes it: a barrier that checks the phase
                flush()
                if self.mark_barriers:
                    items.append(Sync())
                cur.append(s)
            elif isinstance(s, WarpReduce):
                self._check_warp(s)
                slot = f"xchg{len(self.exchanges)}"
                self.exchanges[slot] = s.var.dtype
                cur.append(XchgStore(slot, s.value))
                flush()
                cur.append(XchgReduce(s.var, s.op, s.width, slot))
            elif isinstance(s, Mma):
                shape = self._mma_shape(s)
                slot_a, slot_b = f"xchg{len(self.exchanges)}", f"xchg{len(self.exchanges) + 1}"
                warps = self.kernel.threads_per_block // WARP
                self.exchanges[slot_a] = self.exchanges[slot_b] = self.kernel.buffer(s.a).dtype
                self.exchange_sizes[slot_a] = warps * shape.m * shape.k
                self.exchange_sizes[slot_b] = warps * shape.k * shape.n
                cur.append(MmaStage(s, slot_a, slot_b))
                flush()
                cur.append(MmaCompute(s, slot_a, slot_b))
            elif isinstance(s, Wgmma) and isinstance(s.a, RegMatrix):
                slot = f"xchg{len(self.exchanges)}"
                self.exchanges[slot] = self.kernel.buffer(s.a.buffer).dtype
                self.exchange_sizes[slot] = self.kernel.threads_per_block // WARPGROUP * WGMMA_M * 16
                cur.append(WgmmaStage(s, slot))
                flush()
                cur.append(WgmmaCompute(s, slot))
            elif isinstance(s, LdMatrix):
                slot = f"xchg{len(self.exchanges)}"
                self.exchanges[slot] = DType.i32
                cur.append(LdmStage(s, slot))
                flush()
                cur.append(LdmRead(s, slot))
            elif isinstance(s, For):
                for bound in (s.start, s.stop):
                    if not self.uniform.expr(bound):
                        raise self._fail(f"the loop over {s.var.name}", bound)
                flush()
                self.uniform_loop_vars.add(s.var.name)
                items.append(UniformFor(s, self.split(s.body, True)))
            elif isinstance(s, If) and self.uniform.expr(s.cond):
                flush()
                items.append(UniformIf(s.cond, self.split(s.then, in_loop), self.split(s.orelse, in_loop)))
            elif isinstance(s, If) and (jammed := jam_roles(s)) is not None:
                flush()
                items.extend(self.split(jammed, in_loop))
            elif isinstance(s, If):
                # a thread-dependent If around warp reductions (``if tid < 32: WarpReduce``) or
                # mbarrier waits (a producer's): the condition is saved per thread and each phase
                # of the branches runs under it, the cuts of either branch cuts for the block
                pred = Var(f"__pred{len(self.extra_vars)}", DType.bool)
                self.extra_vars[pred.name] = DType.bool
                then, orelse = self._predicated(s.then, s.cond, in_loop), self._predicated(s.orelse, s.cond, in_loop)
                cur.append(Assign(pred, s.cond))
                for i in range(max(len(then), len(orelse))):
                    sync = any(i < len(p) and p[i][0] for p in (then, orelse))
                    if i or sync:
                        flush()
                    if sync and self.mark_barriers:
                        items.append(Sync())
                    cur.append(If(pred, then[i][1] if i < len(then) else (), orelse[i][1] if i < len(orelse) else ()))
        flush()
        return items

    def _predicated(self, body: Sequence[Stmt], cond: Expr,
                    in_loop: bool) -> list[tuple[bool, tuple[PhaseStmt, ...]]]:
        """The phases of a branch under a thread-dependent condition (warp reductions, mbarrier
        waits), each with whether an mbarrier wait's cut comes before it."""
        if any(isinstance(x, Barrier) for x in iter_stmts(body)):
            raise self._fail("an If", cond)
        parts, after_wait = [], False
        for it in self.split(body, in_loop):
            if isinstance(it, Sync):
                after_wait = True
                continue
            if not isinstance(it, Phase):
                raise CodegenError(f"kernel {self.kernel.name}: a warp reduction or mbarrier wait inside a loop or "
                                   f"uniform If under the thread-dependent condition {cond!r} is not supported on "
                                   "the CPU")
            parts.append((after_wait or (not parts and bool(it.stmts) and isinstance(it.stmts[0], MbarrierWait)),
                          it.stmts))
            after_wait = False
        return parts

    def _mma_shape(self, s: Mma) -> MmaShape:
        if self.kernel.threads_per_block % WARP:
            raise CodegenError(f"kernel {self.kernel.name}: an Mma needs full warps, the block has "
                               f"{self.kernel.threads_per_block} threads")
        shape = mma_shape(s.shape, self.kernel.buffer(s.a).dtype)
        if shape is None:
            raise CodegenError(f"kernel {self.kernel.name}: no mma.sync of shape {s.shape} with "
                               f"{self.kernel.buffer(s.a).dtype.value} inputs")
        return shape

    def _check_warp(self, s: WarpReduce) -> None:
        if s.op not in WARP_OPS:
            raise CodegenError(f"kernel {self.kernel.name}: WarpReduce op {s.op!r} is not one of {WARP_OPS}")
        if s.width < 1 or s.width & (s.width - 1):
            raise CodegenError(f"kernel {self.kernel.name}: WarpReduce width {s.width} is not a power of two")
        if s.value.dtype != s.var.dtype:
            raise CodegenError(f"kernel {self.kernel.name}: WarpReduce into {s.var.name} "
                               f"({s.var.dtype.value}) of a {s.value.dtype.value} value")


class _Liveness:
    """Registers read in a phase before this thread assigned them in that phase (so their value
    comes from an earlier phase) and the phases that touch each local buffer."""

    def __init__(self, uniform_loop_vars: set[str]):
        self.uniform_loop_vars = uniform_loop_vars
        self.cross: set[str] = set()
        self.local_phases: dict[str, set[int]] = {}
        self.local_in_loop: set[str] = set()
        self._phase: Phase | None = None

    def items(self, items: Sequence[Item], predefined: frozenset[str]) -> None:
        for it in items:
            if isinstance(it, Phase):
                self._phase = it
                self._stmts(it.stmts, set(predefined))
                self._phase = None
            elif isinstance(it, Sync):
                continue
            elif isinstance(it, UniformFor):
                self._use(it.loop.start, set(predefined))
                self._use(it.loop.stop, set(predefined))
                self.items(it.body, predefined | {it.loop.var.name})
            else:
                self._use(it.cond, set(predefined))
                self.items(it.then, predefined)
                self.items(it.orelse, predefined)

    def _use(self, e: Expr, defined: set[str]) -> None:
        self.cross |= expr_vars(e) - defined
        for b in expr_loads(e):
            self._buffer(b)

    def _buffer(self, name: str) -> None:
        ph = self._phase
        self.local_phases.setdefault(name, set()).add(-1 if ph is None else ph.index)
        if ph is None or ph.in_loop:
            self.local_in_loop.add(name)

    def _stmts(self, stmts: Sequence[PhaseStmt], defined: set[str]) -> None:
        for s in stmts:
            for e in stmt_exprs(s):
                self._use(e, defined)
            if isinstance(s, Assign):
                if s.var.name in self.uniform_loop_vars:
                    raise CodegenError(f"register {s.var.name!r} is the variable of a loop that contains a barrier; "
                                       "it cannot be assigned inside the loop")
                defined.add(s.var.name)
            elif isinstance(s, Store | AtomicAdd):
                self._buffer(s.buffer)
            elif isinstance(s, XchgReduce):
                defined.add(s.var.name)
            elif isinstance(s, MmaStage):
                self._buffer(s.mma.a)
                self._buffer(s.mma.b)
            elif isinstance(s, MmaCompute):
                self._buffer(s.mma.c)
                self._buffer(s.mma.d)
            elif isinstance(s, Wgmma | WgmmaCompute):
                self._buffer(s.d if isinstance(s, Wgmma) else s.wgmma.d)
            elif isinstance(s, WgmmaStage):
                self._buffer(s.wgmma.a.buffer)
            elif isinstance(s, LdmRead):
                self._buffer(s.ldm.dst)
            elif isinstance(s, For):
                self._stmts(s.body, defined | {s.var.name})
            elif isinstance(s, If):
                then, orelse = set(defined), set(defined)
                self._stmts(s.then, then)
                self._stmts(s.orelse, orelse)
                defined |= then & orelse
