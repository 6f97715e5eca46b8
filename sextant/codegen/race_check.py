"""A checked mode of the SIMT CPU lowering: shared-memory races, out-of-bounds accesses and
divergent warp reductions reported as Python errors instead of passing unnoticed.

On the CPU a phase runs its threads one after another, so a missing ``Barrier`` is invisible:
thread 0 finishes writing before thread 1 reads, and the result is right by luck. The checked
mode (``compile_kernels(kernels, check_races=True)``, or ``SEXTANT_CHECK_RACES=1`` for
``sextant.compile``) adds to the generated code:

* **Shadow memory for every shared element**: the epoch of its last write and the writing
  thread, the epoch of its last reads and up to two distinct readers. An *epoch* is the stretch
  between two barriers of one block (a new block starts a new one). A thread that reads an
  element another thread wrote in the same epoch, or writes one another thread read or wrote
  in it, races with that thread on a GPU, whatever order the CPU happened to run them in.
  This was chosen over poisoning shared memory at barriers and running threads in reverse:
  the shadow is exact (no false alarms, no dependence on the racing values differing or on a
  tolerance), catches write-after-read and write-after-write as well as read-after-write, and
  names the element and both threads. A ``WarpReduce`` does not start an epoch: ``shfl.sync``
  orders registers, not shared memory (CUDA needs ``__syncwarp`` for that).
* **Bounds checks on every buffer access** (global, shared and local): the shadow needs a
  valid index anyway, and an out-of-bounds access at a ragged size — harmless-looking on the
  CPU, a fault or silent corruption on the GPU — is the other classic GPU-only mistake. A bad
  index is reported and the access redirected to element 0, so the kernel finishes safely.
* **Warp convergence**: every lane of a warp (the lanes that exist in the block) must reach a
  ``WarpReduce``, ``Mma`` or ``LdMatrix``, as ``shfl.sync``'s member mask and ``.sync.aligned``
  require. Each lane stamps its exchange slot with the phase it stored in; the lanes computing
  the result check their warp's stamps.
* **cp.async**: on the CPU the copy happens at once, but on the GPU its data may be read only
  after the issuing thread's ``CpAsyncWait`` has covered its group (and, by other threads, after
  a barrier following that wait). A ``cp.async`` write stamps the element's write epoch with the
  thread's open group instead of an epoch; each thread counts its committed and completed groups
  and records the epoch in which each group completed (a ring of ``ASYNC_RING`` groups). An
  access to an element whose group is not complete is reported; once complete, the element's
  write counts as made in the epoch of the wait — so a read by another thread needs a barrier
  after the wait, exactly as on the GPU.

The generated code records the first problem of a launch in a per-kernel report (a global
array); :class:`CheckedCpuModule` runs launches inline, one at a time, and turns a filled report
into a :class:`KernelCheckError` naming the kernel, the buffer, the element, the block and the
threads. It is a test mode: several times slower than the plain lowering.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from llvmlite import ir

from sextant.codegen.cpu_module import CpuModule
from sextant.codegen.scalar_math import I1, I8, I32, I64
from sextant.errors import SextantError
from sextant.kernel.ir import CpAsync, CpAsyncCommit, CpAsyncWait, Kernel, iter_stmts

if TYPE_CHECKING:
    from sextant.codegen.llvm_cpu import _KernelLowering

ENV_VAR = "SEXTANT_CHECK_RACES"
WARP = 32  # lanes that must converge on a WarpReduce (the PTX lowering's shfl.sync member mask)
REPORT = 8  # i32 words: kind, buffer, element, thread a, thread b, block, unused x2
SHADOW = 5  # i32 words per shared element: write epoch, writer, read epoch, reader 1, reader 2
RAW, WAW, WAR, OOB_LOAD, OOB_STORE, DIVERGENT, ASYNC, MBARRIER = range(1, 9)
ASYNC_RING = 16  # cp.async groups per thread whose completion epoch is remembered


class KernelCheckError(SextantError, RuntimeError):
    """The checked CPU lowering caught a GPU-only mistake in a kernel while it ran."""

    def __init__(self, message: str, kernel: str, buffer: str, element: int, threads: tuple, block: tuple) -> None:
        super().__init__(message)
        self.kernel, self.buffer, self.element, self.threads, self.block = kernel, buffer, element, threads, block


class SharedMemoryRaceError(KernelCheckError):
    """Two threads of a block touch one shared element, at least one writing, with no barrier between."""


class OutOfBoundsError(KernelCheckError):
    """A load or store outside its buffer."""


class AsyncCopyError(SharedMemoryRaceError):
    """Shared memory a ``cp.async`` writes is touched before the copy's group was waited for."""


