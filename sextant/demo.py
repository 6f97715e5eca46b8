"""``make demo``: sextant's main job on a built-in example, every stage printed.

    python -m sextant.demo [mlp|cnn|transformer-block|gpt2] [--quiet]

Captures the model, prints its graph IR before and after the graph passes (with what each
pass changed), runs it with the reference executor on fresh inputs, then schedules it into
fused kernels, compiles them through LLVM for this CPU, and reports each one's difference
from eager PyTorch and its speed; finally compiles it for an NVIDIA GPU (PTX through LLVM's
NVPTX backend, assembled by ptxas) and runs it on the GPU if there is one, else through
cuda-sim, saying which.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.examples import EXAMPLES
from sextant.graph.passes import trace_pipeline
from sextant.graph.reference import run_graph
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target


def _fresh(args: tuple) -> list[torch.Tensor]:
    return [torch.randn_like(a) if a.dtype.is_floating_point else torch.randint_like(a, 0, int(a.max()) + 1)
            for a in args]


def run_demo(name: str = "mlp", *, show_ir: bool = True, out: TextIO = sys.stdout) -> float:
    """Run the demo on example ``name``; returns the max abs difference from eager."""
    p = lambda *a: print(*a, file=out)
    model, args = EXAMPLES[name]()
    p(f"== sextant demo: {name} ({type(model).__name__}, {sum(x.numel() for x in model.parameters()):,} params)")

    t0 = time.perf_counter()
    graph = sextant.capture(model, args)
    t_capture = time.perf_counter() - t0
    p(f"\n-- 1. capture: torch.export + Core ATen decompositions -> graph IR ({t_capture:.2f} s, "
      f"{len(graph.nodes)} nodes)")
    if show_ir:
        p(graph)

    t0 = time.perf_counter()
    trace = trace_pipeline(graph, "default")
    t_passes = time.perf_counter() - t0
    p(f"\n-- 2. graph passes, pipeline 'default' ({t_passes * 1000:.0f} ms)")
    p(f"   {'pass':<16}{'nodes before':>14}{'nodes after':>13}")
    for r in trace:
        if r.changed:
            p(f"   {r.name:<16}{r.nodes_before:>14}{r.nodes_after:>13}")
    optimised = trace[-1].graph if trace else graph
    p(f"   (passes that changed nothing are not shown; {len(trace)} pass runs in all)")
    if show_ir:
        p("\n-- graph IR after the passes")
        p(optimised)

    fresh = _fresh(args)
    (got,) = run_graph(optimised, fresh)
    with torch.no_grad():
        expected = model(*fresh)
    err = (got - expected).abs().max().item()
    p("\n-- 3. reference executor vs eager PyTorch on fresh random inputs")
    p(f"   max |reference - eager| = {err:.3g}")

    t0 = time.perf_counter()
    program = schedule(optimised, cpu_target())
    t_sched = time.perf_counter() - t0
    p(f"\n-- 4. schedule: fusion into kernels, memory plan ({t_sched * 1000:.0f} ms)")
    p(program.describe())
    t0 = time.perf_counter()
    module = compile_kernels(list(program.kernels.values()))
    t_llvm = time.perf_counter() - t0
    p(f"\n-- 5. codegen: kernel IR -> LLVM IR -> O3 -> x86 JIT ({t_llvm * 1000:.0f} ms, "
      f"{len(program.kernels)} kernels in one module)")
    runner = ProgramRunner(program, module.launch)
    (cpu_out,) = runner(fresh)
    cpu_err = (cpu_out - expected).abs().max().item()
    t_cpu = _time(lambda: runner(fresh))
    with torch.no_grad():
        t_eager = _time(lambda: model(*fresh))
    p("\n-- 6. target 'cpu' vs eager PyTorch on the same inputs")
    p(f"   max |sextant cpu - eager| = {cpu_err:.3g}")
    p(f"   median run time: sextant cpu {t_cpu * 1000:.3f} ms, eager {t_eager * 1000:.3f} ms "
      f"({t_cpu / t_eager:.2f}x eager)")
    gpu_err = _gpu_stage(model, args, fresh, expected, p, show_ir)
    return max(err, cpu_err, gpu_err)


def _gpu_stage(model: torch.nn.Module, args: tuple, fresh: list[torch.Tensor], expected: torch.Tensor,
               p: Callable[..., None], show_ir: bool) -> float:
    """Step 7: the same model for an NVIDIA GPU — GPU schedules, PTX from LLVM's NVPTX backend,
    ptxas — run on the GPU when there is one, else through cuda-sim (the same kernels on the CPU)."""
    from sextant.codegen.llvm_nvptx import ptx_entries
    from sextant.runtime.cuda import CudaUnavailableError, require_cuda

    try:
        require_cuda()
        target, why = "cuda", "a CUDA GPU is present"
    except CudaUnavailableError as e:
        target, why = "cuda-sim", str(e).split(";")[0].strip()
    t0 = time.perf_counter()
    compiled = sextant.compile(model, args, target=target, arch="sm_90", cache=False)  # shows every stage
    t_gpu = time.perf_counter() - t0
    program, ptx = compiled.stages["program"], compiled.stages["ptx"]
    p(f"\n-- 7. target {target!r}: GPU schedules -> kernel IR -> LLVM NVPTX -> PTX (sm_90) -> ptxas "
      f"({t_gpu:.2f} s incl. capture)")
    p(program.describe())
    first = ptx.kernels[0].name
    if show_ir:
        p(f"\n-- PTX of {first} (first lines of {len(ptx.ptx.splitlines())} for {len(ptx.kernels)} kernels)")
        p("\n".join(ptx_entries(ptx.ptx)[first].splitlines()[:24]))
    inputs = [x.cuda() for x in fresh] if target == "cuda" else fresh
    out = compiled(*inputs)
    gpu_err = (out.cpu() - expected).abs().max().item()
    where = "ran on the GPU" if target == "cuda" else "ran through cuda-sim: the GPU kernels executed on this CPU"
    p(f"   {where}: {why}")
    p(f"   max |sextant {target} - eager| = {gpu_err:.3g}")
    return gpu_err


def _time(fn: Callable[[], object], runs: int = 20) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sextant.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="mlp", choices=sorted(EXAMPLES))
    parser.add_argument("--quiet", action="store_true", help="do not print the IR, only the summary")
    ns = parser.parse_args(argv)
    err = run_demo(ns.model, show_ir=not ns.quiet)
    return 0 if err < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
