"""One training step — forward, backward, optimizer — timed: ``python -m sextant.tools.train_bench``.

Three small-config models, fp32 on the CPU, trained with SGD (momentum 0.9): a GPT-2-style LM
(``transformers.GPT2LMHeadModel``), a ResNet-style CNN with BatchNorm in training mode, and a ViT
(``transformers.ViTForImageClassification``); dropout 0, so that every path computes the same losses
(sextant draws its own Philox numbers, not torch's). Each
(model, path) runs in its own process, so its peak memory is its own and Inductor's compile workers
cannot land in another path's timings. Paths: eager; ``torch.compile`` (Inductor, default mode);
``torch.compile(backend="sextant")`` (forward and backward graphs compiled by sextant). Both compiled
paths compile the optimizer step too (``torch.compile(opt.step, ...)``). Every path trains the same
seeded weights on the same batches; the last step's loss is checked against eager's.

Reported: ms/step (median of ``--steps`` after ``--warmup`` steps, the compiles inside the warm-up),
the ratio to eager and to Inductor, the warm-up (compile) time, and the process's peak resident set
(``VmHWM``: model, compile, training).

    python -m sextant.tools.train_bench [--models gpt2,resnet,vit] [--steps 10] [--warmup 3]
                                        [--markdown docs/benchmarks.md]

``--markdown`` rewrites the train-bench block of that file with the run's table and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("eager", "inductor", "sextant")
BEGIN, END = "<!-- train-bench:begin -->", "<!-- train-bench:end -->"
SEED = 0


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


class ResNetish(nn.Module):
    """A ResNet-18-shaped CNN at small width: a stem, four stages of two basic blocks, a head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans, blocks, cin = [width, 2 * width, 4 * width, 8 * width], [], width
        for i, c in enumerate(chans):
            blocks += [_Block(cin, c, 1 if i == 0 else 2), _Block(c, c, 1)]
            cin = c
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x)).mean((2, 3))
        return F.cross_entropy(self.head(h), y)


class _HFLoss(nn.Module):
    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "lm":
            return self.model(input_ids=x, labels=y).loss
        return self.model(pixel_values=x, labels=y).loss


def build(name: str) -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]], str]:
    """(model returning its loss, a batch maker, a description) for ``name``."""
    torch.manual_seed(SEED)
    if name == "gpt2":
        import transformers

        cfg = transformers.GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = _HFLoss(transformers.GPT2LMHeadModel(cfg), "lm")

        def lm_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, 2048, (4, 128), generator=g)
            return ids, ids.clone()

        return model, lm_batch, "GPT-2 LM: 4 layers × 256, 4 heads, vocab 2048; batch 4 × 128 tokens"
    if name == "resnet":
        def image_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)

        return ResNetish(), image_batch, "ResNet-18-shaped CNN, width 16, BatchNorm; batch 16 × 3×32×32"
    if name == "vit":
        import transformers

        cfg = transformers.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=192, num_hidden_layers=4,
                                     num_attention_heads=3, intermediate_size=768, num_labels=10,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = _HFLoss(transformers.ViTForImageClassification(cfg), "image")

        def vit_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)

        return model, vit_batch, "ViT: 4 layers × 192, 3 heads, 4×4 patches; batch 16 × 3×32×32"
    raise ValueError(f"unknown model {name!r}")


