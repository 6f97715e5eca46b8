"""Runs a scheduled :class:`Program` with a target's kernel launcher.

Weights are uploaded (made contiguous) once; intermediates live in one arena per calling
thread (:class:`ThreadArenas`, shared with the native runner: two threads can run the same module
at once); only the outputs, which the caller keeps, are allocated per call.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from sextant.codegen.cpu_module import CpuModule, LaunchError
from sextant.runtime.extern import run_extern
from sextant.schedule.program import Launch, Layout, Program, bounded_put

LaunchFn = Callable[[str, list[torch.Tensor], int], None]
T = TypeVar("T")


class ThreadArenas(Generic[T]):
    """Per calling thread, one arena of the program's temporaries — grown to the largest binding the
    thread has run (two threads can run one module at once) — and, per binding, what a runner builds
    on that binding's views of it (bounded; dropped together when the arena grows)."""

    def __init__(self, program: Program, build: Callable[[dict[int, torch.Tensor], Layout], T]) -> None:
        self.program = program
        self._build = build
        self._local = threading.local()

    def get(self, layout: Layout) -> T:
        local = self._local
        cache = getattr(local, "cache", None)
        if cache is None:
            cache = local.cache = {}
            local.arena = torch.empty(0, dtype=torch.uint8)
        hit = cache.get(layout.binding)
        if hit is None:
            if layout.arena_bytes > local.arena.numel():
                local.arena = torch.empty(layout.arena_bytes, dtype=torch.uint8)
                cache.clear()  # built on views of the old arena
            p, views = self.program, {}
            for b in p.buffers:
                if b.kind == "temp":
                    raw = local.arena[layout.offsets[b.index]:layout.offsets[b.index] + layout.nbytes(p, b.index)]
                    views[b.index] = raw.view(b.node.dtype.torch).view(layout.shapes[b.index])
            hit = self._build(views, layout)
            bounded_put(cache, layout.binding, hit, 64)
        return hit


def updated_inputs(program: Program) -> tuple[int, ...]:
    """Positions of the inputs that a launch writes (an update in place: ``graph.ir.Mutation``)."""
    inputs = [b.index for b in program.buffers if b.kind == "input"]
    written: set[int] = set()
    for launch in program.launches:
        if launch.extern is not None:
            written.update(launch.extern.split(launch.args)[1])
        else:
            params = program.kernels[launch.kernel].params
            written.update(a for a, q in zip(launch.args, params) if q.role != "in")
    return tuple(k for k, i in enumerate(inputs) if i in written)


