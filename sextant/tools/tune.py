"""Autotuning: time every tile candidate of a model's tensor-core GEMMs and convolutions on the
GPU, and store the fastest per problem, so later compiles for that architecture use it.

The tile of each GEMM/convolution mapping is chosen from a few verified candidates by the cost
model (``schedule/gemm_cost.py``) or a heuristic (the Hopper tiles); both are estimates. This
tool measures instead, inside the real model (its fused epilogues, its operand layouts):

1. compile the model once with the model's choices; every kernel that chose a tile names its
   problem (``schedule/tuning.py``: mapping, m×n×k, batch, dtype, arch) and its candidates;
2. compile it again once per candidate *index* — round ``i`` gives every problem its ``i``-th
   candidate through a :class:`~sextant.schedule.tuning.TileTable` (no global switch) — check the
   output against eager, and time each launch on the GPU (``CudaRunner.profile``: the launch
   repeated back to back between CUDA events); a problem's time in a round is the sum over its
   launches (GPT-2's twelve layers share four problems);
3. store each problem's fastest candidate, with every candidate's time and the device, in
   ``runtime/tuning_store.py``'s file for the architecture (after each case, so a run cut short
   keeps what it measured). ``sextant.compile`` for that
   architecture reads it; the compile cache's key includes it.

So a model with ``c`` candidates per problem costs ``c + 1`` compiles, whatever its number of
problems. A candidate that fails to compile or gives a wrong result is reported and never stored;
as a round compiles all its problems together, such a failure fails that round's candidate of
every problem (run the failing case alone, or with fewer problems, to separate them).

    python -m sextant.tools.tune [--cases gpt2-12l-b8-s512-fp16,...] [--arch sm_90a] [--out FILE]
    python -m sextant.tools.tune --dry-run   # no GPU: tiny sizes through cuda-sim, nothing stored

The cases are ``gpu_bench``'s (default: its half-precision GEMM, GPT-2 and convolution cases).
``--dry-run`` compiles every round of every case at tiny sizes for ``cuda-sim`` (the same
schedules, PTX, ptxas) and checks each against eager on the CPU: everything but the timing is
known to work before a GPU is spent on it. The table goes to stdout, ``--out``, and
``$OUT/tune.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sextant.api import compile_graph
from sextant.frontend.capture import capture
from sextant.runtime.compiled import CompiledModule
from sextant.runtime.tuning_store import Measured, save
from sextant.schedule.tuning import NO_TILES, TileProblem, TileTable

DEFAULT_CASES = ("matmul-4096-fp16", "matmul-4096-bf16", "gpt2-12l-b8-s512-fp16", "resnet-bottleneck-b32-fp16")
TOL = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1.5e-1}  # relative to the output's scale
# seconds per launch, in program.launches order (extern calls included), for one compiled model
Timer = Callable[[CompiledModule, tuple], list[float]]


def gpu_timer(repeats: int = 20) -> Timer:
    """Each launch timed on the GPU, repeated back to back between CUDA events."""

    def time_launches(compiled: CompiledModule, args: tuple) -> list[float]:
        return compiled.stages["runner"].profile(compiled.flat_inputs(args, {}), repeats)

    return time_launches


@dataclass
class ProblemResult:
    problem: TileProblem
    candidates: tuple[str, ...]
    model_choice: str
    launches: int
    times_ms: dict[str, float] = field(default_factory=dict)  # per call of the model, summed over launches
    checked: list[str] = field(default_factory=list)  # candidates that compiled and matched eager
    failed: dict[str, str] = field(default_factory=dict)  # candidate -> why


def problems_of(compiled: CompiledModule) -> dict[TileProblem, tuple[tuple[str, ...], str, int]]:
    """The tile decisions of a compiled GPU program: problem -> (candidates, chosen tile, launches)."""
    program = compiled.stages["program"]
    out: dict[TileProblem, tuple[tuple[str, ...], str, int]] = {}
    for launch in program.launches:
        kernel = program.kernels.get(launch.kernel) if launch.extern is None else None
        if kernel is None or "problem" not in kernel.meta:
            continue
        p = TileProblem.parse(kernel.meta["problem"])
        cands, chosen, n = out.get(p, (tuple(kernel.meta["candidates"]), "", 0))
        out[p] = (cands, chosen or kernel.meta["tile_name"], n + 1)
    return out


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when ``got`` matches eager's output within the dtype's tolerance, else why not."""
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    err = (got.float() - expected.float()).abs().max().item()
    scale = max(1.0, expected.float().abs().max().item())
    return None if err <= TOL.get(dtype, 1e-3) * scale else f"max error {err:.3g} (scale {scale:.3g})"


