"""The GPU benchmark harness that ``scripts/gpu-check`` runs works up to the GPU calls: its
``--dry-run`` builds each case at a tiny size, compiles it through cuda-sim (the same kernels
and PTX as on a GPU) and writes the table — so a GPU session is not spent on a harness bug."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sextant.tools import gpu_bench


def test_dry_run_writes_a_row_per_case(tmp_path: Path) -> None:
    out = tmp_path / "gpu_bench.md"
    code = gpu_bench.main(["--dry-run", "--no-inductor", "--cases", "softmax,matmul", "--out", str(out)])
    assert code == 0
    lines = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {r[0]: dict(zip(head, r)) for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}
    assert set(rows) == {"softmax-8192-fp32", "softmax-8192-fp16", "matmul-4096-fp32", "matmul-4096-fp16",
                         "matmul-4096-bf16", "matmul-decode-16x4096x4096-fp16"}
    decode = rows["matmul-decode-16x4096x4096-fp16"]  # the sliced product on tensor cores + the sum
    assert decode["kernels (unique)"].startswith("2 (2), 1 tensor-core") and "split-K: 8 slices" in decode["notes"]
    for name, row in rows.items():  # every case ran and was checked against eager
        assert float(row["max abs err"]) < (5e-2 if "bf16" in name else 1e-2)
        assert float(row["sextant cuda ms"]) > 0
    for half in ("matmul-4096-fp16", "matmul-4096-bf16"):  # on tensor cores, without spills
        assert "1 tensor-core" in rows[half]["kernels (unique)"]
        assert "0 B spills" in rows[half]["notes"]
    assert "tensor-core" not in rows["matmul-4096-fp32"]["kernels (unique)"]


@pytest.mark.slow  # ~50 s of cuda-sim; CI runs it under make test-slow
def test_dry_run_attention_cases_run_the_flash_kernel(tmp_path: Path) -> None:
    out = tmp_path / "gpu_bench.md"
    assert gpu_bench.main(["--dry-run", "--no-inductor", "--cases", "attention", "--out", str(out)]) == 0
    lines = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {r[0]: dict(zip(head, r)) for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}
    assert set(rows) == {"attention-b8-h12-s512-causal-fp16", "attention-b8-h12-s2048-causal-fp16"}
    for row in rows.values():  # one fused kernel on tensor cores, without spills, within f16 tolerance
        assert row["kernels (unique)"].startswith("1 (1), 1 tensor-core"), row
        assert "0 B spills" in row["notes"]
        assert float(row["max abs err"]) < 4e-3


@pytest.mark.slow  # ~15 s a case; make test-slow
@pytest.mark.parametrize("arch,conv", [(None, "3 tensor-core"), ("sm_90a", "3 tensor-core (3 wgmma+TMA)")])
def test_dry_run_bottleneck_runs_its_convolutions_on_tensor_cores(tmp_path: Path, arch: str | None,
                                                                 conv: str) -> None:
    """The ResNet bottleneck: three kernels (BatchNorm, ReLU and the residual fused), each an
    implicit GEMM on tensor cores — on wgmma for sm_90a (``scripts/gpu-check`` times both)."""
    out = tmp_path / "gpu_bench.md"
    argv = ["--dry-run", "--no-inductor", "--cases", "bottleneck", "--out", str(out)]
    assert gpu_bench.main(argv + (["--arch", arch] if arch else [])) == 0
    lines = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    (row,) = [dict(zip(head, [c.strip() for c in line.strip("|").split("|")])) for line in lines[1:]]
    assert row["case"] == "resnet-bottleneck-b32-fp16" and row["kernels (unique)"] == f"3 (3), {conv}"
    assert "0 B spills" in row["notes"] and float(row["max abs err"]) < 1e-2


def test_profile_table_sums_kinds_and_names_the_slowest_launch() -> None:
    from sextant.tools.gpu_bench import Row, profile_table

    row = Row("gpt2-x", sextant_ms=10.0, profile={"kinds": {"matmul": 6.0, "attention": 2.0, "gather": 0.5},
                                                    "kernels_ms": 8.5, "overhead_ms": 1.5,
                                                    "worst": (1.25, "matmul matmul 4096×50257")})
    text = profile_table([row, Row("softmax", sextant_ms=1.0)])
    assert text.splitlines()[2] == ("| gpt2-x | 10.000 | 6.000 (60%) | 2.000 (20%) | – | – | 0.500 (5%) | "
                                    "1.500 (15%) | 1.250 ms matmul matmul 4096×50257 |")
    assert len(text.splitlines()) == 3 and profile_table([Row("softmax")]) == ""


def _table_rows(text: str, head_starts: str) -> dict[str, list[dict[str, str]]]:
    """The markdown table of ``text`` whose header starts with ``head_starts``, rows by first column."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head_starts))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    rows: dict[str, list[dict[str, str]]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.setdefault(cells[0], []).append(dict(zip(head, cells)))
    return rows


