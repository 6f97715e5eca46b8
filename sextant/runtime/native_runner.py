"""Runs a scheduled CPU :class:`Program` with one native call per forward pass.

Like :class:`~sextant.runtime.program_runner.ProgramRunner` (weights uploaded once, one arena
per calling thread, outputs allocated per call), but the launch sequence is a plan table that
``codegen.executor``'s ``sextant_run`` walks natively: the buffers' pointers sit in a slot
array built once per thread, so a call only writes its inputs' and outputs' pointers and makes
one ctypes call per worker thread (a second worker only when some launch is big enough to
split). Buffer checks happen once, when the slots are built, not per launch.

A call's own cost (measured on a 2-core EPYC, the MLP example at batch 8) is ~3 µs on top of
its kernels: the inputs checked against the binding (~0.3 µs each), the outputs allocated (~1 µs
each), their addresses written into the slots, and one ctypes call with one argument (the
executor's arguments packed once per thread: ``codegen.executor.sextant_call``). What a call
needs at a binding (slots, plan, packed arguments, output shapes) is looked up once, per thread.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from sextant.codegen.cpu_module import PARALLEL_WORK, CpuModule, LaunchError, estimate_work, workers
from sextant.codegen.executor import BARRIER, CALL_FIELDS, FIELDS, MAX_ARGS, PARALLEL, executor, packed_executor
from sextant.kernel.sizes import instantiate
from sextant.runtime.extern import run_extern
from sextant.runtime.program_runner import ThreadArenas, call_inputs, empty, updated_inputs
from sextant.schedule.program import CollectiveCall, Layout, Program, bounded_put

# estimated statement executions (``estimate_work``) of all splittable launches below which the
# whole forward runs on the calling thread: waking the second worker and meeting it at barriers
# costs ~30-70 µs a call (measured on a 2-core EPYC: the MLP example 0.108 → 0.037 ms)
SINGLE_WORKER_WORK = 1_000_000
# ... and the estimate only proposes: where it would split, the first calls at a binding run the
# plan both ways, TRIALS times each, alternating, and the faster (the least time seen) stays. The
# estimate can be far off — a Llama-style decoder's one-token step (2 layers of 64, a cache of 64)
# is estimated at 1.9M, and the runner took ~70 µs a call split, ~24 µs on one thread (kernels: 15)
TRIALS = 3
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(helpers: int) -> ThreadPoolExecutor:
    """A pool of exactly ``helpers`` threads: every worker of a plan must run at once (they meet at
    barriers), so a smaller shared pool could leave one waiting for a thread that never comes."""
    with _pools_lock:
        if helpers not in _pools:
            _pools[helpers] = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="sextant-native")
        return _pools[helpers]


def _forget_pools_in_child() -> None:
    """A forked child inherits the pools but none of their threads: a plan's workers would never start
    (see ``codegen.cpu_module``). The child builds its own on first use."""
    global _pools, _pools_lock
    _pools, _pools_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def _serial(table: ctypes.Array) -> ctypes.Array:
    """A plan table's copy with every launch on worker 0: no parallel flags, no barriers."""
    out = (ctypes.c_int32 * len(table))(*table)
    for i in range(table[0]):
        out[1 + FIELDS * i + 4] = 0
    return out


def _table(rows: list[list[int]]) -> ctypes.Array:
    """A plan table for the executor: the row count, then the rows."""
    flat = [len(rows)] + [x for row in rows for x in row]
    assert len(flat) == 1 + FIELDS * len(rows)
    return (ctypes.c_int32 * len(flat))(*flat)


@dataclass
class _Bound:
    """One thread's slot array at one binding, and all a call at that binding needs besides."""

    slots: ctypes.Array
    sync: ctypes.Array
    fixed: dict[int, torch.Tensor]  # the weights and arena temporaries behind the slots
    plan: ctypes.Array
    argidx: ctypes.Array
    nworkers: int  # the plan's workers (more than one: the first calls also try it on one, serial_*)
    segments: list | None
    serial_plan: ctypes.Array  # the plan on one worker (the plan itself when nworkers is 1)
    serial_segments: list | None
    call: ctypes.Array | None  # sextant_call's packed arguments for the serial plan (no extern calls)
    inputs: list[tuple[torch.Size, torch.dtype]]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    results: list[tuple[int | torch.Tensor, bool]]  # per graph output: an index into the call's buffers
    # (or a weight or temporary), and whether it is copied (all but the outputs, which the caller keeps)


