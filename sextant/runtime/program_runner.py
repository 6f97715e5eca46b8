"""Runs a scheduled :class:`Program` with a target's kernel launcher.

Weights are uploaded (made contiguous) once; intermediates live in one arena per calling
thread (:class:`ThreadArenas`, shared with the native runner: two threads can run the same module
at once); only the outputs, which the caller keeps, are allocated per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from sextant.runtime.extern import run_extern
from sextant.schedule.program import Layout, Program, bounded_put

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


class ProgramRunner:
    def __init__(self, program: Program, launch: LaunchFn) -> None:
        self.program = program
        self._launch = launch
        self._params = {i: t.contiguous() for i, t in program.constants.items()}
        self._arenas: ThreadArenas[dict[int, torch.Tensor]] = ThreadArenas(program, lambda views, _: views)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        p = self.program
        layout = p.layout_for(inputs)
        tensors: dict[int, torch.Tensor] = dict(self._params)
        tensors.update(self._arenas.get(layout))
        for b, x in zip(p.buffers, inputs):  # inputs come first, in graph order
            tensors[b.index] = x.contiguous()
        for b in p.buffers:
            if b.kind == "output":
                tensors[b.index] = torch.empty(layout.shapes[b.index], dtype=b.node.dtype.torch)
        values = dict(layout.binding)
        for launch, blocks in zip(p.launches, layout.blocks):
            if launch.extern is not None:
                run_extern(p, launch, tensors)
                continue
            args = [tensors[a] for a in launch.args]
            if p.kernels[launch.kernel].sizes:
                self._launch(launch.kernel, args, blocks, sizes=values)  # type: ignore[call-arg]
            else:
                self._launch(launch.kernel, args, blocks)
        return [tensors[i].clone() if copy else tensors[i] for i, copy in zip(p.outputs, p.output_copies)]
