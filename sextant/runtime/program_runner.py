"""Runs a scheduled :class:`Program` with a target's kernel launcher.

Weights are uploaded (made contiguous) once; intermediates live in one arena allocated once
per calling thread (so two threads can run the same module at once); only the outputs,
which the caller keeps, are allocated per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from sextant.schedule.program import Program

LaunchFn = Callable[[str, list[torch.Tensor], int], None]


class ProgramRunner:
    def __init__(self, program: Program, launch: LaunchFn) -> None:
        self.program = program
        self._launch = launch
        self._params = {i: t.contiguous() for i, t in program.constants.items()}
        self._local = threading.local()

    def _arena_views(self) -> dict[int, torch.Tensor]:
        views = getattr(self._local, "views", None)
        if views is None:
            arena = torch.empty(self.program.arena_bytes, dtype=torch.uint8)
            views = {}
            for b in self.program.buffers:
                if b.kind == "temp":
                    raw = arena[b.offset:b.offset + b.nbytes]
                    views[b.index] = raw.view(b.node.dtype.torch).view(b.node.shape)
            self._local.arena, self._local.views = arena, views
        return views

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        p = self.program
        tensors: dict[int, torch.Tensor] = dict(self._params)
        tensors.update(self._arena_views())
        for b, x in zip(p.buffers, inputs):  # inputs come first, in graph order
            tensors[b.index] = x.contiguous()
        for b in p.buffers:
            if b.kind == "output":
                tensors[b.index] = torch.empty(b.node.shape, dtype=b.node.dtype.torch)
        for launch in p.launches:
            self._launch(launch.kernel, [tensors[a] for a in launch.args], launch.blocks)
        out = []
        for i in p.outputs:
            t = tensors[i]
            out.append(t if p.buffers[i].kind == "output" else t.clone())
        return out
