"""The training benchmark's table and its docs block (the timings themselves are make bench's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sextant.tools import train_bench as tb


def _rows() -> list[dict[str, object]]:
    base = {"model": "resnet", "warmup_s": 1.0, "peak_mib": 500.0}
    return [
        {**base, "path": "eager", "ms": 100.0, "loss": 2.0},
        {**base, "path": "inductor", "ms": 50.0, "loss": 2.0},
        {**base, "path": "sextant", "ms": 80.0, "loss": 2.5,
         "graphs": [("forward", "cpu", []), ("backward", "cpu", ["aten.foo"]), ("inference", None, [])]},
        {"model": "vit", "path": "sextant", "error": "RuntimeError: boom"},
    ]


def test_table_gives_ratios_loss_check_and_graphs() -> None:
    md = tb.to_markdown(_rows())
    sextant_row = next(line for line in md.splitlines() if "| resnet | sextant |" in line)
    cells = [c.strip() for c in sextant_row.split("|")[1:-1]]
    assert cells[2:5] == ["80.0", "0.80", "1.60"]
    assert "eager 2.00000" in cells[7]  # a loss that differs from eager's is shown, not hidden
    assert cells[8] == "2/3 compiled; extern: aten.foo"
    assert "same as eager" in next(line for line in md.splitlines() if "| resnet | inductor |" in line)
    assert "failed: RuntimeError: boom" in md


def test_markdown_block_is_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "bench.md"
    doc.write_text(f"intro\n{tb.BEGIN}\nold table\n{tb.END}\nkept\n")
    rows = iter(_rows()[:3])
    monkeypatch.setattr(tb, "_child", lambda name, path, ns: next(rows))
    assert tb.main(["--models", "resnet", "--markdown", str(doc)]) == 0
    text = doc.read_text()
    assert "old table" not in text and text.startswith("intro\n") and text.endswith(f"{tb.END}\nkept\n")
    assert "Machine: " in text and "| resnet | sextant | 80.0 |" in text


@pytest.mark.slow
def test_a_step_trains_like_eager() -> None:
    """One tiny in-process run of each path's step loop: the loss is finite and the same on both."""
    eager = tb.run_path("resnet", "eager", steps=1, warmup=1)
    compiled = tb.run_path("resnet", "sextant", steps=1, warmup=1)
    assert abs(compiled["loss"] - eager["loss"]) <= 1e-3 * max(1.0, abs(eager["loss"]))
    roles = [role for role, _, _ in compiled["graphs"]]  # the model's two, then the optimizer step's
    assert roles[:2] == ["forward", "backward"] and set(roles[2:]) == {"inference"}, roles
    assert all(target == "cpu" for _, target, _ in compiled["graphs"])
