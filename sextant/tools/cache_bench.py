"""Second-process compile times with the compile cache: ``python -m sextant.tools.cache_bench``.

Each model is compiled in a fresh process against an empty cache directory (cold: capture,
passes, schedule, LLVM/ptxas all run, then the entry is stored), then again in another fresh
process against the now-filled cache (the entry is loaded). Both timings are of the
``sextant.compile`` call only (interpreter start and model construction excluded). Prints a
markdown table; ``--markdown docs/benchmarks.md`` rewrites its block there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BEGIN, END = "<!-- cache-bench:begin -->", "<!-- cache-bench:end -->"
MODELS = {  # name → the expression building (module, args) in the child
    "gpt2 12-layer": "EXAMPLES['gpt2'](n_layer=12)[:2]",
    "transformer-block": "EXAMPLES['transformer-block']()[:2]",
    "cnn": "EXAMPLES['cnn']()[:2]",
}
CHILD = """
import json, sys, time, torch, sextant
from sextant.examples import EXAMPLES
module, args = {expr}
t = time.perf_counter()
c = sextant.compile(module, args, target={target!r})
seconds = time.perf_counter() - t
torch.testing.assert_close(c(*args), module(*args), rtol=1e-4, atol=1e-4)
print(json.dumps({{"seconds": seconds, "hit": c.stages["cache"]["hit"]}}))
"""


def _run(expr: str, target: str, cache: str) -> dict:
    env = {**os.environ, "SEXTANT_CACHE_DIR": cache, "SEXTANT_COMPILE_CACHE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD.format(expr=expr, target=target)], capture_output=True,
                          text=True, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(targets: list[str]) -> str:
    from sextant.tools.bench import _machine

    rows = [f"Machine: {_machine()}.", "",
            "| model | target | cold compile (s) | second process, cached (s) | speed-up |",
            "| --- | --- | ---: | ---: | ---: |"]
    for name, expr in MODELS.items():
        for target in targets:
            with tempfile.TemporaryDirectory() as cache:
                cold, warm = _run(expr, target, cache), _run(expr, target, cache)
            assert not cold["hit"] and warm["hit"], (cold, warm)
            rows.append(f"| {name} | {target} | {cold['seconds']:.2f} | {warm['seconds']:.2f} | "
                        f"{cold['seconds'] / warm['seconds']:.0f}× |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sextant.tools.cache_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="cpu,cuda-sim")
    ap.add_argument("--markdown", type=Path, help="rewrite the cache-bench block of this file")
    ns = ap.parse_args(argv)
    text = table([t for t in ns.targets.split(",") if t])
    from sextant.tools.bench import publish

    publish(text, ns.markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
