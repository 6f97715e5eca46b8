"""A process forked after sextant ran parallel launches (a test worker, a multiprocessing pool, the
ONNX conformance runner's workers) still runs compiled models: the child inherits the thread
pools' objects but not their threads, and must not wait on them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import sextant


def _wait(pid: int, timeout_s: float) -> int | None:
    """The child's exit status, or None (and the child killed) when it is still running after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_forked_child_runs_parallel_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEXTANT_CPU_THREADS", "2")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    x = torch.randn(256, 512)
    with torch.no_grad():
        want = model(x)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    torch.testing.assert_close(cm(x), want, rtol=1e-4, atol=1e-4)  # the parent's pools have threads now
    out = tmp_path / "child.npy"
    pid = os.fork()
    if pid == 0:  # the child: run the model again, save what it computed
        code = 1
        try:
            np.save(out, cm(x).numpy())
            code = 0
        finally:
            os._exit(code)
    status = _wait(pid, 120.0)
    assert status is not None, "the forked child hung: it waited on a thread pool whose threads it does not have"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    torch.testing.assert_close(torch.from_numpy(np.load(out)), want, rtol=1e-4, atol=1e-4)