class MbarrierHangError(KernelCheckError):
    """A thread waits for an mbarrier phase that has not completed when every thread has reached the
    wait: an arrival or transaction bytes are missing (on the GPU, the block hangs)."""


class DivergentWarpError(KernelCheckError):
    """A ``WarpReduce`` that some lanes of the warp did not reach."""


def checks_enabled(flag: bool | None) -> bool:
    """``flag``, or when None whether ``SEXTANT_CHECK_RACES`` is set to a true value."""
    if flag is not None:
        return flag
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass
class CheckInfo:
    """What the numbers in a kernel's report refer to."""

    kernel: Kernel
    buffers: list[str]  # report field "buffer" for memory problems
    warps: list[str] = field(default_factory=list)  # ... and for divergence: the WarpReduce's register


# -- code generation ------------------------------------------------------------------------------
class KernelChecker:
    """Emits the checks into one kernel's lowering (``llvm_cpu._KernelLowering``)."""

    def __init__(self, low: _KernelLowering) -> None:
        self.low = low
        k = low.kernel
        self.info = CheckInfo(k, [b.name for b in (*k.params, *k.shared, *k.local)])
        ty = ir.ArrayType(I32, REPORT)
        self.report = ir.GlobalVariable(low.module, ty, report_symbol(k.name))
        self.report.initializer = ir.Constant(ty, None)
        self.report.type = ir.PointerType()  # opaque, as every pointer in the lowering
        self.shadow: dict[str, ir.Value] = {}
        self.stamps: dict[str, ir.Value] = {}
        self.epoch: ir.Value | None = None
        self.round: ir.Value | None = None
        null = ir.Constant(ir.PointerType(), None)
        self.async_open, self.async_done, self.async_epochs = null, null, null  # per thread (cp.async)

    def _c(self, v: int) -> ir.Constant:
        return ir.Constant(I32, v)

    def preamble(self) -> None:
        """Counters and shadow arrays, in the entry block (after the lowering's own storage)."""
        low, b = self.low, self.low.b
        self.epoch, self.round = low._array(I32, 1, "check.epoch"), low._array(I32, 1, "check.round")
        b.store(self._c(0), self.epoch)
        b.store(self._c(0), self.round)
        for s in low.kernel.shared:
            self.shadow[s.name] = self._filled(SHADOW * s.size, f"shadow.{s.name}")
        for slot in low.plan.exchanges:
            self.stamps[slot] = self._filled(low.kernel.threads_per_block, f"stamp.{slot}")
        if any(isinstance(s, CpAsync) for s in iter_stmts(low.kernel.body)):
            T = low.kernel.threads_per_block
            self.async_open, self.async_done = self._filled(T, "async.open", 0), self._filled(T, "async.done", 0)
            self.async_epochs = self._filled(T * ASYNC_RING, "async.epochs")

    def _filled(self, count: int, name: str, byte: int = 0xFF) -> ir.Value:
        """``count`` i32 words set to -1 (no epoch, no thread), or to 0 with ``byte=0``."""
        p = self.low._array(I32, max(1, count), name)
        memset = self.low.math.declare("llvm.memset.p0.i64", ir.VoidType(), [ir.PointerType(), I8, I64, I1])
        self.low.b.call(memset, [p, ir.Constant(I8, byte), ir.Constant(I64, 4 * max(1, count)), ir.Constant(I1, 0)])
        return p

    def _bump(self, counter: ir.Value | None) -> None:
        b = self.low.b
        b.store(b.add(b.load(counter, typ=I32), self._c(1)), counter)

    def block_start(self) -> None:
        if not isinstance(self.async_done, ir.Constant):
            # a new block: the last block's copies are complete (a kernel's end waits for them)
            low = self.low
            low._loop(self._c(0), self._c(low.kernel.threads_per_block), 1, lambda t: self._complete(
                t, low.b.load(low.b.gep(self.async_open, [t], inbounds=True, source_etype=I32), typ=I32)),
                "check.async")
        self._bump(self.epoch)

    def _complete(self, thread: ir.Value, upto: ir.Value) -> None:
        self.low.b.call(_complete_fn(self.low.module), [self.async_done, self.async_epochs, thread, upto,
                                                        self.low.b.load(self.epoch, typ=I32)])

    def sync(self) -> None:
        """A barrier: accesses after it never race with those before it."""
        self._bump(self.epoch)

    def phase_start(self) -> None:
        self._bump(self.round)

    def _record(self, cond: ir.Value, kind: int, buf: int, elem: ir.Value, a: ir.Value, b_: ir.Value) -> None:
        """If ``cond``, report the problem (unless one was reported already)."""
        b = self.low.b
        with b.if_then(cond, likely=False):
            b.call(_report_fn(self.low.module), [self.report, self._c(kind), self._c(buf), elem, a, b_,
                                                self.low.block_linear])

    def access(self, name: str, index: ir.Value, store: bool) -> ir.Value:
        """Check one load/store of ``name[index]``; returns the index to use (0 when out of bounds)."""
        low, b = self.low, self.low.b
        if name not in low.buffers or name in low.plan.exchanges or not isinstance(index.type, ir.IntType):
            return index  # the lowering reports unknown buffers; exchange slots are its own
        buf = low.buffers[name][0]
        buf_id = self.info.buffers.index(name)
        ok = b.icmp_unsigned("<", index, ir.Constant(index.type, buf.size))
        elem = b.trunc(index, I32) if index.type.width > 32 else index
        self._record(b.not_(ok), OOB_STORE if store else OOB_LOAD, buf_id, elem, low.ltid, self._c(-1))
        index = b.select(ok, index, ir.Constant(index.type, 0))
        if buf.space == "shared" and buf.size:
            fn = _shadow_fn(low.module, store)
            b.call(fn, [self.shadow[name], b.trunc(index, I32) if index.type.width > 32 else index, low.ltid,
                        b.load(self.epoch, typ=I32), self.report, self._c(buf_id), low.block_linear,
                        self.async_done, self.async_epochs])
        return index

    def async_written(self, name: str, index: ir.Value) -> None:
        """After the (checked) store of a ``cp.async``: the element's write belongs to this
        thread's open group, not to the current epoch."""
        b = self.low.b
        if name not in self.shadow:
            return
        group = b.load(b.gep(self.async_open, [self.low.ltid], inbounds=True, source_etype=I32), typ=I32)
        word = b.gep(self.shadow[name], [b.mul(b.trunc(index, I32) if index.type.width > 32 else index,
                                               self._c(SHADOW))], inbounds=True, source_etype=I32)
        b.store(b.sub(self._c(-2), group), word)

    def xchg_store(self, slot: str) -> None:
        b = self.low.b
        p = b.gep(self.stamps[slot], [self.low.ltid], inbounds=True, source_etype=I32)
        b.store(b.load(self.round, typ=I32), p)

    def warp_converged(self, slot: str, what: str) -> None:
        """Every existing lane of this thread's warp stored its operand (in exchange ``slot``) in
        the previous phase; ``what`` names the warp operation in the report."""
        low, b, T = self.low, self.low.b, self.low.kernel.threads_per_block
        warp_id = len(self.info.warps)
        self.info.warps.append(what)
        expected = b.sub(b.load(self.round, typ=I32), self._c(1))
        first = b.and_(low.ltid, self._c(~(WARP - 1)))
        stop = b.select(b.icmp_signed("<", b.add(first, self._c(WARP)), self._c(T)),
                        b.add(first, self._c(WARP)), self._c(T))

        def lane(i: ir.Value) -> None:
            stamp = b.load(b.gep(self.stamps[slot], [i], inbounds=True, source_etype=I32), typ=I32)
            self._record(b.icmp_signed("!=", stamp, expected), DIVERGENT, warp_id, i, low.ltid, i)

        low._loop(first, stop, 1, lane, f"check.{slot}")

    def mbarrier_wait(self, done: ir.Value, bar: str, index: ir.Value, parity: ir.Value) -> None:
        """At an ``MbarrierWait`` (a phase boundary): report if the awaited phase is not complete."""
        self._record(self.low.b.not_(done), MBARRIER, self.info.buffers.index(bar), index, self.low.ltid, parity)

    def async_group(self, s: CpAsyncCommit | CpAsyncWait) -> None:
        """Commit: this thread's open group closes. Wait: all but its ``pending`` newest
        committed groups are complete, in the current epoch."""
        if isinstance(self.async_open, ir.Constant):
            return  # no cp.async in the kernel: nothing to wait for
        b, t = self.low.b, self.low.ltid
        open_ = b.gep(self.async_open, [t], inbounds=True, source_etype=I32)
        if isinstance(s, CpAsyncCommit):
            b.store(b.add(b.load(open_, typ=I32), self._c(1)), open_)
        else:
            self._complete(t, b.sub(b.load(open_, typ=I32), self._c(s.pending)))