DECODE_CASE = "llm-decode-100m-b1-p128-n128-fp16"


@pytest.fixture(scope="module")
def decode_dry_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The LLM decode case's dry run (tiny decoder, fp16, through cuda-sim: a prefill and 4 steps)."""
    out = tmp_path_factory.mktemp("decode") / "gpu_bench.md"
    assert gpu_bench.main(["--dry-run", "--cases", DECODE_CASE, "--out", str(out)]) == 0
    return out.read_text()


@pytest.mark.slow  # ~35 s (its fixture); make test-slow
def test_dry_run_decode_case_generates_eager_tokens(decode_dry_run: str) -> None:
    """Prefill and decode programs compiled from one Decoder (KV caches updated in place, never
    copied back), a greedy generation timed per step, its tokens checked against eager's; the
    per-path table has the prefill and decode times; torch.compile is left out of the dry run."""
    row = _table_rows(decode_dry_run, "| case | eager ms")[DECODE_CASE][0]
    assert float(row["eager ms"]) > 0 and float(row["sextant cuda ms"]) > 0
    assert float(row["sextant compile s"]) > 0 and row["kernels (unique)"].split(" ")[0].isdigit()
    assert "tensor-core" in row["kernels (unique)"] and "0 B spills" in row["notes"]
    assert "sextant: 5/5 tokens equal to eager's" in row["notes"]  # a prefill's token + 4 decode steps'
    assert "MISMATCH" not in row["notes"] and "copied back" not in row["notes"]
    assert "torch.compile not run in --dry-run" in row["notes"] and row["torch.compile ms"] == "–"
    paths = {r["path"]: r for r in _table_rows(decode_dry_run, "| case | path")[DECODE_CASE]}
    assert set(paths) == {"eager", "sextant"}
    assert paths["eager"]["tokens equal to eager's"] == "reference"
    assert paths["sextant"]["tokens equal to eager's"] == "5/5"
    for p in paths.values():
        assert p["batch × prompt + steps"] == "1 × 8 + 4"
        assert float(p["prefill ms"]) > 0 and float(p["decode ms/token"]) > 0 and float(p["tokens/s"]) > 0


def test_dry_run_decode_logits_match_eager(decode_dry_run: str) -> None:
    """The logits of every step within the fp16 tolerance of eager's (a greedy token can then only
    differ at a near-tie)."""
    row = _table_rows(decode_dry_run, "| case | eager ms")[DECODE_CASE][0]
    assert float(row["max abs err"]) <= gpu_bench.LOGIT_TOL[torch.float16]
    assert "logits off" not in row["notes"]


@pytest.mark.slow  # ~30 s: a GPT-2 training step's forward, backward and optimizer graphs through cuda-sim
def test_dry_run_training_case_trains_like_eager(tmp_path: Path) -> None:
    """The training case: forward, backward and the optimizer step compiled for the GPU (run by
    cuda-sim), the first step's loss and updated weights equal to eager's."""
    out = tmp_path / "gpu_bench.md"
    assert gpu_bench.main(["--dry-run", "--cases", "train", "--out", str(out)]) == 0
    (row,) = _table_rows(out.read_text(), "| case | eager ms")["gpt2-4l-b8-s256-train-fp32"]
    assert float(row["max abs err"]) < 1e-4, row
    assert "backward" in row["kernels (unique)"] and "forward" in row["kernels (unique)"], row
    assert "failed" not in row["notes"] and "extern" not in row["notes"], row
    assert float(row["sextant cuda ms"]) > 0