def tune(module: torch.nn.Module, args: tuple, *, target: str, arch: str, timer: Timer | None,
         log: Callable[[str], None] = lambda s: None) -> list[ProblemResult]:
    """Every candidate of every tile problem of ``module(*args)`` compiled (one compile per
    candidate index), checked against eager, and timed by ``timer`` (None: checked only).
    ``module`` and ``args`` are on the CPU; with ``target="cuda"`` both eager and the compiled
    model run on the GPU."""
    device = "cuda" if target == "cuda" else "cpu"
    run_args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.inference_mode():
        expected = copy.deepcopy(module).to(device)(*run_args)
    dtype = expected.dtype
    captured = capture(module, args)
    base = compile_graph(captured, target=target, arch=arch, tiles=NO_TILES)
    found = problems_of(base)
    results = [ProblemResult(p, cands, chosen, n) for p, (cands, chosen, n) in sorted(found.items())]
    log(f"  {len(results)} tile problems, {max((len(r.candidates) for r in results), default=0)} rounds")
    for i in range(max((len(r.candidates) for r in results), default=0)):
        table = TileTable.of({r.problem: r.candidates[i] for r in results if i < len(r.candidates)})
        t0 = time.perf_counter()
        try:
            compiled = compile_graph(captured, target=target, arch=arch, tiles=table)
            why = _close(compiled(*run_args), expected, dtype)
        except Exception as e:  # one bad candidate must not end the run; the round's problems report it
            traceback.print_exc(file=sys.stderr)
            compiled, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for r in results:
            if i < len(r.candidates) and why is not None:
                r.failed[r.candidates[i]] = why
        if compiled is None or why is not None:
            continue
        program = compiled.stages["program"]
        seconds = timer(compiled, run_args) if timer is not None else None
        for r in results:
            if i >= len(r.candidates):
                continue
            name, total, seen, ignored = r.candidates[i], 0.0, 0, False
            for j, launch in enumerate(program.launches):
                kernel = program.kernels.get(launch.kernel) if launch.extern is None else None
                if kernel is None or kernel.meta.get("problem") != r.problem.key:
                    continue
                ignored |= kernel.meta.get("tile_name") != name
                seen += 1
                total += seconds[j] if seconds is not None else 0.0
            if ignored:  # a mapping bug: what was timed is not this candidate
                r.failed[name] = "a kernel of this problem did not build the candidate"
            elif seen:
                r.checked.append(name)
                if seconds is not None:
                    r.times_ms[name] = total * 1e3
        log(f"  round {i}: {len(table)} problems, {time.perf_counter() - t0:.1f} s")
    return results


def measured(results: Sequence[ProblemResult], device: str) -> dict[TileProblem, Measured]:
    """What the store keeps: the timed problems (a problem with one candidate has nothing to choose)."""
    return {r.problem: Measured(dict(r.times_ms), device) for r in results if len(r.times_ms) > 1}


def table(case: str, results: Sequence[ProblemResult]) -> str:
    lines = [f"### {case}", "",
             "| problem (mapping/arch/dtype/m×n×k*batch) | launches | model's tile | ms | fastest | ms | gain |",
             "|---|---:|---|---:|---|---:|---:|"]
    for r in results:
        if r.times_ms:
            best = min(r.times_ms, key=lambda n: r.times_ms[n])
            mine = r.times_ms.get(r.model_choice)
            gain = f"{mine / r.times_ms[best]:.2f}×" if mine else "—"
            cells = [r.model_choice, f"{mine:.3f}" if mine else "—", best, f"{r.times_ms[best]:.3f}", gain]
        else:
            cells = [r.model_choice, "—", f"{len(r.checked)}/{len(r.candidates)} match eager", "—", "—"]
        lines.append(f"| {r.problem.key} | {r.launches} | " + " | ".join(cells) + " |")
        for name, why in r.failed.items():
            lines.append(f"| ↳ {name} failed | | {why} | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from sextant.tools.gpu_bench import _cases, _cast

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="gpu_bench case names, comma-separated")
    ap.add_argument("--arch", default=None, help="GPU architecture (default: the device's; sm_90a in --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes through cuda-sim; nothing timed or stored")
    ap.add_argument("--repeats", type=int, default=20, help="back-to-back launches per timing")
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args(argv)
    known = {c.name: c for c in _cases()}
    names = [n for n in opts.cases.split(",") if n]
    unknown = [n for n in names if n not in known or known[n].kind != "forward"]
    if unknown:
        forward = sorted(n for n, c in known.items() if c.kind == "forward")
        ap.error(f"unknown or non-forward cases {unknown}; choose from {', '.join(forward)}")
    if opts.dry_run:
        target, arch, device, timer = "cuda-sim", opts.arch or "sm_90a", "cuda-sim (CPU)", None
    else:
        from sextant.runtime.cuda import device_arch, require_cuda

        dev = require_cuda()
        target, arch, timer = "cuda", opts.arch or device_arch(dev), gpu_timer(opts.repeats)
        device = torch.cuda.get_device_name(dev)
    report = [f"## Tile autotuning: {device}, {arch}{' (dry run: checked, not timed)' if opts.dry_run else ''}\n"]
    paths = [p for p in (opts.out, Path(os.environ["OUT"]) / "tune.md" if os.environ.get("OUT") else None) if p]

    def publish() -> None:  # after every case: a run cut short by a timeout keeps what it measured
        for path in paths:
            path.write_text("\n".join(report))

    print(report[0])
    for name in names:
        case = known[name]
        print(f"{name}:", file=sys.stderr)
        model, args = case.build(opts.dry_run)
        model, args = _cast(model, args, case.dtype, "cpu")  # compiled from the CPU copy, run on `target`
        try:
            results = tune(model, args, target=target, arch=arch, timer=timer,
                           log=lambda s: print(s, file=sys.stderr))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            report.append(f"### {name}\n\nfailed: {type(e).__name__}: {e}\n")
            print(report[-1])
            publish()
            continue
        report.append(table(name, results))
        found = measured(results, device)
        if found and not opts.dry_run:
            report.append(f"{len(found)} problems stored in {save(arch, found)}\n")
        print(report[-1] if not found or opts.dry_run else "\n".join(report[-2:]))
        publish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
