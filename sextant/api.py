"""``sextant.compile``: the one call a practitioner needs."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import torch

from sextant.frontend.capture import capture
from sextant.graph.ir import Graph
from sextant.graph.reference import run_graph
from sextant.runtime.compiled import CompiledModule

TARGETS = ("reference", "cpu")
PLANNED_TARGETS = ("cuda", "cuda-sim")


def compile(  # mirrors torch.compile
    module: torch.nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any] | None = None,
    *,
    target: str = "reference",
    pipeline: str | Sequence[str] = "default",
    print_after_all: bool = False,
    stream: TextIO = sys.stdout,
) -> CompiledModule:
    """Compile ``module`` for inputs shaped like ``args``/``kwargs``; returns a callable like the module.

    ``target="reference"`` runs the optimised graph IR with the reference executor (the
    oracle every code-generating target is tested against); ``target="cpu"`` fuses it into
    kernels, generates LLVM IR and runs the JIT-compiled machine code on all cores.
    """
    if target not in TARGETS:
        if target in PLANNED_TARGETS:
            raise ValueError(f"target {target!r} is not implemented yet; available: {', '.join(TARGETS)}")
        raise ValueError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    if not isinstance(args, tuple):
        args = (args,)
    from sextant.graph.passes import run_pipeline

    captured = capture(module, args, kwargs)
    graph = run_pipeline(captured, pipeline, print_after_all=print_after_all, stream=stream)
    stages: dict[str, Any] = {"captured": captured}
    if target == "reference":
        return CompiledModule(graph, target, lambda xs: run_graph(graph, xs), stages=stages)
    return _compile_cpu(graph, stages)


def _compile_cpu(graph: Graph, stages: dict[str, Any]) -> CompiledModule:
    from sextant.codegen.llvm_cpu import compile_kernels
    from sextant.runtime.program_runner import ProgramRunner
    from sextant.schedule.program import schedule
    from sextant.schedule.target import cpu_target

    program = schedule(graph, cpu_target())
    module = compile_kernels(list(program.kernels.values()))
    stages.update(program=program, cpu_module=module)
    runner = ProgramRunner(program, module.launch)
    return CompiledModule(graph, "cpu", runner, stages=stages)
