"""cuda-sim's counters for a whole program: each kernel's bank conflicts, coalescing and
instruction counts from one run of a scheduled GPU program through the counting CPU build
(``codegen/counters.py``). In the runtime because it runs the program's launch plan; it lived in
codegen until 2026-12, which made codegen import the runtime."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sextant.codegen.counters import CountingCpuModule, KernelCounters
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.runtime.program_runner import ProgramRunner


def count_program(program: object, inputs: Sequence[torch.Tensor]) -> dict[str, KernelCounters]:
    """Run a scheduled GPU ``program`` once on ``inputs`` through a counting cuda-sim build and
    return each kernel's counters (summed over its launches)."""
    module = compile_kernels(list(program.kernels.values()), count_accesses=True)  # type: ignore[attr-defined]
    assert isinstance(module, CountingCpuModule)
    ProgramRunner(program, module.launch)(list(inputs))  # type: ignore[arg-type]
    return module.counters
