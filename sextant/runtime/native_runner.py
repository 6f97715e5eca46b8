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
from sextant.runtime.cpu import PARALLEL_WORK, CpuModule, LaunchError, estimate_work, workers
from sextant.schedule.program import Program

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


class NativeRunner:
    def __init__(self, program: Program, module: CpuModule) -> None:
        self.program = program
        self._run = executor()
        self._params = {i: t.contiguous() for i, t in program.constants.items()}
        names = list(program.kernels)
        index = {n: i for i, n in enumerate(names)}
        self._fns = (ctypes.c_void_p * max(1, len(names)))(
            *[ctypes.cast(module._fns[n], ctypes.c_void_p).value for n in names])
        nthreads = workers()
        parallel, split_work = [], 0
        for launch in program.launches:
            k = program.kernels[launch.kernel]
            if len(set(launch.args)) != len(launch.args):  # codegen's alias scopes promise distinct buffers
                raise LaunchError(f"kernel {k.name} is launched with one buffer in two parameters")
            if len(launch.args) > MAX_ARGS:
                raise LaunchError(f"kernel {k.name} takes {len(launch.args)} buffers; the executor passes at most "
                                  f"{MAX_ARGS}")
            work = estimate_work(k) * launch.blocks // max(1, k.num_blocks)
            parallel.append(nthreads > 1 and launch.blocks >= 2 and work >= PARALLEL_WORK)
            split_work += work if parallel[-1] else 0
        if split_work < SINGLE_WORKER_WORK:  # a second thread would cost more than it saves
            parallel = [False] * len(parallel)
        self.workers = nthreads if any(parallel) else 1
        plan, argidx = [len(program.launches)], []
        for li, launch in enumerate(program.launches):
            nxt = parallel[li + 1] if li + 1 < len(parallel) else False
            flags = (PARALLEL if parallel[li] else 0) | (BARRIER if parallel[li] or nxt else 0)
            plan += [index[launch.kernel], len(launch.args), len(argidx), launch.blocks, flags]
            argidx += launch.args
        assert len(plan) == 1 + FIELDS * len(program.launches)
        self._plan = (ctypes.c_int32 * len(plan))(*plan)
        self._argidx = (ctypes.c_int32 * max(1, len(argidx)))(*argidx)
        self._inputs = [b.index for b in program.buffers if b.kind == "input"]
        self._outputs = [b for b in program.buffers if b.kind == "output"]
        self._local = threading.local()
        self._module = module  # keeps the machine code alive

    def _state(self) -> tuple[ctypes.Array, ctypes.Array, dict[int, torch.Tensor]]:
        """This thread's slot array (params and arena temps filled in), barrier and tensors."""
        st = getattr(self._local, "state", None)
        if st is None:
            p = self.program
            arena = torch.empty(p.arena_bytes, dtype=torch.uint8)
            tensors: dict[int, torch.Tensor] = dict(self._params)
            for b in p.buffers:
                if b.kind == "temp":
                    tensors[b.index] = arena[b.offset:b.offset + b.nbytes].view(b.node.dtype.torch).view(b.node.shape)
            slots = (ctypes.c_void_p * max(1, len(p.buffers)))()
            for i, t in tensors.items():
                slots[i] = t.data_ptr()
            sync = (ctypes.c_int32 * 2)()
            st = self._local.state = (slots, sync, tensors)
        return st

    def _bind(self, inputs: Sequence[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array, dict[int, torch.Tensor]]:
        """This thread's slots with the call's inputs and fresh outputs in them (the tensors returned
        must stay alive while the plan runs)."""
        slots, sync, fixed = self._state()
        tensors = dict(fixed)
        for i, x in zip(self._inputs, inputs):  # inputs come first, in graph order
            x = x.contiguous()
            tensors[i] = x
            slots[i] = x.data_ptr()
        for b in self._outputs:
            t = torch.empty(b.node.shape, dtype=b.node.dtype.torch)
            tensors[b.index] = t
            slots[b.index] = t.data_ptr()
        return slots, sync, tensors

    def _execute(self, plan: ctypes.Array, slots: ctypes.Array, sync: ctypes.Array) -> None:
        run, nw = self._run, self.workers
        args = (ctypes.addressof(plan), ctypes.addressof(self._argidx), ctypes.addressof(slots),
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
        """Seconds per launch (in plan order), each measured as its plan row run ``repeats`` times
        back to back by the native executor, after one whole forward has filled every buffer —
        so a launch costs what it costs inside a forward, without a Python call per launch."""
        slots, sync, tensors = self._bind(inputs)
        self._execute(self._plan, slots, sync)
        empty = (ctypes.c_int32 * 1)(0)

        def call(plan: ctypes.Array) -> float:
            t0 = time.perf_counter()
            self._execute(plan, slots, sync)
            return time.perf_counter() - t0

        fixed = sorted(call(empty) for _ in range(21))[10]  # one executor call (the thread hand-off)
        rows = [list(self._plan[1 + FIELDS * i:1 + FIELDS * (i + 1)]) for i in range(len(self.program.launches))]
        out = []
        for row in rows:
            row = row[:4] + [row[4] | BARRIER]  # every repetition finishes before the next starts
            plan = (ctypes.c_int32 * (1 + FIELDS * repeats))(repeats, *(row * repeats))
            call(plan)  # warm
            out.append(max(0.0, min(call(plan), call(plan)) - fixed) / repeats)
        del tensors
        return out

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        p = self.program
        slots, sync, tensors = self._bind(inputs)
        self._execute(self._plan, slots, sync)
        out = []
        for i in p.outputs:
            t = tensors[i]
            out.append(t if p.buffers[i].kind == "output" else t.clone())
        return out
