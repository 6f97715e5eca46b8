"""A tensor-parallel Llama-style model on several CPU ranks (gloo), timed: ``python -m sextant.tools.dist_bench``.

The model (``tools/tp_llama.py``) is sharded Megatron-style with ``parallelize_module``
(q/k/v, gate, up column-parallel; o, down row-parallel: two all_reduces per layer in the forward,
their transposes in the backward) and run by each path in fresh processes, one per rank, one
thread each: eager; ``torch.compile`` (Inductor); ``torch.compile(backend="sextant")``. Measured
per path: a forward under ``no_grad`` and a training step (forward, backward, SGD step over the
sharded parameters, the step compiled too), ms per call (median
of ``--iters`` after ``--warmup``; the ranks meet at a barrier before each timed call, and the
slowest rank's time counts), the warm-up (compile) time, and the largest difference between
rank 0's logits and the unsharded model's.

    python -m sextant.tools.dist_bench [--world 2] [--iters 10] [--markdown docs/benchmarks.md]

A single lent GPU can only run world size 1: the CUDA path (NCCL) is not benchmarked here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

PATHS = ("eager", "inductor", "sextant")
BEGIN, END = "<!-- dist-bench:begin -->", "<!-- dist-bench:end -->"
CONFIG = {"vocab": 512, "dim": 512, "heads": 8, "hidden": 1408, "layers": 2}
BATCH, SEQ = 2, 128


def _timed(fn: Any, iters: int, warmup: int) -> tuple[float, float]:
    """(median ms of ``iters`` calls, seconds of the ``warmup`` calls); the slowest rank's figures."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    ms = torch.tensor([statistics.median(times) * 1e3, warm])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms[0].item(), ms[1].item()


def run_rank(path: str, rank: int, world: int, store: str, iters: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sextant.tools.tp_llama import TinyLlama, tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = TinyLlama(**CONFIG)
    model = tensor_parallel(copy.deepcopy(full), mesh)
    tokens = torch.randint(0, CONFIG["vocab"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if path == "sextant":
        import sextant  # noqa: F401  (registers the backend)
    run = model if path == "eager" else torch.compile(model, backend="inductor" if path == "inductor" else "sextant")
    with torch.no_grad():
        want = full(tokens)
        got = run(tokens)
        fwd_ms, fwd_warm = _timed(lambda: run(tokens), iters, warmup)

    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    backend = "inductor" if path == "inductor" else "sextant"
    opt_step = opt.step if path == "eager" else torch.compile(opt.step, backend=backend)

    def step() -> None:
        opt.zero_grad()
        run(tokens).float().square().mean().backward()
        opt_step()

    train_ms, train_warm = _timed(step, iters, warmup)
    dist.destroy_process_group()
    return {"path": path, "forward_ms": fwd_ms, "train_ms": train_ms, "warmup_s": fwd_warm + train_warm,
            "max_err": (got - want).abs().max().item(), "notes": _sextant_notes() if path == "sextant" else ""}


def _sextant_notes() -> str:
    """Which graphs sextant compiled (a fallback to eager would show here) and how many of their
    transfers overlap kernels."""
    from sextant.frontend.dynamo import STATS
    from sextant.schedule.program import CollectiveCall

    parts = []
    for g in STATS.graphs:
        if g.compiled is None:
            parts.append(f"{g.role}: eager ({g.reason})")
            continue
        program = getattr(g.compiled, "compiled", g.compiled).stages["program"]
        starts = [li for li, la in enumerate(program.launches)
                  if isinstance(la.extern, CollectiveCall) and la.extern.stage == "start"]
        waits = {la.args: li for li, la in enumerate(program.launches)
                 if isinstance(la.extern, CollectiveCall) and la.extern.stage == "wait"}
        overlapped = sum(any(x.extern is None for x in program.launches[s + 1:waits[program.launches[s].args]])
                         for s in starts)
        parts.append(f"{g.role}: {sum(la.extern is None for la in program.launches)} kernels, "
                     f"{len(starts)} collectives ({overlapped} overlapping kernels)")
    return "; ".join(parts)


def _run_path(path: str, ns: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SEXTANT_CPU_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-m", "sextant.tools.dist_bench", "--child", path, "--rank",
                                   str(r), "--world", str(ns.world), "--store", f"{tmp}/store", "--iters",
                                   str(ns.iters), "--warmup", str(ns.warmup)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(ns.world)]
        outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{path}: a rank failed:\n" + "\n".join(err[-3000:] for _, err in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])


def to_markdown(rows: list[dict[str, Any]]) -> str:
    eager = next(r for r in rows if r["path"] == "eager")
    inductor = next((r for r in rows if r["path"] == "inductor"), None)
    lines = ["| path | forward ms | × eager | × Inductor | train step ms | × eager | × Inductor | warm-up s | "
             "max abs err (logits) |", "|---|---|---|---|---|---|---|---|---|"]
    def ratio(r: dict[str, Any], key: str, base: dict[str, Any] | None) -> str:
        return f"{r[key] / base[key]:.2f}" if base else "–"

    for r in rows:
        lines.append(f"| {r['path']} | {r['forward_ms']:.1f} | {ratio(r, 'forward_ms', eager)} | "
                     f"{ratio(r, 'forward_ms', inductor)} | {r['train_ms']:.1f} | {ratio(r, 'train_ms', eager)} | "
                     f"{ratio(r, 'train_ms', inductor)} | {r['warmup_s']:.1f} | {r['max_err']:.1e} |")
    notes = [f"- {r['path']}: {r['notes']}" for r in rows if r.get("notes")]
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sextant.tools.dist_bench", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--markdown", help="rewrite the dist-bench block of this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        print(json.dumps(run_rank(ns.child, ns.rank, ns.world, ns.store, ns.iters, ns.warmup)))
        return 0
    from sextant.tools.bench import _machine, publish

    rows = []
    for path in ns.paths.split(","):
        print(f"dist bench: {path} on {ns.world} ranks ...", file=sys.stderr, flush=True)
        rows.append(_run_path(path, ns))
    cfg = ", ".join(f"{k} {v}" for k, v in CONFIG.items())
    text = "\n".join([
        f"Machine: {_machine()}; {ns.world} ranks (gloo), one thread each.", "",
        f"TP Llama-style model ({cfg}; batch {BATCH}, sequence {SEQ}, fp32), Megatron-sharded with "
        f"`parallelize_module`; ms per call: median of {ns.iters} after {ns.warmup} warm-up calls, slowest rank. "
        "train step: forward, backward and an SGD step (momentum 0.9) over the sharded parameters, the step "
        "compiled by the same backend.", "", to_markdown(rows)])
    publish(text, ns.markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
