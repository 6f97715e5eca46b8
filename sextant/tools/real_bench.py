"""Deployment-size models on the CPU, and where the time goes per kernel (``make bench``'s ``--real-size`` set).

The small set of ``make bench`` (hidden 128, 64×64 images) measures per-call overhead; at the sizes
people deploy, the GEMM and convolution kernels decide. Five models at their real sizes, built from
``transformers`` configs with random weights (no hub), fp32, batch 1:

| name | model |
|---|---|
| resnet50 | ResNet-50 (``ResNetConfig()``: bottleneck, depths 3-4-6-3), 224×224, logits |
| bert-base | BERT-base (``BertConfig()``), 128 tokens, last hidden state |
| vit-b16 | ViT-B/16 (``ViTConfig()``), 224×224, logits |
| gpt2-small | GPT-2 small, 124M (``GPT2Config()``), 256 tokens, logits |
| mobilenet-v2 | MobileNet-V2 (``MobileNetV2Config()``), 224×224, logits (stands in for torchvision's V3) |

Each model runs in its own process: eager, Inductor (``torch.compile``) and sextant's cpu target,
median of ``--iters`` calls after a warm-up, the backends' calls interleaved (one of each per round:
this VM's speed drifts within minutes), both cores for every path. Then sextant's program is
profiled launch by launch (``NativeRunner.profile``) and each launch's FLOPs (``report/cost.py``)
give its achieved GFLOP/s against this CPU's measured fp32 FMA peak (``tools/fma_peak.py``, all
cores). For the GEMM shapes that take the most time, torch's own ``a @ b`` (MKL) on the same shape
is timed in the same process: the vendor library's GFLOP/s to beat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

BEGIN, END = "<!-- real-bench:begin -->", "<!-- real-bench:end -->"
MARKERS = {"fp32": (BEGIN, END), "bf16": ("<!-- real-bench-bf16:begin -->", "<!-- real-bench-bf16:end -->")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Logits(nn.Module):
    """A ``transformers`` model whose forward returns one tensor (its ``field``)."""

    def __init__(self, model: nn.Module, field: str) -> None:
        super().__init__()
        self.model, self.field = model.eval(), field

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(x), self.field)


def _build(name: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model, args = _build_f32(name)
    return model.to(dtype), tuple(a.to(dtype) if a.is_floating_point() else a for a in args)


def _build_f32(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    import transformers as tf

    torch.manual_seed(0)
    image = (torch.randn(1, 3, 224, 224),)
    if name == "resnet50":
        return _Logits(tf.ResNetForImageClassification(tf.ResNetConfig()), "logits"), image
    if name == "bert-base":
        return _Logits(tf.BertModel(tf.BertConfig(), add_pooling_layer=False), "last_hidden_state"), \
            (torch.randint(0, 30522, (1, 128)),)
    if name == "vit-b16":
        return _Logits(tf.ViTForImageClassification(tf.ViTConfig()), "logits"), image
    if name == "gpt2-small":
        return _Logits(tf.GPT2LMHeadModel(tf.GPT2Config()), "logits"), (torch.randint(0, 50257, (1, 256)),)
    if name == "mobilenet-v2":
        return _Logits(tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config()), "logits"), image
    if name == "tiny":  # the tool's smoke test: a small ResNet with a Linear head, 32×32
        cfg = tf.ResNetConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
        return _Logits(tf.ResNetForImageClassification(cfg), "logits"), (torch.randn(1, 3, 32, 32),)
    raise SystemExit(f"unknown model {name!r}")


MODELS = ("resnet50", "bert-base", "vit-b16", "gpt2-small", "mobilenet-v2")


SPIN_DOWN_S = 0.05  # a pause between backends: longer than libgomp's spin-wait after a parallel region


def _median_ms(fns: dict[str, Callable[[], Any]], iters: int, settle: int = 1) -> dict[str, float]:
    """Median ms per call of each backend, their calls interleaved (rounds of ``settle`` untimed
    calls and one timed call of each): on a shared 2-core VM whose speed drifts by 15–50 % within
    minutes, timing one backend's ten calls after another's puts the drift into their ratio.

    Before each backend's calls the process sleeps ``SPIN_DOWN_S``: torch's OpenMP workers
    (libgomp) spin after a parallel region before they sleep — with ``OMP_WAIT_POLICY`` unset
    300,000 pause instructions, ~15 ms on an Ice Lake core — and a sextant call started in that
    window shares a core with them (on 2 Ice Lake cores BERT-base measured 101 ms one way and
    117 the other). ``OMP_WAIT_POLICY=PASSIVE`` would also spare sextant, but slows eager itself
    (its workers then sleep between every two ops: MobileNet-V2 34 → 62 ms), so eager runs with
    the default and the pause is taken out of nobody's time. The untimed calls let other thread
    pools wind down too."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            time.sleep(SPIN_DOWN_S)
            for _ in range(settle):
                fn()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _contraction(program: Any, launch: Any) -> tuple | None:
    """What a contraction launch computes, as a key: ("matmul", batch, M, N, K), ("conv", output shape,
    weight shape, stride, groups) or ("attention", q shape, k shape)."""
    g = program.groups[launch.group]
    a = g.anchor
    if g.kind == "matmul":
        x, w = a.inputs
        batch = 1
        for d in a.shape[:-2]:
            batch *= d
        return "matmul", batch, x.shape[-2], w.shape[-1], x.shape[-1]
    if g.kind == "conv":
        return "conv", tuple(a.shape), tuple(a.inputs[1].shape), tuple(a.attr("stride")), a.attr("groups")
    if g.kind == "attention" and g.attention is not None:
        return "attention", tuple(g.anchor.shape)
    return None


