"""Time every tensor-core GEMM tile candidate on a real GPU, beside the cost model's ranking.

The tile choice (``schedule/gemm_cost.py``) ranks :data:`gpu_mma.CANDIDATES` with an analytic
model built from datasheet peaks; this tool measures what it only estimates: for each problem it
compiles the product once per candidate tile (the choice forced), times it with CUDA events
against eager (cuBLAS) in the same run, and prints the model's rank next to the measured one —
the data an autotuner or a recalibrated model needs. ``--dry-run`` compiles the same kernels at
tiny sizes for ``cuda-sim`` and runs them on the CPU (no timings): everything up to the GPU calls
is checked before a GPU is spent on it.

    python -m sextant.tools.tile_study [--dry-run] [--shapes 4096x4096x4096,...] [--out FILE]

The table goes to stdout, to ``--out`` and to ``$OUT/tile_study.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

import sextant
import sextant.schedule.gpu_mma as gpu_mma
from sextant.schedule.target import gpu_target
from sextant.tools.gpu_bench import MatMul, _time_ms

# m x k x n: square products, GPT-2-small's four Linear layers at batch 8 x 512 tokens, a decode step
DEFAULT_SHAPES = ("4096x4096x4096", "2048x2048x2048", "1024x1024x1024", "4096x768x2304", "4096x768x768",
                  "4096x768x3072", "4096x3072x768", "16x4096x4096")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# tiles measured beside the candidates (``--variants``): deeper pipelines and larger tiles, which
# dynamic shared memory (past 48 KiB) allows; registers: ptxas's budget (.maxnreg), 0 spills at sm_90
VARIANTS = (gpu_mma.TcTile(128, 128, 32, 2, 4, registers=128, stages=3),
            gpu_mma.TcTile(128, 128, 32, 2, 4, registers=128, stages=4),
            gpu_mma.TcTile(128, 128, 64, 2, 4, registers=128, stages=2),
            gpu_mma.TcTile(128, 128, 64, 2, 4, registers=128, stages=3),
            gpu_mma.TcTile(256, 128, 32, 4, 2, registers=232, stages=3),
            gpu_mma.TcTile(128, 256, 32, 2, 4, registers=232, stages=4),
            gpu_mma.TcTile(128, 64, 32, 2, 2, registers=144, stages=4))


@contextmanager
def forced_tile(tile: gpu_mma.TcTile):
    """Every half-precision GEMM compiled inside takes ``tile`` (the cost model is bypassed, and
    the tuning store too: a measured choice would otherwise win over the forced one)."""
    saved, store = gpu_mma.choose_tile, os.environ.get("SEXTANT_TUNING")
    gpu_mma.choose_tile = lambda m, n, batch, target, *a, **k: tile
    os.environ["SEXTANT_TUNING"] = "0"
    try:
        yield
    finally:
        gpu_mma.choose_tile = saved
        if store is None:
            os.environ.pop("SEXTANT_TUNING", None)
        else:
            os.environ["SEXTANT_TUNING"] = store


def _parse(shape: str) -> tuple[int, int, int]:
    m, k, n = (int(x) for x in shape.lower().split("x"))
    return m, k, n


def study(shapes: list[str], dtypes: list[str], dry_run: bool, arch: str,
          tiles: tuple[gpu_mma.TcTile, ...] = gpu_mma.CANDIDATES) -> list[str]:
    target = gpu_target(arch)
    lines = ["| problem m×k×n | dtype | tile bm×bn×bk (stages) | model rank | measured rank | ms | TFLOP/s | × cuBLAS "
             "| registers | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        m, k, n = _parse(shape)
        if dry_run:
            m, k, n = min(m, 80), min(k, 96), min(n, 72)
        for tag in dtypes:
            dt = DTYPES[tag]
            torch.manual_seed(0)
            a, b = torch.randn(m, k).to(dt), torch.randn(k, n).div(k**0.5).to(dt)
            ranked = gpu_mma.rank_tiles(m, n, 1, target, tiles)
            model_rank = {id(t): i + 1 for i, (_, t) in enumerate(ranked)}
            eager_ms = None
            if not dry_run:
                ga, gb = a.cuda(), b.cuda()
                eager_ms = _time_ms(lambda ga=ga, gb=gb: ga @ gb, cuda=True)
                expected = (ga.float() @ gb.float())
            rows = []
            for tile in tiles:
                note = ""
                try:
                    with forced_tile(tile):
                        cm = sextant.compile(MatMul(), (a, b), target="cuda-sim" if dry_run else "cuda", arch=arch,
                                             cache=False)
                except Exception as exc:  # one failing tile must not cost the rest of the (GPU) run
                    rows.append([tile, None, None, f"failed: {type(exc).__name__}: {str(exc)[:160]}"])
                    continue
                res = cm.stages.get("ptxas")
                regs = max((r.registers for name, r in getattr(res, "kernels", {}).items() if "matmul" in name),
                           default=None)
                splits = [r for r in cm.stages["program"].rewrites if r.startswith("split-K")]
                if splits:
                    note = splits[0].split(" runs as ")[-1].split(",")[0]
                if dry_run:
                    got = cm(a, b).float()
                    err = float((got - a.float() @ b.float()).abs().max())
                    rows.append([tile, None, regs, f"{note} max err {err:.1e}".strip()])
                    continue
                got = cm(ga, gb).float()
                err = float((got - expected).norm() / expected.norm())
                ms = _time_ms(lambda cm=cm, ga=ga, gb=gb: cm(ga, gb), cuda=True, max_runs=50)
                rows.append([tile, ms, regs, f"{note} rel err {err:.1e}".strip()])
            measured = sorted((i for i in range(len(rows)) if rows[i][1] is not None), key=lambda i: rows[i][1])
            measured_rank = {id(rows[i][0]): r + 1 for r, i in enumerate(measured)}
            for tile, ms, regs, note in rows:
                tflops = f"{2 * m * n * k / ms / 1e9:.0f}" if ms else "-"
                vs = f"{ms / eager_ms:.2f}" if ms and eager_ms else "-"
                name = f"{tile.bm}×{tile.bn}×{tile.bk} ({tile.stages})" + ("" if tile in gpu_mma.CANDIDATES else " *")
                lines.append(f"| {m}×{k}×{n} | {tag} | {name} | {model_rank[id(tile)]} | "
                             f"{measured_rank.get(id(tile), '-')} | {f'{ms:.3f}' if ms else '-'} | {tflops} | "
                             f"{vs} | {regs if regs is not None else '-'} | {note} |")
            if eager_ms:
                lines.append(f"| {m}×{k}×{n} | {tag} | cuBLAS (eager) | | | {eager_ms:.3f} | "
                             f"{2 * m * n * k / eager_ms / 1e9:.0f} | 1.00 | | |")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated MxKxN")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--arch", default=None, help="default: the GPU's (sm_90 with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on cuda-sim: no GPU, no timings")
    ap.add_argument("--variants", action="store_true", help="also time VARIANTS (marked * in the table)")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args(argv)
    if not opts.dry_run and not torch.cuda.is_available():
        print("tile_study: no CUDA GPU (use --dry-run)", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability() if not opts.dry_run else (9, 0)
    arch = opts.arch or f"sm_{major}{minor}"
    lines = study([s for s in opts.shapes.split(",") if s], [d for d in opts.dtypes.split(",") if d],
                  opts.dry_run, arch, gpu_mma.CANDIDATES + (VARIANTS if opts.variants else ()))
    where = "cuda-sim (tiny sizes, no timings)" if opts.dry_run else torch.cuda.get_device_name()
    text = (f"Tensor-core GEMM tiles on {where} ({arch}), torch {torch.__version__}: each candidate forced, "
            "medians of CUDA-event timings; model rank from `gemm_cost`.\n\n" + "\n".join(lines) + "\n")
    print(text)
    for path in [opts.out, Path(os.environ["OUT"]) / "tile_study.md" if os.environ.get("OUT") else None]:
        if path is not None:
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