def call_inputs(inputs: Sequence[torch.Tensor], expected: Sequence[tuple[torch.Size, torch.dtype]],
                updated: tuple[int, ...]) -> tuple[list[torch.Tensor], list[int]]:
    """A call's inputs, checked against the binding's shapes and dtypes (the kernels' argument arrays
    are built for them) and made contiguous, and their addresses; one the program updates in place
    overlaps no other."""
    if len(inputs) != len(expected):
        raise LaunchError(f"expected {len(expected)} inputs, got {len(inputs)}")
    out, ptrs = [], []
    for x, (shape, dtype) in zip(inputs, expected):
        if x.shape != shape or x.dtype != dtype or not x.is_cpu:
            raise LaunchError(f"input {len(out)}: expected a CPU tensor {dtype} {list(shape)}, got "
                              f"{x.dtype} {list(x.shape)} on {x.device}")
        x = x.contiguous()
        out.append(x)
        ptrs.append(x.data_ptr())
    if updated:  # the kernels assume distinct buffers (codegen's alias scopes)
        ends = [p + x.nbytes for p, x in zip(ptrs, out)]
        for k in updated:
            lo, hi = ptrs[k], ends[k]
            for j in range(len(out)):
                if ptrs[j] < hi and lo < ends[j] and j != k:
                    raise LaunchError(f"input {k} is updated in place and overlaps input {j} in memory")
    return out, ptrs


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A fresh output: ``torch.empty`` with the sizes unpacked, which torch parses ~0.5 µs faster
    than a tuple (a 0-d shape needs the tuple)."""
    return torch.empty(*shape, dtype=dtype) if shape else torch.empty((), dtype=dtype)


@dataclass
class _Bound:
    """A :class:`ProgramRunner`'s launches bound to one thread's buffers at one binding: each kernel's
    argument array is built and checked once; a call writes only its inputs' and outputs' addresses."""

    steps: list[Callable[[], None] | Launch]  # per launch: the bound kernel launch, or an extern call
    patches: list[tuple[ctypes.Array, int, int]]  # (argument array, entry, index into the call's buffers)
    fixed: dict[int, torch.Tensor]  # weights and the arena's temporaries, by buffer index
    inputs: list[tuple[torch.Size, torch.dtype]]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    results: list[tuple[int | torch.Tensor, bool]]  # per graph output: an index into the call's buffers
    # (or a weight or temporary), and whether it is copied (all but the outputs, which the caller keeps)


class ProgramRunner:
    """Runs a program launch by launch through ``launch`` (a target's, or a checking or counting
    build's). With a plain :class:`~sextant.codegen.cpu_module.CpuModule`'s ``launch`` the launches are
    bound once per thread and binding (``CpuModule.bind``: buffers checked, argument arrays
    built), and a call writes its inputs' and outputs' addresses into them: ~1 µs a launch, not
    ~20 (the checks and the argument array per launch)."""

    def __init__(self, program: Program, launch: LaunchFn) -> None:
        self.program = program
        self._launch = launch
        self._params = {i: t.contiguous() for i, t in program.constants.items()}
        owner = getattr(launch, "__self__", None)
        # a subclass that wraps prepare() (race checks, counters) must see every launch: not bound
        self._module = owner if getattr(launch, "__func__", None) is CpuModule.launch and \
            type(owner).prepare is CpuModule.prepare else None
        self._arenas: ThreadArenas[dict[int, torch.Tensor] | _Bound] = ThreadArenas(
            program, (lambda views, _: views) if self._module is None else self._bound)
        self._nin = sum(b.kind == "input" for b in program.buffers)
        self._outs = [b.index for b in program.buffers if b.kind == "output"]
        self._updated = updated_inputs(program)

    def _bound(self, views: dict[int, torch.Tensor], layout: Layout) -> _Bound:
        p, module = self.program, self._module
        assert module is not None
        fixed = {**self._params, **views}
        late = list(range(self._nin)) + self._outs  # the call's buffers, by buffer index
        where = {b: k for k, b in enumerate(late)}
        stand_in = {b: torch.empty(layout.shapes[b], dtype=p.buffers[b].node.dtype.torch, device="meta")
                    for b in late}
        steps: list[Callable[[], None] | Launch] = []
        patches = []
        values = dict(layout.binding)
        for launch, blocks in zip(p.launches, layout.blocks):
            if launch.extern is not None:
                steps.append(launch)
                continue
            extra = {"sizes": values} if p.kernels[launch.kernel].sizes else {}
            run, args = module.bind(launch.kernel, [fixed[a] if a in fixed else stand_in[a] for a in launch.args],
                                    blocks, **extra)
            patches += [(args, j, where[a]) for j, a in enumerate(launch.args) if a in where]
            steps.append(run)
        inputs = [(torch.Size(layout.shapes[b]), p.buffers[b].node.dtype.torch) for b in range(self._nin)]
        outputs = [(layout.shapes[b], p.buffers[b].node.dtype.torch) for b in self._outs]
        results = [(where[i] if i in where else fixed[i], copy) for i, copy in zip(p.outputs, p.output_copies)]
        return _Bound(steps, patches, fixed, inputs, outputs, results)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        p = self.program
        layout = p.layout_for(inputs)
        if self._module is not None:
            return self._call_bound(self._arenas.get(layout), inputs)  # type: ignore[arg-type]
        tensors: dict[int, torch.Tensor] = dict(self._params)
        tensors.update(self._arenas.get(layout))  # type: ignore[arg-type]
        for b, x in zip(p.buffers, inputs):  # inputs come first, in graph order
            tensors[b.index] = x.contiguous()
        for b in p.buffers:
            if b.kind == "output":
                tensors[b.index] = torch.empty(layout.shapes[b.index], dtype=b.node.dtype.torch)
        values = dict(layout.binding)
        pending: dict[int, Any] = {}  # collectives in flight
        for launch, blocks in zip(p.launches, layout.blocks):
            if launch.extern is not None:
                run_extern(p, launch, tensors, pending=pending)
                continue
            args = [tensors[a] for a in launch.args]
            if p.kernels[launch.kernel].sizes:
                self._launch(launch.kernel, args, blocks, sizes=values)  # type: ignore[call-arg]
            else:
                self._launch(launch.kernel, args, blocks)
        return [tensors[i].clone() if copy else tensors[i] for i, copy in zip(p.outputs, p.output_copies)]

    def _call_bound(self, bound: _Bound, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        buffers, ptrs = call_inputs(inputs, bound.inputs, self._updated)
        for shape, dtype in bound.outputs:
            t = empty(shape, dtype)
            buffers.append(t)
            ptrs.append(t.data_ptr())
        for args, j, k in bound.patches:
            args[j] = ptrs[k]
        tensors = None
        pending: dict[int, Any] = {}  # collectives in flight
        for step in bound.steps:
            if isinstance(step, Launch):
                if tensors is None:
                    tensors = {**bound.fixed, **dict(zip(range(self._nin), buffers)),
                               **dict(zip(self._outs, buffers[self._nin:]))}
                run_extern(self.program, step, tensors, pending=pending)
            else:
                step()
        out = []
        for src, copy in bound.results:
            t = buffers[src] if isinstance(src, int) else src
            out.append(t.clone() if copy else t)
        return out