def _describe(key: tuple) -> str:
    dims = lambda t: "×".join(map(str, t))
    if key[0] == "matmul":
        return f"matmul {dims(key[1:])}"
    if key[0] == "conv":
        return f"conv → {dims(key[1])}, w {dims(key[2])}, stride {dims(key[3])}, groups {key[4]}"
    return f"attention → {dims(key[1])}"


def _mkl_gflops(batch: int, m: int, n: int, k: int, iters: int = 10, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(batch, m, k, dtype=dtype), torch.randn(batch, k, n, dtype=dtype)
    torch.matmul(a, b)
    ms = _median_ms({"mm": lambda: torch.matmul(a, b)}, iters, settle=0)["mm"]
    return 2 * batch * m * n * k / (ms * 1e-3) / 1e9


def run_model(name: str, iters: int, inductor: bool, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    import sextant
    from sextant.report.cost import program_costs
    model, args = _build(name, dtype)
    row: dict[str, Any] = {"model": name}
    with torch.no_grad():
        want = model(*args)
        t0 = time.perf_counter()
        compiled = sextant.compile(model, args, target="cpu", cache=False)
        row["sextant_compile_s"] = time.perf_counter() - t0
        got = compiled(*args)
        row["rel_err"] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        fns = {"eager": lambda: model(*args), "sextant": lambda: compiled(*args)}
        if inductor:
            opt = torch.compile(model)
            t0 = time.perf_counter()
            opt(*args)
            row["inductor_compile_s"] = time.perf_counter() - t0
            from torch._inductor.async_compile import shutdown_compile_workers

            shutdown_compile_workers()  # their processes would share the cores with the timed calls
            fns["inductor"] = lambda: opt(*args)
        for name, ms in _median_ms(fns, iters).items():
            row[f"{name}_ms"] = ms
    program = compiled.stages["program"]
    time.sleep(SPIN_DOWN_S)  # the last timed call may have been eager's or Inductor's
    per_launch = [s * 1e3 for s in compiled._executor.profile(list(args))]
    costs = program_costs(program)
    contraction = {"matmul", "conv", "attention"}
    kinds: dict[str, list[float]] = {}  # kind -> [ms, flops, bytes]
    shapes: dict[tuple, list[float]] = {}  # _contraction's key -> [ms, flops, launches]
    for la, ms, cost in zip(program.launches, per_launch, costs):
        kind = program.groups[la.group].kind if la.extern is None else "host call"
        acc = kinds.setdefault(kind, [0.0, 0, 0])
        acc[0] += ms
        acc[1] += cost.flops
        acc[2] += cost.bytes
        shape = _contraction(program, la) if la.extern is None else None
        if shape is not None:
            s = shapes.setdefault(shape, [0.0, 0, 0])
            s[0] += ms
            s[1] += cost.flops
            s[2] += 1
    row["kinds"] = {k: {"ms": v[0], "gflops": v[1] / (v[0] * 1e-3) / 1e9 if v[0] > 0 else 0.0,
                        "bytes_per_flop": v[2] / v[1] if v[1] else None} for k, v in kinds.items()}
    row["kernels_ms"] = sum(per_launch)
    cms = sum(v[0] for k, v in kinds.items() if k in contraction)
    cflops = sum(v[1] for k, v in kinds.items() if k in contraction)
    row["contraction_ms"], row["contraction_gflops"] = cms, cflops / (cms * 1e-3) / 1e9 if cms else 0.0
    top = sorted(shapes.items(), key=lambda kv: -kv[1][0])[:4]
    row["gemms"] = [{"what": _describe(sh), "ms": v[0], "launches": v[2], "gflops": v[1] / (v[0] * 1e-3) / 1e9,
                     "mkl_gflops": _mkl_gflops(*sh[1:], dtype=dtype) if sh[0] == "matmul" else None} for sh, v in top]
    return row


def _child(name: str, ns: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "sextant.tools.real_bench", "--child", name, "--iters", str(ns.iters),
           "--dtype", ns.dtype]
    if ns.no_inductor:
        cmd.append("--no-inductor")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"real bench {name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def to_markdown(rows: list[dict[str, Any]], peak_gflops: float, library: str = "MKL", product: str = "`a @ b`") -> str:
    """The tables; ``peak_gflops``: the measured all-core peak the percentages refer to; ``library``
    computes torch's own ``product`` on the same shapes."""
    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "–"

    lines = ["| model | eager ms | Inductor × eager | sextant ms | × eager | × Inductor | GEMM/conv/attention share "
             "| their GFLOP/s (% of peak) | other kernels ms | outside the profile ms | sextant compile s | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ind = r.get("inductor_ms")
        other = r["kernels_ms"] - r["contraction_ms"]
        lines.append(
            f"| {r['model']} | {r['eager_ms']:.1f} | {f(ind / r['eager_ms'] if ind else None, '.2f')} | "
            f"{r['sextant_ms']:.1f} | {r['sextant_ms'] / r['eager_ms']:.2f} | "
            f"{f(r['sextant_ms'] / ind if ind else None, '.2f')} | "
            f"{100 * r['contraction_ms'] / r['sextant_ms']:.0f}% | {r['contraction_gflops']:.0f} "
            f"({100 * r['contraction_gflops'] / peak_gflops:.0f}%) | {other:.1f} | "
            f"{r['sextant_ms'] - r['kernels_ms']:.1f} | {r['sextant_compile_s']:.1f} | {r['rel_err']:.0e} |")
    lines += ["", "Per model, the four contraction shapes that take the most time (a matmul as batch × M × N × K; "
              f"sextant's GFLOP/s inside the forward; for a matmul, torch's {product} — {library} — on the same "
              "shape in the same process):", "",
              f"| model | kernel | launches | sextant ms | GFLOP/s | % of peak | {library} GFLOP/s | "
              f"sextant / {library} |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for g in r["gemms"]:
            mkl = g["mkl_gflops"]
            lines.append(f"| {r['model']} | {g['what']} | {g['launches']} | {g['ms']:.2f} | {g['gflops']:.0f} | "
                         f"{100 * g['gflops'] / peak_gflops:.0f}% | {f(mkl, '.0f')} | "
                         f"{f(g['gflops'] / mkl if mkl else None, '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sextant.tools.real_bench", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="bf16: the models in bf16 (eager's GEMMs then oneDNN's bf16 kernels)")
    p.add_argument("--markdown", help="rewrite the real-bench block of this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        print(json.dumps(run_model(ns.child, ns.iters, not ns.no_inductor, DTYPES[ns.dtype])))
        return 0
    from sextant.host import host_amx, host_pair_dot
    from sextant.tools.bench import _machine, publish
    from sextant.tools.fma_peak import measure

    bf16 = ns.dtype == "bf16"
    kind = "amx" if bf16 and host_amx() else "bf16 dot" if bf16 and host_pair_dot() else "fma"
    # the peak of the instruction the GEMMs use, on an idle machine: before the models and again
    # after them, the higher kept (a VM's neighbour can take a core for a few seconds: one such
    # measurement here read 116 GFLOP/s on 2 cores against 176-191 in the runs beside it)
    before = measure(kind=kind)
    rows = []
    for name in ns.models.split(","):
        print(f"real bench: {name} ...", file=sys.stderr, flush=True)
        rows.append(_child(name, ns))
    measure.cache_clear()
    peak = max(before, measure(kind=kind), key=lambda p: p.all_cores)
    text = "\n".join([f"Machine: {_machine()}; {peak}.", "",
                      f"{ns.dtype}, batch 1; ms: median of {ns.iters} calls after a warm-up, eager's, Inductor's and "
                      "sextant's calls interleaved (one of each per round). Shares and GFLOP/s come "
                      "from sextant's per-launch profile (each launch's plan row run back to back inside the "
                      "native executor, so with warm caches); *outside the profile* is the rest of a call: the "
                      "per-call overhead (microseconds) and, mostly, what cold caches cost inside a forward — "
                      "every weight streamed from memory once per call (ViT-B/16: 344 MB), which launches "
                      "repeated back to back do not pay.", "",
                      to_markdown(rows, peak.all_cores, *(("oneDNN", "bf16 `a @ b`") if bf16 else ()))])
    publish(text, ns.markdown, *MARKERS[ns.dtype])
    return 0


if __name__ == "__main__":
    sys.exit(main())