class NativeRunner:
    def __init__(self, program: Program, module: CpuModule) -> None:
        self.program = program
        self._run = executor()
        self._call = packed_executor()
        self._params = {i: t.contiguous() for i, t in program.constants.items()}
        names = list(program.kernels)
        self._index = {n: i for i, n in enumerate(names)}
        self._fns = (ctypes.c_void_p * max(1, len(names)))(
            *[ctypes.cast(module._fns[n], ctypes.c_void_p).value for n in names])
        # a kernel's size arguments sit in the slot array after the buffers, one slot per symbol
        self._size_slot = {name: len(program.buffers) + j for j, (name, _, _) in enumerate(program.symbols)}
        self._kernel_launches = [la for la in program.launches if la.extern is None]
        for launch in self._kernel_launches:
            k = program.kernels[launch.kernel]
            if len(set(launch.args)) != len(launch.args):  # codegen's alias scopes promise distinct buffers
                raise LaunchError(f"kernel {k.name} is launched with one buffer in two parameters")
            if len(launch.args) + len(k.sizes) > MAX_ARGS:
                raise LaunchError(f"kernel {k.name} takes {len(launch.args) + len(k.sizes)} arguments; the "
                                  f"executor passes at most {MAX_ARGS}")
        self._plans: dict[tuple, tuple[ctypes.Array, ctypes.Array, int]] = {}
        self._inputs = [b.index for b in program.buffers if b.kind == "input"]
        self._outputs = [b.index for b in program.buffers if b.kind == "output"]
        self._updated = updated_inputs(program)
        self._late = self._inputs + self._outputs  # a call's own buffers: its inputs, then its fresh outputs
        self._arenas: ThreadArenas[_Bound] = ThreadArenas(program, self._bound)
        self._module = module  # keeps the machine code alive
        self._layout = None if program.symbols else program.layout()  # a static program's only one
        # per binding the estimate splits: the workers chosen by timing, or the trials' times so far
        self._chosen: dict[tuple, int] = {}
        self._trials: dict[tuple, tuple[list[int], list[int]]] = {}
        self._plan, self._argidx, self.workers, _ = (None, None, workers(), None) if self._layout is None else \
            self._plan_for(self._layout)

    def _plan_for(self, layout: Layout) -> tuple[ctypes.Array, ctypes.Array, int, list | None]:
        """The plan table of the kernel launches at ``layout``, their argument slot indices, the worker
        count, and — when the program calls extern ops between kernels — its segments: ``(plan,
        None)`` for a run of kernels walked natively, ``(None, launch)`` for an extern call."""
        hit = self._plans.get(layout.binding)
        if hit is not None:
            return hit
        program, nthreads = self.program, workers()
        kernel_launches = [(la, b) for la, b in zip(program.launches, layout.blocks) if la.extern is None]
        parallel, split_work = [], 0
        values = dict(layout.binding)
        estimates: dict[str, int] = {}  # a kernel over sizes is estimated at this binding's instance
        for launch, blocks in kernel_launches:
            k = program.kernels[launch.kernel]
            if not 0 <= blocks <= k.num_blocks:  # the kernel's grid is its capacity
                raise LaunchError(f"kernel {k.name}: {blocks} blocks at {dict(layout.binding)}, more than its "
                                  f"capacity of {k.num_blocks}")
            if k.name not in estimates:
                at = instantiate(k, values) if k.sizes else k
                estimates[k.name] = estimate_work(at) // max(1, at.num_blocks)
            work = estimates[k.name] * blocks
            parallel.append(nthreads > 1 and blocks >= 2 and work >= PARALLEL_WORK)
            split_work += work if parallel[-1] else 0
        if split_work < SINGLE_WORKER_WORK:  # a second thread would cost more than it saves
            parallel = [False] * len(parallel)
        nworkers = nthreads if any(parallel) else 1
        rows, argidx = [], []
        for li, (launch, blocks) in enumerate(kernel_launches):
            nxt = parallel[li + 1] if li + 1 < len(parallel) else False
            flags = (PARALLEL if parallel[li] else 0) | (BARRIER if parallel[li] or nxt else 0)
            sizes = [self._size_slot[s.name] for s in program.kernels[launch.kernel].sizes]
            rows.append([self._index[launch.kernel], len(launch.args) + len(sizes), len(argidx), blocks, flags])
            argidx += [*launch.args, *sizes]
        segments = None
        if len(kernel_launches) < len(program.launches):
            segments, pending, ki = [], [], 0
            for launch in program.launches:
                if launch.extern is None:
                    pending.append(rows[ki])
                    ki += 1
                    continue
                if pending:
                    segments.append((_table(pending), None))
                    pending = []
                segments.append((None, launch))
            if pending:
                segments.append((_table(pending), None))
        out = (_table(rows), (ctypes.c_int32 * max(1, len(argidx)))(*argidx), nworkers, segments)
        bounded_put(self._plans, layout.binding, out)
        return out

    def _bound(self, views: dict[int, torch.Tensor], layout: Layout) -> _Bound:
        """A thread's slot array at ``layout`` (params, arena temps and sizes filled in), its barrier,
        the tensors behind the slots, and the plan and packed executor arguments that use them."""
        p = self.program
        fixed: dict[int, torch.Tensor] = {**self._params, **views}
        slots = (ctypes.c_void_p * max(1, len(p.buffers) + len(p.symbols)))()
        for i, t in fixed.items():
            slots[i] = t.data_ptr()
        for name, value in layout.binding:
            slots[self._size_slot[name]] = value
        sync = (ctypes.c_int32 * 2)()
        plan, argidx, nw, segments = self._plan_for(layout)
        serial, serial_segments = plan, segments
        if nw > 1:
            serial = _serial(plan)
            serial_segments = segments and [(t if t is None else _serial(t), la) for t, la in segments]
        call = None
        if serial_segments is None:
            call = (ctypes.c_int64 * CALL_FIELDS)(ctypes.addressof(serial), ctypes.addressof(argidx),
                                                  ctypes.addressof(slots), ctypes.addressof(self._fns), 0, 1,
                                                  ctypes.addressof(sync))
        where = {b: k for k, b in enumerate(self._late)}
        dtype = lambda b: p.buffers[b].node.dtype.torch
        return _Bound(slots, sync, fixed, plan, argidx, nw, segments, serial, serial_segments, call,
                      [(torch.Size(layout.shapes[b]), dtype(b)) for b in self._inputs],
                      [(layout.shapes[b], dtype(b)) for b in self._outputs],
                      [(where[i] if i in where else fixed[i], copy) for i, copy in zip(p.outputs, p.output_copies)])

    def _fill(self, bound: _Bound, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The call's inputs (checked against the binding, made contiguous) and fresh outputs, their
        addresses written into the thread's slots; the tensors must stay alive while the plan runs."""
        slots = bound.slots
        buffers, ptrs = call_inputs(inputs, bound.inputs, self._updated)
        for i, ptr in zip(self._inputs, ptrs):
            slots[i] = ptr
        for i, (shape, dtype) in zip(self._outputs, bound.outputs):
            t = empty(shape, dtype)
            slots[i] = t.data_ptr()
            buffers.append(t)
        return buffers

    def _bind(self, inputs: Sequence[torch.Tensor]
              ) -> tuple[ctypes.Array, ctypes.Array, dict[int, torch.Tensor], Layout]:
        """This thread's slots with the call's inputs and fresh outputs in them (the tensors returned
        must stay alive while the plan runs)."""
        layout = self._layout or self.program.layout_for(inputs)
        bound = self._arenas.get(layout)
        tensors = {**bound.fixed, **dict(zip(self._late, self._fill(bound, inputs)))}
        return bound.slots, bound.sync, tensors, layout

    def _execute(self, plan: ctypes.Array, slots: ctypes.Array, sync: ctypes.Array, argidx: ctypes.Array,
                 nw: int) -> None:
        run = self._run
        args = (ctypes.addressof(plan), ctypes.addressof(argidx), ctypes.addressof(slots),
                ctypes.addressof(self._fns))
        if nw == 1:
            run(*args, 0, 1, ctypes.addressof(sync))
        else:
            pool = _pool(nw - 1)
            futures = [pool.submit(run, *args, w, nw, ctypes.addressof(sync)) for w in range(1, nw)]
            run(*args, 0, nw, ctypes.addressof(sync))
            for f in futures:
                f.result()

    def profile(self, inputs: Sequence[torch.Tensor], repeats: int = 10) -> list[float]:
        """Seconds per launch (in program order), each kernel measured as its plan row run ``repeats``
        times back to back by the native executor, after one whole forward has filled every buffer —
        so a launch costs what it costs inside a forward, without a Python call per launch; an extern
        call is timed as the call it is (the op and the copy of its results)."""
        slots, sync, tensors, layout = self._bind(inputs)
        full, argidx, nw, segments = self._plan_for(layout)
        self._run_all(full, segments, slots, sync, argidx, nw, tensors)
        empty = (ctypes.c_int32 * 1)(0)

        def call(plan: ctypes.Array) -> float:
            t0 = time.perf_counter()
            self._execute(plan, slots, sync, argidx, nw)
            return time.perf_counter() - t0

        fixed = sorted(call(empty) for _ in range(21))[10]  # one executor call (the thread hand-off)
        nkernels = len(self._kernel_launches)
        rows = iter([list(full[1 + FIELDS * i:1 + FIELDS * (i + 1)]) for i in range(nkernels)])
        out = []
        pending: dict[int, Any] = {}  # collectives in flight
        for launch in self.program.launches:
            if launch.extern is not None:
                times = []
                for _ in range(1 if isinstance(launch.extern, CollectiveCall) else 3):  # every rank: one transfer
                    t0 = time.perf_counter()
                    run_extern(self.program, launch, tensors, pending=pending)
                    times.append(time.perf_counter() - t0)
                out.append(min(times))
                continue
            row = next(rows)
            row = row[:4] + [row[4] | BARRIER]  # every repetition finishes before the next starts
            plan = (ctypes.c_int32 * (1 + FIELDS * repeats))(repeats, *(row * repeats))
            call(plan)  # warm
            out.append(max(0.0, min(call(plan), call(plan)) - fixed) / repeats)
        del tensors
        return out

    def _run_all(self, plan: ctypes.Array, segments: list | None, slots: ctypes.Array, sync: ctypes.Array,
                 argidx: ctypes.Array, nw: int, tensors: dict[int, torch.Tensor]) -> None:
        """One forward: the whole plan in one native call, or segment by segment around extern calls."""
        if segments is None:
            self._execute(plan, slots, sync, argidx, nw)
            return
        pending: dict[int, Any] = {}  # collectives in flight
        for table, launch in segments:
            if launch is None:
                self._execute(table, slots, sync, argidx, nw)
            else:
                run_extern(self.program, launch, tensors, pending=pending)

    def _run_bound(self, bound: _Bound, buffers: list[torch.Tensor], nw: int) -> None:
        if nw == 1 and bound.call is not None:
            self._call(ctypes.addressof(bound.call))
            return
        tensors = {**bound.fixed, **dict(zip(self._late, buffers))}
        if nw == 1:
            self._run_all(bound.serial_plan, bound.serial_segments, bound.slots, bound.sync, bound.argidx, 1, tensors)
        else:
            self._run_all(bound.plan, bound.segments, bound.slots, bound.sync, bound.argidx, nw, tensors)

    def _trial(self, bound: _Bound, buffers: list[torch.Tensor], binding: tuple) -> None:
        """One of the first calls at a binding the estimate splits: run on one worker or on the plan's,
        whichever has been timed fewer times, and choose once both have been timed TRIALS times."""
        serial, split = self._trials.setdefault(binding, ([], []))
        times = split if len(split) < len(serial) else serial
        t0 = time.perf_counter_ns()
        self._run_bound(bound, buffers, bound.nworkers if times is split else 1)
        times.append(time.perf_counter_ns() - t0)
        if len(serial) >= TRIALS and len(split) >= TRIALS:
            bounded_put(self._chosen, binding, bound.nworkers if min(split) < min(serial) else 1)
            self._trials.pop(binding, None)

    def workers_at(self, inputs: Sequence[torch.Tensor]) -> int | None:
        """The worker threads calls with inputs of these shapes run on (None: not decided yet)."""
        layout = self._layout or self.program.layout_for(inputs)
        nw = self._plan_for(layout)[2]
        return 1 if nw == 1 else self._chosen.get(layout.binding)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        layout = self._layout or self.program.layout_for(inputs)
        bound = self._arenas.get(layout)
        buffers = self._fill(bound, inputs)
        if bound.nworkers == 1:
            self._run_bound(bound, buffers, 1)
        else:
            nw = self._chosen.get(layout.binding)
            if nw is None:
                self._trial(bound, buffers, layout.binding)
            else:
                self._run_bound(bound, buffers, nw)
        out = []
        for src, copy in bound.results:
            t = buffers[src] if isinstance(src, int) else src
            out.append(t.clone() if copy else t)
        return out
