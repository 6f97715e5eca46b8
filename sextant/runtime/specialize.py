"""The executor of a module captured with symbolic sizes: one capture, specialised per size.

``sextant.compile(..., dynamic_shapes=...)`` captures the model once, with its batch and
sequence sizes as symbols in the graph IR. Below the graph IR sextant still compiles static
shapes, so each call reads the symbols' values off its inputs (``graph/bind.py``: checked
against every input dimension and declared range), and the first call at a new binding binds
the graph to those sizes and runs the rest of the pipeline on it (graph passes, schedule and
memory plan, code generation); later calls at that binding reuse it. What one compile shares
across sizes is therefore the capture (torch.export, the lowerings) — kernels that take the sizes
as parameters, so one set of kernels serves them all, are the next step (docs/dynamic-shapes.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sextant.graph.bind import bind, solve
from sextant.graph.ir import Graph

Binding = tuple[tuple[str, int], ...]


class Specializer:
    """``inputs -> outputs`` for a symbolic graph; ``compile_bound(graph, binding)`` builds the static
    module for one binding (``sextant.api.compile_graph`` with the user's target and options, through
    the compile cache when it is on)."""

    def __init__(self, graph: Graph, compile_bound: Callable[[Graph, Binding], Any]) -> None:
        self.graph = graph
        self._compile_bound = compile_bound
        self.modules: dict[Binding, Any] = {}  # binding -> CompiledModule, in the order first seen
        self._lock = threading.Lock()

    def binding(self, inputs: Sequence[torch.Tensor]) -> Binding:
        return tuple(sorted(solve(self.graph, [tuple(x.shape) for x in inputs]).items()))

    def module_for(self, binding: Binding) -> Any:
        with self._lock:
            module = self.modules.get(binding)
            if module is None:
                module = self._compile_bound(bind(self.graph, dict(binding)), binding)
                self.modules[binding] = module
            return module

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.module_for(self.binding(inputs))._executor(inputs)