def _peak_rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_path(name: str, path: str, steps: int, warmup: int) -> dict[str, object]:
    """Train ``name`` by ``path`` for ``warmup + steps`` steps; times, last loss, peak memory."""
    model, batch, _ = build(name)
    model.train()
    if path == "inductor":
        fn = torch.compile(model)
    elif path == "sextant":
        import sextant.frontend.dynamo as dyn  # (importing sextant registers the backend)

        dyn.STATS.reset()
        fn = torch.compile(model, backend="sextant")
    else:
        fn = model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = opt.step
    if path != "eager":  # the optimizer step compiled by the same backend as the model
        step = torch.compile(opt.step, backend="sextant") if path == "sextant" else torch.compile(opt.step)
    g = torch.Generator().manual_seed(SEED + 1)
    times, loss = [], 0.0
    t_start = time.perf_counter()
    warm = 0.0
    for i in range(warmup + steps):
        x, y = batch(g)
        t0 = time.perf_counter()
        out = fn(x, y)
        out.backward()
        step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        loss = out.item()
        if i < warmup:
            warm = time.perf_counter() - t_start
            if path == "inductor" and i == warmup - 1:
                from torch._inductor.async_compile import shutdown_compile_workers

                shutdown_compile_workers()
        else:
            times.append(dt)
    result: dict[str, object] = {"model": name, "path": path, "ms": statistics.median(times) * 1e3,
                                 "warmup_s": warm, "loss": loss, "peak_mib": _peak_rss_mib()}
    if path == "sextant":
        result["graphs"] = [(r.role, r.target, list(r.externs)) for r in dyn.STATS.graphs]
    return result


def _child(name: str, path: str, ns: argparse.Namespace) -> dict[str, object]:
    cmd = [sys.executable, "-m", "sextant.tools.train_bench", "--child", f"{name}:{path}",
           "--steps", str(ns.steps), "--warmup", str(ns.warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"model": name, "path": path, "error": tail}
    return json.loads(lines[-1])


def to_markdown(rows: list[dict[str, object]]) -> str:
    out = ["| model | path | ms/step | × eager | × Inductor | warm-up s | peak RSS MiB | last loss | graphs |",
           "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["model"], r["path"]): r for r in rows}
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['path']} | – | – | – | – | – | – | failed: {r['error']} |")
            continue
        eager, ind = by.get((r["model"], "eager")), by.get((r["model"], "inductor"))

        def ratio(base: dict | None, row: dict[str, object] = r) -> str:
            return f"{row['ms'] / base['ms']:.2f}" if base and "ms" in base else "–"

        same = ""
        if eager and "loss" in eager and r["path"] != "eager":
            same = "same as eager" if abs(r["loss"] - eager["loss"]) <= 1e-3 * max(1.0, abs(eager["loss"])) \
                else f"eager {eager['loss']:.5f}"
        graphs = ""
        if "graphs" in r:
            compiled = sum(t is not None for _, t, _ in r["graphs"])
            externs = sorted({e for _, _, ex in r["graphs"] for e in ex})
            graphs = f"{compiled}/{len(r['graphs'])} compiled" + (f"; extern: {', '.join(externs)}" if externs else "")
        out.append(f"| {r['model']} | {r['path']} | {r['ms']:.1f} | {ratio(eager)} | {ratio(ind)} | "
                   f"{r['warmup_s']:.1f} | {r['peak_mib']:.0f} | {r['loss']:.5f} {same} | {graphs} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sextant.tools.train_bench", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,resnet,vit")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--markdown", help="rewrite the train-bench block of this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        name, path = ns.child.split(":")
        print(json.dumps(run_path(name, path, ns.steps, ns.warmup)))
        return 0
    from sextant.tools.bench import _machine

    rows = []
    for name in ns.models.split(","):
        for path in ns.paths.split(","):
            print(f"train bench: {name}, {path} ...", file=sys.stderr, flush=True)
            rows.append(_child(name, path, ns))
    lines = [f"Machine: {_machine()}.", ""]
    lines += [f"- {name}: {build(name)[2]}" for name in ns.models.split(",")]
    lines += ["", f"SGD with momentum, fp32; ms/step: median of {ns.steps} steps after {ns.warmup} warm-up steps "
              "(forward, backward and optimizer step; the compiled paths compile the optimizer step with the "
              "same backend).", "", to_markdown(rows)]
    text = "\n".join(lines)
    from sextant.tools.bench import publish

    publish(text, ns.markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
