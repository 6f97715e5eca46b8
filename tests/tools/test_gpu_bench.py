"""The GPU benchmark harness that ``scripts/gpu-check`` runs works up to the GPU calls: its
``--dry-run`` builds each case at a tiny size, compiles it through cuda-sim (the same kernels
and PTX as on a GPU) and writes the table — so a GPU session is not spent on a harness bug."""

from __future__ import annotations

from pathlib import Path

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


def test_profile_table_sums_kinds_and_names_the_slowest_launch() -> None:
    from sextant.tools.gpu_bench import Row, profile_table

    row = Row("gpt2-x", sextant_ms=10.0, profile={"kinds": {"matmul": 6.0, "attention": 2.0, "gather": 0.5},
                                                    "kernels_ms": 8.5, "overhead_ms": 1.5,
                                                    "worst": (1.25, "matmul matmul 4096×50257")})
    text = profile_table([row, Row("softmax", sextant_ms=1.0)])
    assert text.splitlines()[2] == ("| gpt2-x | 10.000 | 6.000 (60%) | 2.000 (20%) | – | – | 0.500 (5%) | "
                                    "1.500 (15%) | 1.250 ms matmul matmul 4096×50257 |")
    assert len(text.splitlines()) == 3 and profile_table([Row("softmax")]) == ""