def report_symbol(kernel: str) -> str:
    return f"sextant.check.{kernel}"


# Out-of-line helpers, one copy per module: inlined at every shared access, the checks made the
# matmul kernels' unrolled inner loops ~7x larger and their O3 + JIT time grew accordingly.
_ARGS = ("report", "kind", "buf", "elem", "a", "b", "block")


def _complete_fn(module: ir.Module) -> ir.Function:
    """``complete(done, epochs, thread, upto, epoch)``: the thread's groups below ``upto`` that
    were not complete yet complete now, in ``epoch``."""
    fn, b = _helper(module, "sextant.check.async_complete", ("done", "epochs", "thread", "upto", "epoch"))
    if b is None:
        return fn
    done, epochs, t, upto, epoch = fn.args
    c = lambda v: ir.Constant(I32, v)
    slot = b.gep(done, [t], inbounds=True, source_etype=I32)
    first = b.load(slot, typ=I32)
    head, body, end = (fn.append_basic_block(n) for n in ("head", "body", "end"))
    entry = b.block
    b.branch(head)
    b.position_at_end(head)
    g = b.phi(I32)
    g.add_incoming(first, entry)
    b.cbranch(b.icmp_signed("<", g, upto), body, end)
    b.position_at_end(body)
    ring = b.add(b.mul(t, c(ASYNC_RING)), b.and_(g, c(ASYNC_RING - 1)))
    b.store(epoch, b.gep(epochs, [ring], inbounds=True, source_etype=I32))
    g.add_incoming(b.add(g, c(1)), body)
    b.branch(head)
    b.position_at_end(end)
    b.store(b.select(b.icmp_signed(">", upto, first), upto, first), slot)
    b.ret_void()
    return fn


