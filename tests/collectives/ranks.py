"""Run a scenario script on several ranks (one process each, gloo over a file store) and collect what
each rank reports: the harness behind the multi-process tests.

Each rank is a fresh ``python <script> --rank r --world n --store f --out d`` (no fork from a pytest
worker that has run torch); ranks get one thread each and a deadline, so a hang fails the test
(every rank is killed) instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(script: Path, tmp: Path, world: int = 2, timeout_s: float = 600, args: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``script`` on ``world`` ranks; returns each rank's report (the JSON it wrote to ``out``).
    Raises AssertionError with every rank's output when a rank fails, times out, or reports nothing."""
    store = tmp / "store"
    store.unlink(missing_ok=True)
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "SEXTANT_CPU_THREADS": "1", "PYTHONPATH": str(ROOT),
               **(env or {})}
    procs = []
    for r in range(world):
        log = open(tmp / f"rank{r}.log", "w+")  # noqa: SIM115  (closed below)
        cmd = [sys.executable, str(script), "--rank", str(r), "--world", str(world), "--store", str(store),
               "--out", str(tmp / f"rank{r}.json"), *args]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT), log))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for p, _ in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p, _ in procs:
            p.kill()
            p.wait()
    outputs = []
    for r, (p, log) in enumerate(procs):
        log.seek(0)
        outputs.append(f"--- rank {r} (exit {p.returncode}) ---\n{log.read()[-6000:]}")
        log.close()
    if timed_out or any(p.returncode != 0 for p, _ in procs):
        why = f"timed out after {timeout_s:.0f} s (a hang)" if timed_out else "a rank failed"
        raise AssertionError(f"{script.name}: {why}\n" + "\n".join(outputs))
    reports = []
    for r in range(world):
        path = tmp / f"rank{r}.json"
        if not path.exists():
            raise AssertionError(f"rank {r} wrote no report\n" + "\n".join(outputs))
        reports.append(json.loads(path.read_text()))
    return reports
