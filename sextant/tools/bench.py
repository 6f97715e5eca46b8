"""``make bench``: sextant's CPU target side by side with eager PyTorch and torch.compile.

For each model: compile time (torch.export + decompositions, then sextant's own stages),
median run time, kernel count and planned peak memory, and the ratio to eager, all measured
in one run; then a profile of where sextant's time goes (per kernel kind, the slowest kernel,
and the per-call overhead outside the kernels). Writes markdown tables to docs/benchmarks.md
with the machine they ran on.

    python -m sextant.tools.bench [--models mlp,cnn,...] [--no-inductor] [--out FILE]

The default set is the examples plus :mod:`sextant.zoo` (real architectures from small configs).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sextant.examples import EXAMPLES, gpt2
from sextant.gcpause import gc_paused
from sextant.zoo import ZOO

ROOT = Path(__file__).resolve().parents[2]

MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "mlp": EXAMPLES["mlp"],
    "cnn": EXAMPLES["cnn"],
    "transformer-block": EXAMPLES["transformer-block"],
    "gpt2-2l": lambda: gpt2(n_layer=2, batch=1, seq=128),
    "gpt2-12l": lambda: gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257, batch=1, seq=128),
    **ZOO,
}


def _median_time(fn: Callable[[], object], min_runs: int = 5, budget_s: float = 3.0) -> float:
    fn()  # warm up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(name: str, inductor: bool) -> dict[str, object]:
    from sextant.codegen.llvm_cpu import compile_kernels
    from sextant.frontend.capture import export, translate
    from sextant.graph.passes import run_pipeline
    from sextant.runtime.compiled import CompiledModule
    from sextant.runtime.native_runner import NativeRunner
    from sextant.schedule.program import schedule
    from sextant.schedule.target import cpu_target

    model, args = MODELS[name]()
    row: dict[str, object] = {"model": name}
    with torch.no_grad():
        row["eager_ms"] = _median_time(lambda: model(*args)) * 1e3
        expected = model(*args)

    with gc_paused():  # as sextant.compile does
        t0 = time.perf_counter()
        ep = export(model, args)
        t1 = time.perf_counter()
        graph = run_pipeline(translate(ep, name.replace("-", "_")))
        t2 = time.perf_counter()
        program = schedule(graph, cpu_target())
        t3 = time.perf_counter()
        module = compile_kernels(list(program.kernels.values()))
        t4 = time.perf_counter()
        compile_kernels(list(program.kernels.values()))  # again: every object from the cache
        t5 = time.perf_counter()
    runner = NativeRunner(program, module)
    compiled = CompiledModule(graph, "cpu", runner)
    row.update(export_s=t1 - t0, graph_s=t2 - t1, schedule_s=t3 - t2, codegen_s=t4 - t3, codegen_warm_s=t5 - t4,
               kernels=len(program.launches), unique_kernels=len(program.kernels),
               peak_mib=program.peak_bytes / 2**20, nodes=len(graph.nodes))
    got = compiled(*args)
    row["max_err"] = (got - expected).abs().max().item()
    row["rel_err"] = row["max_err"] / max(expected.abs().max().item(), 1e-30)
    row["sextant_ms"] = _median_time(lambda: compiled(*args)) * 1e3
    row["profile"] = profile(runner, program, [a for a in args if isinstance(a, torch.Tensor)],
                             row["sextant_ms"])  # type: ignore[arg-type]

    if inductor:
        torch._dynamo.reset()
        opt = torch.compile(model)
        t0 = time.perf_counter()
        with torch.no_grad():
            opt(*args)
        row["inductor_compile_s"] = time.perf_counter() - t0
        with torch.no_grad():
            row["inductor_ms"] = _median_time(lambda: opt(*args)) * 1e3
        # Inductor's compile workers stay alive (and busy) after it returns; on 2 cores they
        # landed in the next model's timings (a 0.1 ms CNN measured at 0.7 ms): stop them
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    return row


def profile(runner: object, program: object, inputs: list[torch.Tensor], total_ms: float) -> dict[str, object]:
    """Each launch's time inside the native executor (``NativeRunner.profile``: its plan row run
    back to back, no Python between), summed per kernel kind; the rest of a call's time
    (allocating outputs, argument slots, the executor's barriers, the hand-off to the worker
    thread) is overhead."""
    per_launch = [s * 1e3 for s in runner.profile(inputs)]  # type: ignore[attr-defined]
    kinds: dict[str, float] = {}
    worst = (0.0, "")
    for launch, ms in zip(program.launches, per_launch):  # type: ignore[attr-defined]
        g = program.groups[launch.group]  # type: ignore[attr-defined]
        kinds[g.kind] = kinds.get(g.kind, 0.0) + ms
        if ms > worst[0]:
            shape = "×".join(map(str, g.anchor.shape))
            worst = (ms, f"{g.kind} {g.anchor.op} {shape}")
    kernels = sum(per_launch)
    return {"kinds": kinds, "kernels_ms": kernels, "overhead_ms": total_ms - kernels, "worst": worst}


def publish(text: str, markdown: str | Path | None, begin: str, end: str) -> None:
    """Print a benchmark's report and, given a markdown file, put it between that file's markers
    ``begin`` and ``end`` (its block in docs/benchmarks.md)."""
    print(text)
    if not markdown:
        return
    path = Path(markdown)
    doc = path.read_text()
    if begin not in doc or end not in doc.split(begin, 1)[1]:
        raise SystemExit(f"{path} has no {begin} ... {end} block")
    head, rest = doc.split(begin, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import llvmlite.binding as llvm

    from sextant.host import host_cpu_features, host_pair_dot, host_vector_bytes

    isa = "AVX-512" if host_vector_bytes() == 64 else "AVX2"
    if host_pair_dot():
        isa += ", AVX-512-BF16"
    isa += ", AMX" if "amx-bf16" in host_cpu_features() else ", no AMX"
    return (f"{cpu} ({llvm.get_host_cpu_name()}, {isa}), {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} torch threads")


HAND_WRITTEN = "<!-- hand-written below: kept when make bench rewrites the table -->"


def to_markdown(rows: list[dict[str, object]]) -> str:
    def f(v: object, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "–"

    lines = [
        "| model | eager ms | sextant cpu ms | × eager | torch.compile ms | × eager | kernels (unique) "
        "| peak MiB | export s | sextant stages s, cold | … cached | Inductor compile s | max abs err (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eager = r["eager_ms"]
        own = _own(r)
        ind = r.get("inductor_ms")
        lines.append(
            f"| {r['model']} | {f(eager, '.2f')} | {f(r['sextant_ms'], '.2f')} | "
            f"{f(r['sextant_ms'] / eager, '.2f')} | {f(ind, '.2f')} | "  # type: ignore[operator]
            f"{f(ind / eager if ind else None, '.2f')} | {r['kernels']} ({r['unique_kernels']}) | "  # type: ignore[operator]
            f"{f(r['peak_mib'], '.2f')} | {f(r['export_s'], '.2f')} | {f(own, '.2f')} "
            f"(graph {f(r['graph_s'], '.2f')}, schedule {f(r['schedule_s'], '.2f')}, "
            f"codegen {f(r['codegen_s'], '.2f')}) | {f(_own(r, warm=True), '.2f')} | "
            f"{f(r.get('inductor_compile_s'), '.1f')} | "
            f"{f(r['max_err'], '.1e')} ({f(r.get('rel_err'), '.0e')}) |")
    return "\n".join(lines)


def profile_markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| model | sextant ms | matmul | conv | attention | reduce | elementwise | overhead | slowest launch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("profile")
        if not isinstance(p, dict):
            continue
        kinds = p["kinds"]
        total = r["sextant_ms"]

        def share(ms: float, total: float = total) -> str:  # type: ignore[assignment]
            return f"{ms:.2f} ({100 * ms / total:.0f}%)" if ms else "–"

        ms, what = p["worst"]
        lines.append(f"| {r['model']} | {total:.2f} | " + " | ".join(share(kinds.get(k, 0.0)) for k in
                                                                    ("matmul", "conv", "attention", "reduce",
                                                                     "elementwise"))
                     + f" | {share(p['overhead_ms'])} | {ms:.2f} ms {what} |")
    return "\n".join(lines)


def _own(r: dict[str, object], warm: bool = False) -> float:
    """sextant's own compile stages (after export); ``warm``: with every kernel object cached."""
    return sum(r[k] for k in ("graph_s", "schedule_s", "codegen_warm_s" if warm else "codegen_s"))  # type: ignore[misc]