def _helper(module: ir.Module, name: str, args: tuple[str, ...]) -> tuple[ir.Function, ir.IRBuilder | None]:
    """The module's function ``name`` (all i32 arguments but the pointers), and a builder at its
    entry when it was just declared and still needs a body."""
    fn = module.globals.get(name)
    if fn is not None:
        return fn, None
    types = [ir.PointerType() if a in ("report", "shadow", "done", "epochs") else I32 for a in args]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), types), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    fn.attributes.add("nounwind")
    for a, n in zip(fn.args, args):
        a.name = n
    return fn, ir.IRBuilder(fn.append_basic_block("entry"))


def _report_fn(module: ir.Module) -> ir.Function:
    """``report(report, kind, buf, elem, a, b, block)``: fill the report unless already filled."""
    fn, b = _helper(module, "sextant.check.report", _ARGS)
    if b is not None:
        report, *fields = fn.args
        with b.if_then(b.icmp_signed("==", b.load(report, typ=I32), ir.Constant(I32, 0))):
            for i, v in enumerate(fields):
                b.store(v, b.gep(report, [ir.Constant(I32, i)], inbounds=True, source_etype=I32))
        b.ret_void()
    return fn


def _shadow_fn(module: ir.Module, store: bool) -> ir.Function:
    """``load|store(shadow, index, thread, epoch, report, buf, block)``: check one shared access
    against the element's shadow words and update them (see the module docstring)."""
    fn, b = _helper(module, f"sextant.check.shared_{'store' if store else 'load'}",
                    ("shadow", "index", "thread", "epoch", "report", "buf", "block", "done", "epochs"))
    if b is None:
        return fn
    shadow, index, t, epoch, report, buf, block, done, epochs = fn.args
    c = lambda v: ir.Constant(I32, v)
    report_fn = _report_fn(module)

    def record(cond: ir.Value, kind: int, other: ir.Value) -> None:
        with b.if_then(cond, likely=False):
            b.call(report_fn, [report, c(kind), buf, index, other, t, block])

    base = b.mul(index, c(SHADOW), flags=["nsw"])
    w_epoch, writer, r_epoch, reader1, reader2 = (
        b.gep(shadow, [b.add(base, c(i), flags=["nsw"])], inbounds=True, source_etype=I32) for i in range(SHADOW))
    stamp = b.load(w_epoch, typ=I32)
    with b.if_then(b.icmp_signed("<", stamp, c(-1)), likely=False):  # written by a cp.async of group g
        g, w = b.sub(c(-2), stamp), b.load(writer, typ=I32)
        pending = b.icmp_signed(">=", g, b.load(b.gep(done, [w], inbounds=True, source_etype=I32), typ=I32))
        record(pending, ASYNC, w)
        with b.if_then(b.not_(pending)):  # complete: the write happened in the epoch of the wait
            ring = b.add(b.mul(w, c(ASYNC_RING)), b.and_(g, c(ASYNC_RING - 1)))
            b.store(b.load(b.gep(epochs, [ring], inbounds=True, source_etype=I32), typ=I32), w_epoch)
    w = b.load(writer, typ=I32)
    record(b.and_(b.icmp_signed("==", b.load(w_epoch, typ=I32), epoch), b.icmp_signed("!=", w, t)),
           WAW if store else RAW, w)
    read_now = b.icmp_signed("==", b.load(r_epoch, typ=I32), epoch)
    r1 = b.load(reader1, typ=I32)
    if store:  # a reader other than this thread: reader 1, or else reader 2 (which differs from reader 1)
        other = b.select(b.icmp_signed("!=", r1, t), r1, b.load(reader2, typ=I32))
        record(b.and_(read_now, b.icmp_signed(">=", other, c(0))), WAR, other)
        b.store(epoch, w_epoch)
        b.store(t, writer)
    else:
        with b.if_else(read_now) as (again, fresh):
            with again, b.if_then(b.icmp_signed("!=", r1, t)):
                b.store(t, reader2)
            with fresh:
                b.store(epoch, r_epoch)
                b.store(t, reader1)
                b.store(c(-1), reader2)
    b.ret_void()
    return fn


