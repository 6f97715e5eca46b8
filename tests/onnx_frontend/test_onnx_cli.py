"""`sextant compile|run|explain model.onnx`: the command line on ONNX files."""

from __future__ import annotations

import io
from pathlib import Path

import onnx
import pytest
from onnx import helper

from sextant.cli.main import main

from .models import make, mlp_with_shape_glue, value


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_with_shape_glue(), str(path))
    return path


def test_compile_dump_all_and_report(model_file: Path, tmp_path: Path) -> None:
    out_dir, report = tmp_path / "dump", tmp_path / "r.html"
    code, out, err = cli("compile", str(model_file), "--target", "cuda-sim", "--dump", "all", "-o", str(out_dir),
                         "--report", str(report))
    assert code == 0, err
    assert "import: ONNX -> graph IR" in err and "wrote report" in out
    assert (out_dir / "index.md").exists() and any(out_dir.rglob("*.ptx"))
    assert "mlp.onnx" in (out_dir / "index.md").read_text()
    assert report.stat().st_size > 10_000
    assert "cuda-sim counters" in report.read_text()  # an ONNX model's inputs feed the counting run too


def test_run_compares_with_onnxruntime(model_file: Path) -> None:
    code, out, err = cli("run", str(model_file), "--target", "cpu", "--runs", "2")
    assert code == 0, err
    assert "max |sextant - onnxruntime|" in out and ": OK" in out and "onnxruntime 1." in out


def test_explain_names_onnx_nodes(model_file: Path) -> None:
    code, out, err = cli("explain", str(model_file), "--target", "cpu")
    assert code == 0, err
    assert "matmul" in out and "softmax" in out  # kernels say which ONNX nodes they came from


def test_symbolic_input_needs_input_shape(tmp_path: Path) -> None:
    path = tmp_path / "dyn.onnx"
    onnx.save(make([helper.make_node("Relu", ["x"], ["y"])], [value("x", ["n", 4])], [value("y", ["n", 4])]),
              str(path))
    code, _, err = cli("compile", str(path), "--target", "cpu")
    assert code == 1 and "symbolic dimension 'n'" in err
    code, _, err = cli("run", str(path), "--target", "cpu", "--runs", "1", "--input-shape", "x=3,4")
    assert code == 0, err
    code, _, err = cli("compile", "mlp", "--input-shape", "x=3,4")
    assert code == 2 and "--input-shape applies to .onnx models only" in err
    code, _, err = cli("compile", str(path), "--input-shape", "x=")
    assert code == 2 and "NAME=D0,D1" in err


def test_unsupported_op_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.onnx"
    onnx.save(make([helper.make_node("NoSuchOp", ["x"], ["y"], name="n0")], [value("x", [4])], [value("y", [4])]),
              str(path))
    code, _, err = cli("compile", str(path), "--target", "cpu")
    assert code == 1 and "ai.onnx::NoSuchOp (opset 18) at node 'n0'" in err
    code, _, err = cli("compile", str(tmp_path / "missing.onnx"))
    assert code == 2 and "does not exist" in err