def ratios_summary(rows: list[dict[str, object]]) -> str:
    ratios = sorted(r["sextant_ms"] / r["eager_ms"] for r in rows)  # type: ignore[operator]
    own, warm = sorted(_own(r) for r in rows), sorted(_own(r, warm=True) for r in rows)
    if not ratios:
        return ""
    return (f"Median run-time ratio to eager: **{statistics.median(ratios):.2f}** (worst {ratios[-1]:.2f}); "
            f"sextant's own compile stages: median {statistics.median(own):.2f} s, worst {own[-1]:.2f} s "
            f"(cold object cache); with the kernel objects cached: median {statistics.median(warm):.2f} s, "
            f"worst {warm[-1]:.2f} s.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sextant.tools.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--keep-cache", action="store_true", help="use the usual object cache (default: a fresh "
                    "one, so the cold compile times are cold)")
    ap.add_argument("--real-size", action="store_true", help="the deployment-size set instead "
                    "(tools/real_bench.py: ResNet-50, BERT-base, ViT-B/16, GPT-2 small, MobileNet-V2, per-kernel "
                    "efficiency), into its block of --out")
    ap.add_argument("--real-size-bf16", action="store_true", help="the transformers of the deployment-size set "
                    "in bf16 (sextant's GEMMs on AVX-512-BF16 where the CPU has it), into their block of --out")
    ns = ap.parse_args(argv)
    if ns.real_size:
        from sextant.tools import real_bench

        return real_bench.main(["--markdown", ns.out] + (["--no-inductor"] if ns.no_inductor else []))
    if ns.real_size_bf16:
        from sextant.tools import real_bench

        return real_bench.main(["--markdown", ns.out, "--dtype", "bf16", "--models", "bert-base,vit-b16,gpt2-small"]
                               + (["--no-inductor"] if ns.no_inductor else []))
    if not ns.keep_cache:
        os.environ["SEXTANT_CACHE_DIR"] = tempfile.mkdtemp(prefix="sextant-bench-cache-")
    rows = []
    for name in ns.models.split(","):
        print(f"bench {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_model(name, not ns.no_inductor))
        print(to_markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    table = to_markdown(rows)
    text = (
        "# Benchmarks\n\n"
        "Generated by `make bench` (`python -m sextant.tools.bench`); every number below comes from one run.\n\n"
        f"Machine: {_machine()}.\n\n"
        "Run times are medians over repeated calls after a warm-up. The examples run at batch 1 (GPT-2 at "
        "sequence 128); the real architectures of `sextant/zoo.py` at batch 2, sequence 16 or 64×64 images "
        "(ResNet-50: full size, batch 1). `× eager` below 1 is faster than eager. Compile time is split into "
        "torch.export + Core ATen decompositions and sextant's own stages (translation + graph passes, "
        "scheduling, LLVM code generation + JIT), first with an empty object cache (cold), then the LLVM "
        "stage again with every kernel's object in the cache (`sextant/codegen/objects.py`).\n\n"
        + table + "\n\n" + ratios_summary(rows) + "\n\n"
        "### Where sextant's time goes\n\n"
        "Each launch timed inside the native executor (its plan row run 10 times back to back after a "
        "whole forward, `NativeRunner.profile`), summed per kernel kind; *overhead* is the rest of a call "
        "(outputs allocated, argument slots, the executor's barriers and the hand-off to the second "
        "worker thread; slightly negative when a launch runs faster in the forward, its inputs still in "
        "cache, than repeated).\n\n" + profile_markdown(rows) + "\n"
    )
    print(table)
    if ns.out:
        out = Path(ns.out)
        old = out.read_text() if out.exists() else ""
        keep = old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else ""  # the analysis is kept
        out.write_text(text + ("\n" + keep if keep else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
