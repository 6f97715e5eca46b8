"""The `sextant` command: compile/dump, run, explain, MODEL resolution, errors and exit codes.

Most tests call ``main(argv)`` in-process; two run ``python -m sextant`` as a user would.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sextant.cli.build import cuda_unavailable
from sextant.cli.errors import ExitCode
from sextant.cli.main import main
from sextant.codegen.ptxas import find_ptxas
from sextant.codegen.sass import find_disassembler

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
USER = os.path.relpath(HERE / "user_models.py")  # as a user would type it, relative to the cwd


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def index_files(folder: Path) -> list[str]:
    return re.findall(r"\| \[([^\]]+)\]\(", (folder / "index.md").read_text())


def test_compile_cuda_sim_dump_all(tmp_path: Path) -> None:
    code, out, err = cli("compile", "mlp", "--target", "cuda-sim", "--dump", "all", "-o", str(tmp_path))
    assert code == 0, err
    assert "compiled mlp for cuda-sim sm_90: 35 graph nodes, 3 kernels in 3 launches" in out
    for stage in ("capture", "schedule", "codegen: LLVM NVPTX -> PTX", "ptxas"):  # progress on stderr
        assert f"  {stage}" in err
    kernels = ["matmul_0", "matmul_1", "matmul_2"]
    listed = index_files(tmp_path)
    for rel in ["graph.txt", "graph.optimized.txt", "schedule.txt", "llvm/nvptx.ll", "llvm/nvptx.opt.ll",
                "llvm/cpu.ll", "ptx/module.ptx", *(f"kernel/{k}.kir" for k in kernels),
                *(f"ptx/{k}.ptx" for k in kernels)]:
        assert rel in listed and (tmp_path / rel).stat().st_size > 0, rel
    assert sorted(p.name for p in (tmp_path / "kernel").iterdir()) == [f"{k}.kir" for k in kernels]
    # expand_random, two rounds of 4, then in_place_updates
    assert len([f for f in listed if f.startswith("passes/")]) == 10
    assert "graph @MLP(%x: f32[8,64])" in (tmp_path / "graph.txt").read_text()
    assert "kernel matmul_1" in (tmp_path / "kernel/matmul_1.kir").read_text()
    ptx = (tmp_path / "ptx/matmul_1.ptx").read_text()
    assert ".entry matmul_1(" in ptx and ".entry matmul_0(" not in ptx and ".target sm_90" in ptx
    # a per-kernel PTX file is a complete module: ptxas assembles it alone
    subprocess.run([str(find_ptxas()), "-arch=sm_90", str(tmp_path / "ptx/matmul_1.ptx"), "-o",
                    str(tmp_path / "k.cubin")], check=True, capture_output=True)
    if find_disassembler() is None:
        assert "sass skipped: neither nvdisasm nor cuobjdump" in out
    else:
        sass = (tmp_path / "sass/matmul_2.sass").read_text()
        assert ".text.matmul_2" in sass and "EXIT" in sass and "matmul_1" not in sass
        assert all(f"sass/{k}.sass" in listed for k in kernels)


def test_compile_cpu_dump_all(tmp_path: Path) -> None:
    code, out, _ = cli("compile", "mlp", "--target", "cpu", "--dump", "all", "-o", str(tmp_path), "-q")
    assert code == 0
    assert "ptx skipped: target cpu generates no GPU code" in out
    listed = index_files(tmp_path)
    assert {"llvm/cpu.ll", "llvm/cpu.opt.ll", "kernel/matmul_0.kir", "schedule.txt"} <= set(listed)
    assert not any(f.startswith(("ptx/", "sass/", "llvm/nvptx")) for f in listed)
    assert "target: cpu" in (tmp_path / "index.md").read_text()
    assert "define" in (tmp_path / "llvm/cpu.opt.ll").read_text()


def test_run_prints_error_and_timings() -> None:
    code, out, _ = cli("run", "mlp", "--runs", "3", "-q")
    assert code == 0
    m = re.search(r"max \|sextant - eager\| = (\S+) .*: OK", out)
    assert m and float(m.group(1)) < 1e-4
    assert re.search(r"median of 3 calls: sextant cuda-sim [\d.]+ (us|ms|s), eager PyTorch \(CPU\) [\d.]+", out)
    assert "first call" in out


def test_compile_verbose_prints_stage_times_and_what_was_produced(tmp_path: Path) -> None:
    """A slow compile shows where the time went (one line per stage) and why (graph and kernel sizes)."""
    code, _, err = cli("compile", "mlp", "--target", "cpu", "--verbose", "-o", str(tmp_path))
    assert code == 0, err
    for stage in ("capture: torch.export -> graph IR", "graph passes", "schedule: fusion, memory plan",
                  "codegen: LLVM -> x86 JIT"):
        assert re.search(rf"^  {re.escape(stage)} \.\.\. [\d.]+ s$", err, re.M), (stage, err)
    # scheduled: less what fusion folds away, plus the weights' compile-time layouts (host-dependent)
    assert re.search(r"^  graph: 38 nodes captured, \d+ scheduled$", err, re.M), err
    assert re.search(r"^  kernels: 3 generated, 3 unique, \d+ statements \(largest: matmul_\d, \d+\)$", err, re.M), err
    assert re.search(r"^  fusion: \d+ node visits$", err, re.M)
    code, _, quiet = cli("compile", "mlp", "--target", "cpu", "-o", str(tmp_path))
    assert code == 0 and "kernels:" not in quiet  # counts only with --verbose


def test_explain_lists_kernels_registers_and_passes() -> None:
    code, out, _ = cli("explain", "mlp", "-q")
    assert code == 0
    assert "ops captured: 38 graph nodes" in out
    assert re.search(r"cse\s+38 -> 35\s+-3 ", out)  # what the pass changed, as op counts
    for k in ("matmul_0", "matmul_1", "matmul_2"):
        assert re.search(rf"#\d+\s+{k}\s+matmul\s+grid \d+x\d+x\d+\s+block 16x16x1\s+\d+ regs\s+spills 0 B", out), k
    assert out.count("fused: matmul add") == 3
    assert "from:  examples.py:" in out


def test_explain_counters_show_tensor_cores_bank_conflicts_and_coalescing() -> None:
    code, out, err = cli("explain", f"{USER}:half_mlp", "--target", "cuda-sim", "--counters", "-q")
    assert code == 0, err
    assert out.count("[tensor-core]") == 2
    lines = [line for line in out.splitlines() if "cuda-sim: shared" in line]
    assert len(lines) == 2
    for line in lines:  # 128×64 by 64×128, then 128×128 by 128×64: 2·M·N·K / (2·16·8·16) = 512 MMAs each
        assert re.search(r"shared \d+ req, 0 bank conflicts; global loads \d+ req, \d+% coalesced; "
                         r"global stores \d+ req, \d+% coalesced; \d+ MMA", line), line
    assert all("512 MMA (2.1 MFLOP on tensor cores)" in line for line in lines)
    code, out, _ = cli("explain", "mlp", "--target", "cpu", "--counters", "-q")
    assert code == 0 and "memory counters need --target cuda-sim" in out


def test_user_file_factory_with_kwargs() -> None:
    code, out, err = cli("run", f"{USER}:tiny", "--target", "cpu", "--runs", "2")
    assert code == 0, err
    assert ": OK" in out and "sextant cpu" in out


def test_mismatch_exits_3() -> None:
    code, out, err = cli("run", f"{USER}:drifts", "--target", "cpu", "--runs", "1", "-q")
    assert code == ExitCode.MISMATCH == 3
    assert "MISMATCH" in out and "max |sextant - eager| = 1 " in out
    assert "differ from eager PyTorch" in err


def test_unsupported_op_names_op_and_source_line() -> None:
    code, _, err = cli("compile", f"{USER}:sorts", "--strict", "-q")
    assert code == ExitCode.COMPILE == 1
    assert "aten.cummax.default" in err
    assert "user_models.py:18" in err and "torch.cummax(x, dim=-1)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("model", "message"), [
    ("nope", "unknown model 'nope'"),
    (USER, "names a file but no factory function"),
    ("tests/cli/missing.py:f", "model file 'tests/cli/missing.py' does not exist"),
    (f"{USER}:nothing", "has no function 'nothing'"),
    (f"{USER}:NOT_CALLABLE", "is not a function (it is of type int)"),
    (f"{USER}:returns_module_only", "returned a Tiny, not (module, example_args)"),
    (f"{USER}:returns_wrong_types", "returned a str where an nn.Module was expected"),
    (f"{USER}:raises", "raised RuntimeError: weights file missing"),
    ("no_such_package.models:factory", "cannot import module 'no_such_package.models'"),
])
def test_bad_model_is_a_usage_error(model: str, message: str) -> None:
    code, out, err = cli("explain", model, "-q")
    assert code == ExitCode.USAGE == 2
    lines = err.strip().splitlines()
    assert lines[0].startswith("sextant: error: ") and message in lines[0]
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert out == ""


def test_verbose_shows_traceback() -> None:
    _, _, err = cli("compile", f"{USER}:raises", "-q", "--verbose")
    assert "Traceback" in err and "weights file missing" in err


@pytest.mark.parametrize("argv", [["compile", "mlp", "--dump", "bogus"], ["compile", "mlp", "--target", "tpu"],
                                  ["run", "mlp", "--pipeline", "nopass"], ["explain", "mlp", "--gpu", "Z9"],
                                  ["run", "mlp", "--runs", "0"],
                                  ["frobnicate"], []])
def test_usage_errors(argv: list[str]) -> None:
    code, _, err = cli(*argv)
    assert code == 2
    assert err.startswith("sextant: error: ")


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    assert "exit codes:" in text and "3  run: outputs differ from eager" in text


def test_report_flag(tmp_path: Path) -> None:
    path = tmp_path / "r.html"
    code, out, err = cli("compile", f"{USER}:tiny", "-q", "--report", str(path))
    assert code == 0, err
    assert f"wrote report {path}" in out
    html = path.read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "matmul_0" in html
    code, out, err = cli("compile", f"{USER}:tiny", "--target", "cuda-sim", "-q", "--report", str(path))
    assert code == 0, err
    assert "cuda-sim counters" in path.read_text()  # next to ptxas's figures, per kernel
    code, out, err = cli("compile", f"{USER}:tiny", "--target", "cpu", "-q", "--report", str(path))
    assert code == 0, err
    assert "cuda-sim counters" not in path.read_text()  # counted only where the GPU kernels run


@pytest.mark.skipif(cuda_unavailable() is None, reason="checks the behaviour without a GPU")
def test_cuda_without_gpu(tmp_path: Path) -> None:
    code, out, _ = cli("compile", f"{USER}:tiny", "--target", "cuda", "--dump", "ptx", "-o", str(tmp_path), "-q")
    assert code == 0
    assert "no usable GPU here: --target cuda was compiled through cuda-sim" in out
    assert (tmp_path / "ptx/module.ptx").exists()
    code, _, err = cli("run", f"{USER}:tiny", "--target", "cuda", "-q")
    assert code == ExitCode.ENVIRONMENT
    assert "--target cuda cannot run here: target='cuda' needs an NVIDIA GPU" in err
    assert "hint: use --target cuda-sim" in err


def _python_m(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "sextant", *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300, check=False)


def test_python_m_sextant_compile(tmp_path: Path) -> None:
    proc = _python_m("compile", str(HERE / "user_models.py") + ":tiny", "--target", "cpu", "--dump", "graph,kernel",
                     "-o", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "capture: torch.export -> graph IR ..." in proc.stderr
    assert index_files(tmp_path / "out") == ["graph.txt", "graph.optimized.txt", "kernel/matmul_0.kir"]


def test_python_m_sextant_bad_model(tmp_path: Path) -> None:
    proc = _python_m("run", "nope", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == "sextant: error: unknown model 'nope'"
    assert proc.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("example", ["cnn", "transformer-block", "gpt2"])
def test_run_every_example(example: str) -> None:
    code, out, err = cli("run", example, "--runs", "1", "-q")
    assert code == 0, err
    assert ": OK" in out


def test_arch_and_missing_disassembler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sextant.cli.dump.find_disassembler", lambda: None)
    code, out, _ = cli("compile", f"{USER}:tiny", "--arch", "sm_80", "--dump", "ptx,sass", "-o", str(tmp_path), "-q")
    assert code == 0
    assert ".target sm_80" in (tmp_path / "ptx/matmul_0.ptx").read_text()
    assert "note: sass skipped: neither nvdisasm nor cuobjdump was found" in out
    assert not (tmp_path / "sass").exists()


def test_explain_cpu_has_costs_but_no_registers() -> None:
    code, out, _ = cli("explain", f"{USER}:tiny", "--target", "cpu", "-q")
    assert code == 0
    assert re.search(r"#0\s+matmul_0\s+matmul\s+\d+ blocks x \d+ threads(\s+\[[\w-]+\])?\n", out)
    assert "regs" not in out and "registers and spills come from ptxas" in out
    assert "cost:" in out and "FLOP" in out


def test_missing_ptxas_is_an_environment_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from sextant.codegen.ptxas import PtxasError

    def missing() -> Path:
        raise PtxasError("ptxas was not found on PATH; install it")

    monkeypatch.setattr("sextant.codegen.ptxas.find_ptxas", missing)
    code, _, err = cli("compile", "mlp", "-q")
    assert code == ExitCode.ENVIRONMENT == 4
    assert "ptxas was not found" in err and "--target cpu" in err


def test_internal_error_exits_5(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(spec: str, input_shapes: object = None) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("sextant.cli.models.load_model", broken)
    code, _, err = cli("explain", "mlp", "-q")
    assert code == ExitCode.INTERNAL == 5
    assert err.startswith("sextant: error: internal error: RuntimeError: boom") and "report" in err


def test_extern_calls_are_listed_by_explain_and_the_dump(tmp_path) -> None:
    code, out, err = cli("explain", f"{USER}:sorts", "--target", "cpu", "-q")
    assert code == 0, err
    assert "extern" in out and "aten.cummax.default" in out and "user_models.py:18" in out
    code, out, err = cli("compile", f"{USER}:sorts", "--target", "cuda-sim", "--dump", "schedule",
                         "-o", str(tmp_path), "-q")
    assert code == 0, err
    dump = "\n".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    assert "host call" in dump and "[aten.cummax.default]" in dump
