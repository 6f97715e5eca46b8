"""One program for every size vs a static compile per size: ``python -m sextant.tools.dynamic_bench``.

For each model, compiled once on the cpu target with symbolic sizes (``dynamic_shapes``), and at
each size also compiled statically: the run time of eager, of the symbolic program and of the
static program at that size (medians, in one run), the compile time of the one symbolic program
and of each static compile (object cache off, so LLVM runs every time). What a symbolic program
costs at run time — divisions by sizes the compiler cannot fold, tails always guarded, tiles chosen
for the longest size — is the ratio between the last two run-time columns. Prints a markdown
table; ``--markdown docs/benchmarks.md`` rewrites its block there.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from torch.export import Dim

BEGIN, END = "<!-- dynamic-bench:begin -->", "<!-- dynamic-bench:end -->"
Shape = tuple[int, ...]


def _models() -> dict[str, tuple[Callable[[], tuple[torch.nn.Module, tuple]], dict, list[Shape], Callable]]:
    from sextant.examples import gpt2
    from sextant.zoo import ZOO

    def ids(shape: Shape) -> torch.Tensor:
        return torch.randint(0, 1000, shape)

    def images(shape: Shape) -> torch.Tensor:
        return torch.randn(shape)

    tokens = {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=256)}
    return {
        "gpt2 2-layer (128 wide)": (lambda: gpt2(n_layer=2, batch=2, seq=256), tokens,
                                    [(1, 1), (1, 7), (1, 128), (4, 100)], ids),
        "llama (zoo)": (ZOO["llama"], tokens, [(1, 1), (1, 7), (1, 128), (4, 100)], ids),
        "resnet50 (zoo)": (ZOO["resnet50"], {0: Dim("batch", min=1, max=8)}, [(1, 3, 64, 64), (3, 3, 64, 64),
                                                                               (8, 3, 64, 64)], images),
    }


def _median(fn: Callable[[], object], runs: int = 9) -> float:
    for _ in range(3):  # the first calls of a process start the worker threads
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench(name: str) -> list[str]:
    import sextant

    build, dims, shapes, make = _models()[name]
    model, args = build()
    model = model.eval()
    example = args[0]
    if example.shape[0] == 1:  # torch.export specialises a size of 1
        example = torch.cat([example] * 2)
    t0 = time.perf_counter()
    symbolic = sextant.compile(model, (example,), target="cpu", dynamic_shapes={"args": (dims,)}
                               if _varargs(model) else {_first_param(model): dims})
    once = time.perf_counter() - t0
    how = "one program" if symbolic.stages.get("per_binding") is None else "per binding"
    rows = []
    with torch.no_grad():
        for shape in shapes:
            x = make(shape)
            t0 = time.perf_counter()
            static = sextant.compile(model, (x,), target="cpu")
            static_s = time.perf_counter() - t0
            torch.testing.assert_close(symbolic(x), model(x), rtol=1e-3, atol=1e-3)
            eager = _median(lambda x=x: model(x))
            sym = _median(lambda x=x: symbolic(x))
            sta = _median(lambda x=x, static=static: static(x))
            first = f"{how}, {once:.1f} s" if not rows else ""
            rows.append(f"| {name if not rows else ''} | {'×'.join(map(str, shape))} | {eager * 1e3:.2f} | "
                        f"{sym * 1e3:.2f} ({sym / eager:.2f}×) | {sta * 1e3:.2f} ({sta / eager:.2f}×) | "
                        f"{sym / sta:.2f} | {static_s:.1f} s | {first} |")
    return rows


def _varargs(model: torch.nn.Module) -> bool:
    import inspect

    return any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(model.forward).parameters.values())


def _first_param(model: torch.nn.Module) -> str:
    import inspect

    return next(iter(inspect.signature(model.forward).parameters))


def table(names: list[str]) -> str:
    from sextant.tools.bench import _machine

    lines = [f"Machine: {_machine()}; cpu target, object cache off (`SEXTANT_CACHE=0`), medians of 9 calls.", "",
             "| model | size | eager ms | symbolic program ms (vs eager) | static compile ms (vs eager) | "
             "symbolic / static | static compile time | symbolic compile |",
             "|---|---|---|---|---|---|---|---|"]
    for name in names:
        lines += bench(name)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sextant.tools.dynamic_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(_models()))
    ap.add_argument("--markdown", help="rewrite the dynamic-bench block of this file")
    args = ap.parse_args(argv)
    os.environ["SEXTANT_CACHE"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    text = table(args.models.split(","))
    from sextant.tools.bench import publish

    publish(text, args.markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
