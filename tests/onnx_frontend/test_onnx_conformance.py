"""The ONNX node-test conformance tool: its machinery (fast) and its figure (slow, a floor)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from sextant.tools import onnx_conformance as oc

FLOOR_PERCENT = 80.0  # of the float node tests, reference and cpu targets both passing


def _cases(*names: str) -> list[Path]:
    return [oc.node_test_dir() / n for n in names]


def test_passing_failing_and_unsupported_cases_are_told_apart() -> None:
    results = oc.run_all(_cases("test_add", "test_relu", "test_ai_onnx_ml_binarizer"), ["reference", "cpu"], jobs=2)
    by = {r.name: r for r in results}
    assert by["test_add"].status == oc.PASS and by["test_add"].targets == {"reference": "pass", "cpu": "pass"}
    assert by["test_relu"].status == oc.PASS
    assert by["test_ai_onnx_ml_binarizer"].status == oc.UNSUPPORTED
    assert "ai.onnx.ml" in by["test_ai_onnx_ml_binarizer"].detail
    assert oc.summary_line(results) == "onnx: 2/3 node tests (66.7%)"


def test_wrong_result_is_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from sextant.frontend.onnx.registry import ONNX_OPS

    monkeypatch.setitem(ONNX_OPS, "Add", ONNX_OPS["Sub"])  # a deliberately wrong translation
    (r,) = oc.run_all(_cases("test_add"), ["reference"], jobs=1)
    assert r.status == oc.MISMATCH and "elements differ" in r.detail


def test_a_crashing_case_costs_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    real = oc.run_case

    def crash(folder: Path, targets):
        if folder.name == "test_abs":
            os.kill(os.getpid(), signal.SIGKILL)  # as an LLVM abort or a segfault would end it
        return real(folder, targets)

    monkeypatch.setattr(oc, "run_case", crash)
    results = {r.name: r for r in oc.run_all(_cases("test_abs", "test_neg"), ["reference"], jobs=2)}
    assert results["test_abs"].status == oc.CRASH and "SIGKILL" in results["test_abs"].detail
    assert results["test_neg"].status == oc.PASS


def test_markdown_block_is_replaced_in_place(tmp_path: Path) -> None:
    doc = tmp_path / "onnx.md"
    doc.write_text(f"# ONNX\n\nprose before\n\n{oc.BEGIN}\nold\n{oc.END}\n\nprose after\n")
    results = oc.run_all(_cases("test_abs"), ["reference"], jobs=1)
    oc.write_markdown(doc, oc.markdown(results, ["reference"], "one test", 1.0))
    text = doc.read_text()
    assert "prose before" in text and "prose after" in text and "old" not in text
    assert "onnx: 1/1 node tests (100.0%)" in text and "| Abs | 1 | 1 |" in text


@pytest.mark.slow
def test_float_node_tests_floor(capsys: pytest.CaptureFixture[str]) -> None:
    """Every float node test through the reference executor and the cpu target (a few minutes)."""
    assert oc.main(["-j", str(len(os.sched_getaffinity(0)))]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"onnx: (\d+)/(\d+) node tests \(([\d.]+)%\)", last)
    assert m, last
    assert int(m[2]) >= 1200  # the float node tests of onnx 1.22
    assert float(m[3]) >= FLOOR_PERCENT, last


def test_workers_survive_a_parent_that_used_openmp() -> None:
    """libgomp's pool does not survive fork: a parallel torch op in a worker hung until the fix."""
    import torch

    x = torch.randn(1024, 1024)
    (x @ x).sum()  # the parent (like a pytest worker that ran other tests) starts the OpenMP pool
    (r,) = oc.run_all(_cases("test_conv_with_autopad_same"), ["reference", "cpu"], jobs=1, timeout=60)
    assert r.status == oc.PASS, r


def test_garbage_is_finalised_in_the_parent_not_in_a_forked_worker(tmp_path: Path) -> None:
    """A finaliser inherited by a worker must not run there (onnxruntime's hung the child waiting
    for threads it does not have): garbage is collected before the fork, the rest frozen."""
    import gc

    marker = tmp_path / "finalised"

    class Cycle:
        def __del__(self) -> None:
            with open(marker, "a") as f:
                f.write(f"{os.getpid()}\n")

    gc.disable()  # only _spawn may collect in between
    try:
        c = Cycle()
        c.self = c
        del c
        w = oc._spawn(["reference"])
        assert marker.read_text().split() == [str(os.getpid())]  # collected here, before the fork
        assert oc._retire(w) == 0
    finally:
        gc.enable()
    assert marker.read_text().split() == [str(os.getpid())]
