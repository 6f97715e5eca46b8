"""Checks that a kernel is well formed and safe to run, before any code is generated.

``verify_kernel`` raises :class:`KernelVerificationError` listing every problem, each with the
statement it is in. It checks, in order:

* the launch (dimensions positive, at most 1024 threads a block) and the buffers (unique
  names, spaces and roles, shared memory within the limit);
* types: operands of a binary op share a dtype, comparisons give bool, conditions are bool,
  indices and loop bounds are i32, loads and stores match their buffer's dtype, a register
  keeps one dtype; stores only go to ``out``/``inout`` arguments and shared/local buffers;
* registers are assigned before they are read on every path (a loop variable inside its loop;
  an assignment in a loop body only counts after a loop that surely runs);
* synchronisation: a ``Barrier`` must be reached by every thread of the block, so it may not
  sit under an ``If`` or ``For`` whose condition/bounds depend on the thread (``tid`` directly,
  or through registers, local memory or loads at thread-dependent indices). A ``WarpReduce``
  needs every lane of its warp, so thread-dependent control is allowed only when it is the
  same for the whole warp (``if (tid.x < 32)`` with full warps);
* memory: an access whose index is proved out of bounds is an error. Range analysis (with
  the facts of enclosing ``If`` guards) first tries to prove the access in bounds, or proves
  it out of bounds wherever it runs; otherwise a search over boundary threads and loop
  iterations looks for a concrete thread that reaches the access with a bad index. Only such
  proofs are reported, so a correct pattern the analysis does not understand (an index
  computed as ``i - (i/64)*64``) is never rejected.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.ops import BINARY, UNARY, IRTypeError, TensorType, infer_type
from sextant.kernel import verify_hopper
from sextant.kernel.divergence import UNIFORM, WARP, WARP_UNIFORM, Divergence
from sextant.kernel.exprs import children, free_names, statement_count
from sextant.kernel.facts import Env, assume, bounds
from sextant.kernel.flow import Ranges
from sextant.kernel.fragments import mma_accumulators, mma_shape
from sextant.kernel.intervals import int_range
from sextant.kernel.ir import (
    AMX_TILES,
    HOPPER,
    INDEX,
    PAIR_DOT_LANES,
    TILE_K,
    TILE_ROWS,
    Assign,
    AtomicAdd,
    Barrier,
    Binary,
    Buffer,
    Cast,
    Const,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Load,
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    Mma,
    PairDot,
    RegMatrix,
    Select,
    Special,
    Stmt,
    Store,
    TileMatmul,
    TmaLoad,
    Unary,
    Var,
    WarpReduce,
    Wgmma,
    add,
    stmt_operands,
)
from sextant.kernel.printer import print_expr, stmt_header
from sextant.kernel.witness import MAX_WORK, Exec, Witness
from sextant.work import WorkCounter

DEFAULT_SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a block may use
MAX_THREADS = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
WARP_OPS = frozenset({"sum", "max", "min", "prod"})
# statements a kernel's out-of-bounds witness searches may execute together, per statement of the
# kernel (beyond one search's MAX_WORK): verification stays linear in the kernel's size
WITNESS_WORK_PER_STATEMENT = 8
WITNESS_SEARCHES = 4  # full searches (MAX_WORK each) any kernel may make, whatever its size


class KernelVerificationError(ValueError):
    """The kernel breaks an IR invariant; the message names the kernel and the statements."""


def verify_kernel(kernel: Kernel, *, shared_limit: int = DEFAULT_SHARED_LIMIT,
                  scalars: Collection[str] = (), work: WorkCounter | None = None) -> None:
    """Raise :class:`KernelVerificationError` if ``kernel`` is invalid (see the module doc).

    ``scalars`` names registers that are defined on entry (scalar kernel arguments). A kernel over
    symbolic sizes is checked at the instances ``kernel/sizes.verification_points`` picks (each one
    exactly: its bounds proofs need the sizes' values). Every check is linear in the kernel;
    ``work`` counts what they did (``"verify: ..."`` and range analysis's items)."""
    if kernel.sizes:
        from sextant.graph.symbolic import substitute
        from sextant.kernel.sizes import instantiate, launch_blocks, verification_points

        for point in verification_points(kernel.sizes):
            if substitute(launch_blocks(kernel), point) == 0:
                continue  # an empty launch runs nothing
            try:
                verify_kernel(instantiate(kernel, point), shared_limit=shared_limit, scalars=scalars, work=work)
            except KernelVerificationError as e:
                at = ", ".join(f"{k}={v}" for k, v in point.items())
                raise KernelVerificationError(f"{e} (at sizes {at})") from None
        return
    v = _Verifier(kernel, scalars, work)
    v.check_launch(shared_limit)
    if not v.errors:
        v.block(kernel.body, (), ())
    if not v.errors:  # range analysis assumes well-typed IR
        v.check_bounds()
    errors = list(dict.fromkeys(v.errors))  # one message per problem, in order
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise KernelVerificationError(f"kernel {kernel.name} is invalid:\n  {shown}{more}")


@dataclass(frozen=True)
class _Control:
    """An enclosing ``If``/``For`` and how much its condition/bounds vary between threads."""

    header: str
    level: int
    reason: str


class _Verifier:
    def __init__(self, kernel: Kernel, scalars: Collection[str], work: WorkCounter | None = None) -> None:
        self.k = kernel
        self.work = work
        self.errors: list[str] = []
        self.buffers: dict[str, Buffer] = {}
        self.var_types: dict[str, DType] = {}
        self.div: Divergence | None = None
        # registers surely assigned at the statement being checked, and per open branch or loop
        # body the ones it added (undone when it ends: no copy of the set per branch)
        self.defined: set[str] = set(scalars)
        self.added: list[list[str]] = []
        self.exec: Exec | None = None  # compiled statements, shared by the witness searches
        self.register_multiples: dict[str, int] | None = None  # for Hopper alignment checks, made on first use
        self.ranges: Ranges | None = None  # the bounds walk, for the path to an access
        self.clock = 0  # statements visited by the bounds walk
        self.written: dict[str, int] = {}  # register -> clock of its last assignment in the walk
        # searches that found no witness: (enclosing frames, index, elements) -> clock of the search
        self.fruitless: dict[tuple, int] = {}
        self.witness_budget = WITNESS_SEARCHES * MAX_WORK + WITNESS_WORK_PER_STATEMENT * statement_count(kernel.body)

    @staticmethod
    def varying(control: tuple[_Control, ...], allowed: int) -> _Control | None:
        """The innermost enclosing ``If``/``For`` whose condition or bounds vary more between threads
        than ``allowed`` (a divergence level), or None."""
        return next((c for c in reversed(control) if c.level > allowed), None)

    def fail(self, where: Stmt | None, msg: str) -> None:
        self.errors.append(f"`{stmt_header(where)}`: {msg}" if where is not None else msg)

    # -- launch and buffers --------------------------------------------------------------------
    def check_launch(self, shared_limit: int) -> None:
        k = self.k
        for what, dims, limits in (("grid", k.grid, MAX_GRID), ("block", k.block, MAX_BLOCK)):
            if len(dims) != 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
                self.fail(None, f"{what} {dims} must be three positive integers")
            elif any(d > m for d, m in zip(dims, limits)):
                self.fail(None, f"{what} {dims} exceeds the hardware limits {limits}")
        if not self.errors and k.threads_per_block > MAX_THREADS:
            self.fail(None, f"block {k.block} has {k.threads_per_block} threads (at most {MAX_THREADS})")
        for group, space in ((k.params, "global"), (k.shared, "shared"), (k.local, "local")):
            for b in group:
                if b.name in self.buffers:
                    self.fail(None, f"buffer {b.name!r} is declared twice")
                self.buffers[b.name] = b
                if b.space != space:
                    self.fail(None, f"buffer {b.name!r} is listed as {space} but has space {b.space!r}")
                if space == "global" and b.role not in ("in", "out", "inout"):
                    self.fail(None, f"argument {b.name!r} has role {b.role!r} (in, out or inout)")
                if not isinstance(b.size, int) or b.size < 0:
                    self.fail(None, f"buffer {b.name!r} has size {b.size!r}")
        shared = sum(b.size * b.dtype.itemsize for b in k.shared)
        if shared > shared_limit:
            self.fail(None, f"shared buffers use {shared} bytes, more than the limit of {shared_limit}")

    # -- statements ------------------------------------------------------------------------
    def define(self, name: str) -> None:
        if name not in self.defined:
            self.defined.add(name)
            if self.added:
                self.added[-1].append(name)

    def nested(self, stmts: tuple[Stmt, ...], loops: tuple[str, ...], control: tuple[_Control, ...],
               var: str | None = None) -> list[str]:
        """Check a branch or loop body (with loop variable ``var`` defined); returns the registers
        it surely assigns that were not before, and leaves :attr:`defined` as it was."""
        self.added.append([])
        if var is not None:
            self.define(var)
        self.block(stmts, loops, control)
        added = self.added.pop()
        self.defined.difference_update(added)
        return added

    def block(self, stmts: tuple[Stmt, ...], loops: tuple[str, ...], control: tuple[_Control, ...]) -> None:
        """Check ``stmts``, updating :attr:`defined` to the registers surely assigned after them."""
        if self.div is None:
            self.div = Divergence(self.k, self.work)
        for s in stmts:
            if self.work is not None:
                self.work.add("verify: statements")
            self.stmt(s, loops, control)

    def stmt(self, s: Stmt, loops: tuple[str, ...], control: tuple[_Control, ...]) -> None:
        assert self.div is not None
        defined = self.defined
        if isinstance(s, Assign | WarpReduce):
            self.expr(s.value, s, defined)
            self.declare(s.var, s)
            if s.var.name in loops:
                self.fail(s, f"assigns the loop variable {s.var.name} inside its loop")
            if s.value.dtype != s.var.dtype:
                self.fail(s, f"assigns a {s.value.dtype.value} value to {s.var.dtype.value} register {s.var.name}")
            if isinstance(s, WarpReduce):
                self.warp_reduce(s, control)
            self.define(s.var.name)
            return
        if isinstance(s, Store | AtomicAdd):
            self.expr(s.index, s, defined)
            self.expr(s.value, s, defined)
            self.index(s.index, s)
            b = self.buffers.get(s.buffer)
            if b is None:
                self.fail(s, f"stores to unknown buffer {s.buffer!r}")
            else:
                if b.space == "global" and b.role == "in":
                    self.fail(s, f"stores to {s.buffer!r}, an input (role 'in') of the kernel")
                if isinstance(s, AtomicAdd) and (b.space != "global" or b.dtype == DType.bool):
                    self.fail(s, f"atomic add to {b.space} {b.dtype.value} buffer {s.buffer!r}: only global "
                                 "numeric buffers")
                if s.value.dtype != b.dtype:
                    self.fail(s, f"stores a {s.value.dtype.value} value to {b.dtype.value} buffer {s.buffer!r}")
            return
        if isinstance(s, Mma | LdMatrix | CpAsync | CpAsyncCommit | CpAsyncWait):
            self.tensor_core(s, defined, control)
            return
        if isinstance(s, PairDot):
            self.pair_dot(s, defined)
            return
        if isinstance(s, TileMatmul):
            self.tile_matmul(s, defined)
            return
        if isinstance(s, HOPPER):
            verify_hopper.check(self, s, defined, control)
            return
        if isinstance(s, Barrier):
            c = self.varying(control, UNIFORM)
            if c is not None:
                self.fail(s, f"barrier under thread-dependent control flow: `{c.header}` {c.reason}; "
                             "threads that skip it would deadlock the block")
            return
        if isinstance(s, For):
            self.expr(s.start, s, defined)
            self.expr(s.stop, s, defined)
            self.declare(s.var, s)
            for e in (s.start, s.stop, s.var):
                self.index(e, s)
            if not isinstance(s.step, int) or isinstance(s.step, bool) or s.step == 0:
                self.fail(s, f"loop step must be a non-zero integer, got {s.step!r}")
            if s.var.name in loops:
                self.fail(s, f"loop variable {s.var.name} shadows an enclosing loop's")
            level, reason = self.div.level_of(s.start, s.stop)
            added = self.nested(s.body, loops + (s.var.name,),
                                control + (_Control(stmt_header(s), level, f"has bounds that {reason}"),), s.var.name)
            if _surely_runs(s):
                for name in added:
                    if name != s.var.name:
                        self.define(name)
            return
        assert isinstance(s, If), f"not a statement: {s!r}"
        self.expr(s.cond, s, defined)
        if s.cond.dtype != DType.bool:
            self.fail(s, f"condition is {s.cond.dtype.value}, not bool")
        level, reason = self.div.level_of(s.cond)
        ctl = control + (_Control(stmt_header(s), level, f"has a condition that {reason}"),)
        then = self.nested(s.then, loops, ctl)
        orelse = self.nested(s.orelse, loops, ctl)
        if isinstance(s.cond, Const):
            both = then if s.cond.value else orelse
        else:
            others = set(orelse)
            both = [name for name in then if name in others]
        for name in both:
            self.define(name)

    def warp_reduce(self, s: WarpReduce, control: tuple[_Control, ...]) -> None:
        if s.op not in WARP_OPS:
            self.fail(s, f"unknown warp reduction {s.op!r} (one of {sorted(WARP_OPS)})")
        if s.op in ("sum", "prod") and s.value.dtype == DType.bool:
            self.fail(s, f"warp {s.op} of a bool value")
        w = s.width
        if not isinstance(w, int) or w < 1 or w > WARP or w & (w - 1):
            self.fail(s, f"warp reduction width {w!r} must be a power of two <= {WARP}")
        elif self.k.threads_per_block % w:
            self.fail(s, f"the block's {self.k.threads_per_block} threads do not fill groups of {w} lanes")
        c = self.varying(control, WARP_UNIFORM)
        if c is not None:
            self.fail(s, f"warp reduction under control flow that differs within a warp: `{c.header}` "
                         f"{c.reason}; every lane of the warp must take part")

    def pair_dot(self, s: PairDot, defined: set[str]) -> None:
        """A :class:`PairDot`: an f32 local accumulator, a bf16 B, bf16 A values, a vector width
        x86 has, and a one-thread block (the CPU's: the GPU lowering has no such instruction)."""
        for e in stmt_operands(s):
            self.expr(e, s, defined)
        self.index(s.acc_off, s)
        self.index(s.b_off, s)
        if s.lanes not in PAIR_DOT_LANES:
            self.fail(s, f"pair dot over {s.lanes!r} lanes (one of {PAIR_DOT_LANES})")
        if self.k.threads_per_block != 1:
            self.fail(s, f"a pair dot is a CPU statement (one thread per block), but the block has "
                         f"{self.k.threads_per_block} threads")
        acc, b = self.buffers.get(s.acc), self.buffers.get(s.b)
        if acc is None or b is None:
            self.fail(s, f"pair dot operand {s.acc if acc is None else s.b!r} is not a buffer of the kernel")
            return
        if acc.space != "local" or acc.dtype != DType.f32:
            self.fail(s, f"pair dot accumulates into an f32 local buffer, not {acc.space} {acc.dtype.value} "
                         f"{acc.name!r}")
        if b.dtype != DType.bf16 or s.a_lo.dtype != DType.bf16 or s.a_hi.dtype != DType.bf16:
            self.fail(s, f"pair dot multiplies bf16 values, not {s.a_lo.dtype.value}/{s.a_hi.dtype.value} by "
                         f"{b.dtype.value} {b.name!r}")

    def tile_matmul(self, s: TileMatmul, defined: set[str]) -> None:
        """A :class:`TileMatmul`: bf16 operands, an f32 local result of its size, whole tiles of K,
        no more tiles than AMX has registers, a one-thread block."""
        for e in stmt_operands(s):
            self.expr(e, s, defined)
            self.index(e, s)
        if self.k.threads_per_block != 1:
            self.fail(s, f"a tile matmul is a CPU statement (one thread per block), but the block has "
                         f"{self.k.threads_per_block} threads")
        tiles = s.row_tiles * s.col_tiles + s.row_tiles + s.col_tiles
        if min(s.row_tiles, s.col_tiles) < 1 or tiles > AMX_TILES:
            self.fail(s, f"a {s.row_tiles}x{s.col_tiles} tile matmul needs {tiles} tile registers; AMX has "
                         f"{AMX_TILES}")
        if s.k <= 0 or s.k % TILE_K:
            self.fail(s, f"a tile matmul's K ({s.k}) must be a positive multiple of {TILE_K}")
        if s.a_stride < s.k:
            self.fail(s, f"A's rows are {s.a_stride} elements apart, fewer than K = {s.k}")
        if s.b_tile_stride < s.k * TILE_ROWS:
            self.fail(s, f"B's strips are {s.b_tile_stride} elements apart, fewer than one strip's "
                         f"{s.k * TILE_ROWS}")
        out, a, b = (self.buffers.get(n) for n in (s.out, s.a, s.b))
        if out is None or a is None or b is None:
            missing = s.out if out is None else s.a if a is None else s.b
            self.fail(s, f"tile matmul operand {missing!r} is not a buffer of the kernel")
            return
        if out.space != "local" or out.dtype != DType.f32 or out.size < s.rows * s.cols:
            self.fail(s, f"a tile matmul writes an f32 local buffer of at least {s.rows * s.cols} elements, not "
                         f"{out.space} {out.dtype.value} {out.name!r}[{out.size}]")
        if a.dtype != DType.bf16 or b.dtype != DType.bf16:
            self.fail(s, f"a tile matmul multiplies bf16 operands, not {a.dtype.value} {a.name!r} by "
                         f"{b.dtype.value} {b.name!r}")

    def tensor_core(self, s: Stmt, defined: set[str], control: tuple[_Control, ...]) -> None:
        """An ``Mma``, ``LdMatrix`` or ``cp.async`` statement: operand buffers, dtypes and shapes;
        warp-collective ones need full warps, no lane-divergent control and uniform offsets."""
        assert self.div is not None
        for e in stmt_operands(s):
            self.expr(e, s, defined)
            if not (isinstance(s, CpAsync) and e is s.pred):
                self.index(e, s)
        if isinstance(s, CpAsyncWait):
            if not isinstance(s.pending, int) or s.pending < 0:
                self.fail(s, f"cp.async wait for {s.pending!r} pending groups (a non-negative integer)")
            return
        if not isinstance(s, Mma | LdMatrix | CpAsync):
            return
        bufs = {"dst": s.dst, "src": s.src} if not isinstance(s, Mma) else {"d": s.d, "a": s.a, "b": s.b, "c": s.c}
        found = {}
        for role, name in bufs.items():
            b = self.buffers.get(name)
            if b is None:
                self.fail(s, f"{role} operand {name!r} is not a buffer of the kernel")
                return
            found[role] = b
        if isinstance(s, CpAsync):
            d, src = found["dst"], found["src"]
            if d.space != "shared" or src.space != "global":
                self.fail(s, f"cp.async copies global memory to shared memory, not {src.space} {src.name!r} to "
                             f"{d.space} {d.name!r}")
            if d.dtype != src.dtype:
                self.fail(s, f"cp.async from {src.dtype.value} {src.name!r} to {d.dtype.value} {d.name!r}")
            if s.count * d.dtype.itemsize not in (4, 8, 16):
                self.fail(s, f"cp.async of {s.count} {d.dtype.value} elements is {s.count * d.dtype.itemsize} bytes "
                             "(4, 8 or 16)")
            if s.pred is not None and s.pred.dtype != DType.bool:
                self.fail(s, f"cp.async predicate is {s.pred.dtype.value}, not bool")
            return
        if self.k.threads_per_block % WARP:
            self.fail(s, f"a warp-level matrix operation needs full warps, but the block has "
                         f"{self.k.threads_per_block} threads")
        ctl = self.varying(control, WARP_UNIFORM)
        if ctl is not None:
            self.fail(s, f"warp-level matrix operation under control flow that differs within a warp: "
                         f"`{ctl.header}` {ctl.reason}; every lane of the warp must execute it")
        offsets = (s.dst_off,) if isinstance(s, LdMatrix) else (s.d_off, s.a_off, s.b_off, s.c_off)
        level, reason = self.div.level_of(*offsets)
        if level > UNIFORM:
            self.fail(s, f"fragment offsets must be the same in every thread (registers), but they {reason}")
        if any(b.space != "local" for role, b in found.items() if role != "src"):
            self.fail(s, "fragments live in local buffers: " + ", ".join(
                f"{b.name!r} is {b.space}" for role, b in found.items() if role != "src" and b.space != "local"))
        if isinstance(s, LdMatrix):
            d, src = found["dst"], found["src"]
            if s.count not in (1, 2, 4):
                self.fail(s, f"ldmatrix loads 1, 2 or 4 matrices, not {s.count!r}")
            if src.space != "shared":
                self.fail(s, f"ldmatrix reads shared memory, but {src.name!r} is {src.space}")
            if d.dtype != src.dtype or d.dtype not in (DType.f16, DType.bf16):
                self.fail(s, f"ldmatrix moves 16-bit elements (f16/bf16) of one dtype, not {src.dtype.value} "
                             f"into {d.dtype.value}")
            return
        shape = mma_shape(s.shape, found["a"].dtype)
        if shape is None or found["a"].dtype != found["b"].dtype:
            self.fail(s, f"no mma.sync of shape {tuple(s.shape)} with {found['a'].dtype.value} x "
                         f"{found['b'].dtype.value} inputs (m16n8k16 / m16n8k8 with f16 or bf16, "
                         "m16n8k8 with f32 as tf32)")
            return
        acc = mma_accumulators(shape, found["a"].dtype)
        if found["c"].dtype != found["d"].dtype or found["c"].dtype not in acc:
            self.fail(s, f"mma accumulators c ({found['c'].dtype.value}) and d ({found['d'].dtype.value}) must "
                         f"both be one of {', '.join(d.value for d in acc)}")

    def declare(self, v: Var, where: Stmt) -> None:
        prev = self.var_types.setdefault(v.name, v.dtype)
        if prev != v.dtype:
            self.fail(where, f"register {v.name} is used as {v.dtype.value} and as {prev.value}")

    def index(self, e: Expr, where: Stmt) -> None:
        if e.dtype != INDEX:
            self.fail(where, f"index expression {print_expr(e)} is {e.dtype.value}, not {INDEX.value}")

    # -- expressions -------------------------------------------------------------------------
    def expr(self, e: Expr, where: Stmt, defined: set[str]) -> None:
        for ch in children(e):
            self.expr(ch, where, defined)
        fail = lambda msg: self.fail(where, f"{print_expr(e)}: {msg}")
        if isinstance(e, Const):
            ok = _const_ok(e)
            if not ok:
                fail(f"constant {e.value!r} is not a {e.dtype.value}")
        elif isinstance(e, Var):
            self.declare(e, where)
            if e.name not in defined:
                self.fail(where, f"reads register {e.name} before it is assigned")
        elif isinstance(e, Special):
            if e.kind not in ("tid", "bid", "bdim", "gdim") or e.axis not in ("x", "y", "z"):
                fail(f"unknown thread coordinate {e.kind}.{e.axis}")
        elif isinstance(e, Unary | Binary):
            ops = e.a.dtype, *((e.b.dtype,) if isinstance(e, Binary) else ())
            if e.op not in (UNARY if isinstance(e, Unary) else BINARY):
                fail(f"unknown op {e.op!r}")
                return
            dtype, err = _scalar_type(e.op, ops)
            if err is not None:
                fail(err)
                return
            if dtype != e.dtype:
                types = ", ".join(d.value for d in ops)
                fail(f"{e.op} of {types} gives {dtype.value}, the node says {e.dtype.value}")
        elif isinstance(e, Select):
            if e.cond.dtype != DType.bool:
                fail(f"select condition is {e.cond.dtype.value}, not bool")
            if not e.a.dtype == e.b.dtype == e.dtype:
                fail(f"select of {e.a.dtype.value} and {e.b.dtype.value} typed {e.dtype.value}")
        elif isinstance(e, Load):
            b = self.buffers.get(e.buffer)
            if b is None:
                fail(f"loads from unknown buffer {e.buffer!r}")
            elif b.dtype != e.dtype:
                fail(f"loads {e.dtype.value} from {b.dtype.value} buffer {e.buffer!r}")
            self.index(e.index, where)
        elif not isinstance(e, Cast):
            self.fail(where, f"not an expression: {e!r}")

    # -- memory bounds -----------------------------------------------------------------------
    def check_bounds(self) -> None:
        """One walk with range analysis: each access proved in bounds, proved out of bounds, or
        searched for a witness thread."""
        self.ranges = ranges = Ranges.for_kernel(self.k, self.work)
        ranges.walk(self.k.body, ranges.entry(), self.bounds_visit)

    def bounds_visit(self, s: Stmt, env: Env) -> None:
        self.clock += 1
        for e in _stmt_exprs(s):
            for buf, idx in _accesses(e):
                self.access(s, buf, idx, env)
        if isinstance(s, Store | AtomicAdd):
            self.access(s, s.buffer, s.index, env, store=True)
        for buf, start, n, store, guard in _ranges_touched(s, self.buffers):
            if guard is not None:
                env.open()  # the guard's facts for these accesses only
            if guard is None or assume(env, guard, True):
                for idx in (start, add(start, Const(n - 1, INDEX))) if n > 1 else (start,):
                    if guard is not None:  # as the GPU lowering clamps it: the witness search runs it too
                        idx = Select(guard, idx, Const(0, INDEX), INDEX)
                    self.access(s, buf, idx, env, store=store)
            if guard is not None:
                env.close()
        if isinstance(s, Assign | WarpReduce | For):  # a body's own assignments are visited in turn
            self.written[s.var.name] = self.clock

    def access(self, s: Stmt, buf: str, idx: Expr, env: Env, store: bool = False) -> None:
        size = self.buffers[buf].size
        kind = "store to" if store else "load from"
        b = bounds(idx, env)
        if b is not None and b[0] >= 0 and b[1] < size:
            return
        if b is not None and (b[1] < 0 or b[0] >= size):  # wherever it runs (this code is reachable)
            self.fail(s, f"{kind} {buf}[{print_expr(idx)}] is always out of bounds: its index is in "
                         f"[{b[0]}, {b[1]}], but {buf!r} has {size} elements")
            return
        assert self.ranges is not None
        path = self.ranges.frames()
        key = (_frames(path), idx, size)
        if self._searched_before(key, idx):
            return
        if self.witness_budget <= 0:  # the kernel's searches have done their share
            if self.work is not None:
                self.work.add("verify: witness searches skipped")
            return
        if self.exec is None:
            self.exec = Exec()
        search = Witness(self.k, path, idx, size, self.exec, min(MAX_WORK, self.witness_budget))
        found = search.search()
        self.witness_budget -= search.work
        if self.work is not None:
            self.work.add("verify: witness steps", search.work)
        if found is None:
            self.fruitless[key] = self.clock
        else:
            value, where = found
            self.fail(s, f"{kind} {buf}[{print_expr(idx)}] is out of bounds: index {value} at {where}, "
                         f"but {buf!r} has {size} elements")

    def _searched_before(self, key: tuple, idx: Expr) -> bool:
        """Whether a search already failed for the same index into as many elements, earlier in the
        same statement list with none of the index's registers assigned since: every thread and
        iteration then reaches both accesses with the same index value, and this search would try
        a prefix of what that one tried (its work budget runs out no later), finding nothing either.
        (The epilogue reads each per-channel parameter at the same column index.)"""
        before = self.fruitless.get(key)
        return before is not None and all(self.written.get(n, -1) < before for n in free_names(idx))


def _frames(path: tuple) -> tuple:
    """An access's enclosing frames and statement list, by identity."""
    return (*((id(st), p, br) for st, p, br in path[:-1]), id(path[-1][0]))


@functools.lru_cache(maxsize=1024)
def _scalar_type(op: str, operands: tuple[DType, ...]) -> tuple[DType, None] | tuple[None, str]:
    """The graph IR's result type of ``op`` on scalars of these types, or why there is none: asked
    once per op and operand types, not once per node of every kernel."""
    try:
        return infer_type(op, [TensorType((), d) for d in operands], {}).dtype, None
    except IRTypeError as err:
        return None, str(err)


def _const_ok(e: Const) -> bool:
    v, dt = e.value, e.dtype
    if dt == DType.bool:
        return isinstance(v, bool)
    if dt.is_int:
        lo, hi = int_range(dt)
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
    return isinstance(v, int | float) and not isinstance(v, bool)


def _surely_runs(s: For) -> bool:
    """Statically at least one iteration (constant bounds)."""
    if isinstance(s.start, Const) and isinstance(s.stop, Const) and isinstance(s.step, int):
        return s.start.value < s.stop.value if s.step > 0 else s.start.value > s.stop.value
    return False


def _stmt_exprs(s: Stmt) -> tuple[Expr, ...]:
    if isinstance(s, Assign | WarpReduce):
        return (s.value,)
    if isinstance(s, Store | AtomicAdd):
        return (s.index, s.value)
    if isinstance(s, For):
        return (s.start, s.stop)
    if isinstance(s, If):
        return (s.cond,)
    return stmt_operands(s)


def _ranges_touched(s: Stmt, buffers: dict[str, Buffer]) -> Iterator[tuple[str, Expr, int, bool, Expr | None]]:
    """The element ranges a tensor-core or cp.async statement reads or writes, per thread:
    ``(buffer, first index, elements, is a store, condition under which it happens)``."""
    if isinstance(s, Mma):
        shape = mma_shape(s.shape, buffers[s.a].dtype)
        if shape is not None:
            yield s.a, s.a_off, shape.a_elems, False, None
            yield s.b, s.b_off, shape.b_elems, False, None
            yield s.c, s.c_off, shape.c_elems, False, None
            yield s.d, s.d_off, shape.c_elems, True, None
    elif isinstance(s, LdMatrix):
        yield s.src, s.index, 8, False, None
        yield s.dst, s.dst_off, 2 * s.count, True, None
    elif isinstance(s, CpAsync):
        yield s.dst, s.dst_index, s.count, True, None
        yield s.src, s.src_index, s.count, False, s.pred
    elif isinstance(s, PairDot):
        yield s.acc, s.acc_off, s.lanes, True, None
        yield s.b, s.b_off, 2 * s.lanes, False, None
    elif isinstance(s, TileMatmul):  # A's rows and B's strips as the ranges that cover them
        yield s.out, Const(0, DType.i32), s.rows * s.cols, True, None
        yield s.a, s.a_off, (s.rows - 1) * s.a_stride + s.k, False, None
        yield s.b, s.b_off, (s.col_tiles - 1) * s.b_tile_stride + s.k * TILE_ROWS, False, None
    elif isinstance(s, Wgmma):
        yield s.d, s.d_off, s.n // 2, True, None
        if isinstance(s.a, RegMatrix):
            yield s.a.buffer, s.a.offset, 8, False, None
    elif isinstance(s, MbarrierInit | MbarrierArrive | MbarrierWait):
        yield s.bar, s.index, 1, True, None
    elif isinstance(s, TmaLoad):
        yield s.dst, s.dst_off, s.box[0] * s.box[1], True, None
        yield s.bar, s.bar_index, 1, True, None


def _accesses(e: Expr) -> Iterator[tuple[str, Expr]]:
    if isinstance(e, Load):
        yield e.buffer, e.index
    for ch in children(e):
        yield from _accesses(ch)
