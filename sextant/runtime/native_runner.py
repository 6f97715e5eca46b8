"""Runs a scheduled CPU :class:`Program` with one native call per forward pass.

Like :class:`~sextant.runtime.program_runner.ProgramRunner` (weights uploaded once, one arena
per calling thread, outputs allocated per call), but the launch sequence is a plan table that
``codegen.executor``'s ``sextant_run`` walks natively: the buffers' pointers sit in a slot
array built once per thread, so a call only writes its inputs' and outputs' pointers and makes
one ctypes call per worker thread (a second worker only when some launch is big enough to
split). Buffer checks happen once, when the slots are built, not per launch.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from sextant.codegen.executor import BARRIER, FIELDS, MAX_ARGS, PARALLEL, executor
from sextant.kernel.sizes import instantiate
from sextant.runtime.cpu import PARALLEL_WORK, CpuModule, LaunchError, estimate_work, workers
from sextant.runtime.extern import run_extern
from sextant.runtime.program_runner import ThreadArenas
from sextant.schedule.program import Layout, Program, bounded_put

# estimated statement executions (``estimate_work``) of all splittable launches below which the
# whole forward runs on the calling thread: waking the second worker and meeting it at barriers
# costs ~30-70 µs a call (measured on a 2-core EPYC: the MLP example 0.108 → 0.037 ms)
SINGLE_WORKER_WORK = 1_000_000
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
    (see ``runtime.cpu``). The child builds its own on first use."""
    global _pools, _pools_lock
    _pools, _pools_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def _table(rows: list[list[int]]) -> ctypes.Array:
    """A plan table for the executor: the row count, then the rows."""
    flat = [len(rows)] + [x for row in rows for x in row]
    assert len(flat) == 1 + FIELDS * len(rows)
    return (ctypes.c_int32 * len(flat))(*flat)


class NativeRunner:
    def __init__(self, program: Program, module: CpuModule) -> None:
        self.program = program
        self._run = executor()
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
        self._outputs = [b for b in program.buffers if b.kind == "output"]
        self._arenas = ThreadArenas(program, self._slots)
        self._module = module  # keeps the machine code alive
        self._plan, self._argidx, self.workers, _ = self._plan_for(program.layout()) if not program.symbols else \
            (None, None, workers(), None)

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

    def _slots(self, views: dict[int, torch.Tensor], layout: Layout
               ) -> tuple[ctypes.Array, ctypes.Array, dict[int, torch.Tensor]]:
        """A thread's slot array at ``layout`` (params, arena temps and sizes filled in), its barrier
        and the tensors behind the slots."""
        p = self.program
        tensors: dict[int, torch.Tensor] = {**self._params, **views}
        slots = (ctypes.c_void_p * max(1, len(p.buffers) + len(p.symbols)))()
        for i, t in tensors.items():
            slots[i] = t.data_ptr()
        for name, value in layout.binding:
            slots[self._size_slot[name]] = value
        return slots, (ctypes.c_int32 * 2)(), tensors

    def _bind(self, inputs: Sequence[torch.Tensor]
              ) -> tuple[ctypes.Array, ctypes.Array, dict[int, torch.Tensor], Layout]:
        """This thread's slots with the call's inputs and fresh outputs in them (the tensors returned
        must stay alive while the plan runs)."""
        layout = self.program.layout_for(inputs)
        slots, sync, fixed = self._arenas.get(layout)
        tensors = dict(fixed)
        for i, x in zip(self._inputs, inputs):  # inputs come first, in graph order
            x = x.contiguous()
            tensors[i] = x
            slots[i] = x.data_ptr()
        for b in self._outputs:
            t = torch.empty(layout.shapes[b.index], dtype=b.node.dtype.torch)
            tensors[b.index] = t
            slots[b.index] = t.data_ptr()
        return slots, sync, tensors, layout

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
        for launch in self.program.launches:
            if launch.extern is not None:
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    run_extern(self.program, launch, tensors)
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
        for table, launch in segments:
            if launch is None:
                self._execute(table, slots, sync, argidx, nw)
            else:
                run_extern(self.program, launch, tensors)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        p = self.program
        slots, sync, tensors, layout = self._bind(inputs)
        plan, argidx, nw, segments = self._plan_for(layout)
        self._run_all(plan, segments, slots, sync, argidx, nw, tensors)
        return [tensors[i].clone() if copy else tensors[i] for i, copy in zip(p.outputs, p.output_copies)]
