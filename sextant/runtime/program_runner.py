"""Runs a scheduled :class:`Program` with a target's kernel launcher.

Weights are uploaded (made contiguous) once; intermediates live in one arena allocated once
per calling thread (so two threads can run the same module at once); only the outputs,
which the caller keeps, are allocated per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from sextant.graph.bind import solve
from sextant.schedule.program import Layout, Program, bounded_put

LaunchFn = Callable[[str, list[torch.Tensor], int], None]


class ProgramRunner:
    def __init__(self, program: Program, launch: LaunchFn) -> None:
        self.program = program
        self._launch = launch
        self._params = {i: t.contiguous() for i, t in program.constants.items()}
        self._local = threading.local()

    def layout(self, inputs: Sequence[torch.Tensor]) -> Layout:
        """The program's sizes for these inputs (for a program over symbolic sizes: solved from their
        shapes, checked against the declared ranges)."""
        p = self.program
        if not p.symbols:
            return p.layout()
        return p.layout(solve(p.graph, [tuple(x.shape) for x in inputs], p.symbols))

    def _arena_views(self, layout: Layout) -> dict[int, torch.Tensor]:
        """This thread's views of the temps at ``layout``, in one arena grown to the largest binding."""
        cache = getattr(self._local, "views", None)
        if cache is None:
            cache = self._local.views = {}
            self._local.arena = torch.empty(0, dtype=torch.uint8)
        views = cache.get(layout.binding)
        if views is None:
            if layout.arena_bytes > self._local.arena.numel():
                self._local.arena = torch.empty(layout.arena_bytes, dtype=torch.uint8)
                cache.clear()
            arena, views = self._local.arena, {}
            for b in self.program.buffers:
                if b.kind == "temp":
                    raw = arena[layout.offsets[b.index]:layout.offsets[b.index] + layout.nbytes(self.program, b.index)]
                    views[b.index] = raw.view(b.node.dtype.torch).view(layout.shapes[b.index])
            bounded_put(cache, layout.binding, views, 64)
        return views

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        p = self.program
        layout = self.layout(inputs)
        tensors: dict[int, torch.Tensor] = dict(self._params)
        tensors.update(self._arena_views(layout))
        for b, x in zip(p.buffers, inputs):  # inputs come first, in graph order
            tensors[b.index] = x.contiguous()
        for b in p.buffers:
            if b.kind == "output":
                tensors[b.index] = torch.empty(layout.shapes[b.index], dtype=b.node.dtype.torch)
        values = dict(layout.binding)
        for launch, blocks in zip(p.launches, layout.blocks):
            args = [tensors[a] for a in launch.args]
            if p.kernels[launch.kernel].sizes:
                self._launch(launch.kernel, args, blocks, sizes=values)  # type: ignore[call-arg]
            else:
                self._launch(launch.kernel, args, blocks)
        out = []
        for i in p.outputs:
            t = tensors[i]
            out.append(t if p.buffers[i].kind == "output" else t.clone())
        return out