# -- running -------------------------------------------------------------------------------------
class CheckedCpuModule(CpuModule):
    """A :class:`CpuModule` whose kernels were compiled with checks: every launch runs inline
    (the report is per kernel, not per thread) and raises the first problem it found."""

    def __init__(self, kernels: Sequence[Kernel], addresses: dict[str, int], reports: dict[str, int],
                 infos: dict[str, CheckInfo], **kw: object) -> None:
        super().__init__(kernels, addresses, **kw)  # type: ignore[arg-type]
        self._reports = reports
        self._infos = infos
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "Checked" + super().__repr__()

    def prepare(self, name: str, buffers: Sequence[torch.Tensor], grid_blocks: int | None = None, *,
                parallel: bool | None = None) -> Callable[[], None]:
        run = super().prepare(name, buffers, grid_blocks, parallel=False)
        report = (ctypes.c_int32 * REPORT).from_address(self._reports[name])
        info = self._infos[name]

        def run_checked() -> None:
            with self._lock:
                ctypes.memset(report, 0, ctypes.sizeof(report))
                run()
                found = list(report)
                ctypes.memset(report, 0, ctypes.sizeof(report))
            if found[0]:
                raise describe(info, found)

        return run_checked


def _coords(linear: int, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    x, rest = linear % dims[0], linear // dims[0]
    return (x, rest % dims[1], rest // dims[1])


def describe(info: CheckInfo, report: list[int]) -> KernelCheckError:
    """The error for a filled report."""
    kind, buf, elem, a, b, block = report[:6]
    k = info.kernel
    blk = _coords(block, k.grid)
    ta, tb = (_coords(t, k.block) if t >= 0 else None for t in (a, b))
    where = f"kernel {k.name}, block {blk}"
    if kind == DIVERGENT:
        var = info.warps[buf]
        op = var if " " in var else None  # an Mma/LdMatrix ("mma acc"); else a WarpReduce's register
        did = f"runs {op}" if op else f"reduces {var} with a WarpReduce"
        return DivergentWarpError(
            f"{where}: divergent warp: thread {ta} {did} that lane {elem % WARP} of its warp (thread {tb}) did not "
            f"reach; every lane of the warp must take part (a {'warp-level matrix operation' if op else 'WarpReduce'} "
            "under a condition that differs within a warp)", k.name, var, elem, (ta, tb), blk)
    name = info.buffers[buf]
    if kind == MBARRIER:
        return MbarrierHangError(
            f"{where}: thread {ta} waits for the phase of parity {b} of mbarrier {name}[{elem}], which has not "
            "completed after every thread reached the wait: an arrival or transaction bytes (TMA) it expects are "
            "missing, or the parity is wrong (on the GPU the block would hang)", k.name, name, elem, (ta,), blk)
    if kind == ASYNC:
        return AsyncCopyError(
            f"{where}: thread {tb} touches {name}[{elem}] while thread {ta}'s cp.async into it may still be in "
            "flight: its group was not waited for (CpAsyncCommit, then CpAsyncWait, then a Barrier before other "
            "threads read it)", k.name, name, elem, (ta, tb), blk)
    if kind in (OOB_LOAD, OOB_STORE):
        size = k.buffer(name).size
        verb = "stores to" if kind == OOB_STORE else "loads"
        return OutOfBoundsError(f"{where}: thread {ta} {verb} {name}[{elem}], out of bounds of its {size} elements "
                                "(a missing or wrong guard?)", k.name, name, elem, (ta,), blk)
    what = {RAW: (f"thread {tb} reads {name}[{elem}], which thread {ta} wrote", "read after write"),
            WAW: (f"thread {tb} writes {name}[{elem}], which thread {ta} also wrote", "write after write"),
            WAR: (f"thread {tb} writes {name}[{elem}], which thread {ta} read", "write after read")}[kind]
    return SharedMemoryRaceError(f"{where}: shared-memory race ({what[1]}): {what[0]} with no Barrier between them",
                                 k.name, name, elem, (ta, tb), blk)
