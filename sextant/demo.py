"""``make demo``: sextant's main job on a built-in example, every stage printed.

    python -m sextant.demo [mlp|cnn|transformer-block|gpt2] [--quiet]

Captures the model, prints its graph IR before and after the graph passes (with what each
pass changed), runs it with the reference executor on fresh inputs and reports the
difference from eager PyTorch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import torch

import sextant
from sextant.examples import EXAMPLES
from sextant.graph.passes import trace_pipeline
from sextant.graph.reference import run_graph


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
    t0 = time.perf_counter()
    (got,) = run_graph(optimised, fresh)
    t_ref = time.perf_counter() - t0
    with torch.no_grad():
        t0 = time.perf_counter()
        expected = model(*fresh)
        t_eager = time.perf_counter() - t0
    err = (got - expected).abs().max().item()
    p("\n-- 3. reference executor vs eager PyTorch on fresh random inputs")
    p(f"   max |sextant - eager| = {err:.3g}   (reference executor {t_ref * 1000:.1f} ms, "
      f"eager {t_eager * 1000:.1f} ms)")
    p("   next stages (kernels, LLVM, PTX) are not built yet: see the project's issues")
    return err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sextant.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="mlp", choices=sorted(EXAMPLES))
    parser.add_argument("--quiet", action="store_true", help="do not print the IR, only the summary")
    ns = parser.parse_args(argv)
    err = run_demo(ns.model, show_ir=not ns.quiet)
    return 0 if err < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
