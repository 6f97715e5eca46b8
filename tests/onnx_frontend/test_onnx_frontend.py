"""The ONNX frontend's contract: loading, inputs, calling conventions and its errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import sextant
from sextant.frontend.onnx import OnnxImportError, import_onnx
from sextant.graph.reference import run_graph

from .models import make, mlp_with_shape_glue, value


def _relu_model(shape: list) -> onnx.ModelProto:
    return make([helper.make_node("Relu", ["x"], ["y"])], [value("x", shape)], [value("y", shape)])


def test_path_bytes_and_proto_load_the_same(tmp_path) -> None:
    model = mlp_with_shape_glue()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    graphs = [import_onnx(m) for m in (model, str(path), path, model.SerializeToString())]
    assert len({str(g) for g in graphs}) == 1
    assert {"w", "b"} <= set(graphs[0].params)  # initializers become params, under their ONNX names


def test_reference_executor_runs_the_imported_graph() -> None:
    graph = import_onnx(mlp_with_shape_glue())
    x = torch.randn(4, 16)
    (y,) = run_graph(graph, [x])
    w, b = graph.params["w"], graph.params["b"]
    want = torch.softmax(torch.relu(x @ w + b).reshape(4, 4, 8), -1)
    torch.testing.assert_close(y, want)


def test_symbolic_dimension_needs_input_shapes() -> None:
    model = _relu_model(["batch", 8])
    with pytest.raises(OnnxImportError, match=r"input 'x' has a symbolic dimension 'batch'.*input_shapes"):
        import_onnx(model)
    compiled = sextant.compile_onnx(model, {"x": [3, 8]}, target="reference")
    np.testing.assert_array_equal(compiled(np.full((3, 8), -1, np.float32)), np.zeros((3, 8), np.float32))
    with pytest.raises(OnnxImportError, match="not inputs of the model"):
        import_onnx(model, {"y": [1]})


def test_all_unsupported_ops_reported_at_once() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok"),
             helper.make_node("NoSuchOp", ["a"], ["b"], name="first_bad"),
             helper.make_node("Fancy", ["x"], ["c"], domain="com.example", name="custom"),
             helper.make_node("Add", ["b", "c"], ["y"], name="downstream")]  # skipped: its inputs failed
    model = make(nodes, [value("x", [4])], [value("y", [4])])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(sextant.UnsupportedOpError) as info:
        sextant.compile_onnx(model)
    msg = str(info.value)
    assert "2 unsupported ONNX op(s)" in msg
    assert "ai.onnx::NoSuchOp (opset 18)" in msg and "node 'first_bad'" in msg
    assert "com.example::Fancy" in msg and "custom domain" in msg and "node 'custom'" in msg
    assert "sextant/frontend/onnx/" in msg
    assert len(info.value.items) == 2


def test_unsupported_dtype_names_the_input() -> None:
    model = make([helper.make_node("Relu", ["x"], ["y"])], [value("x", [4], TensorProto.DOUBLE)],
                 [value("y", [4], TensorProto.DOUBLE)])
    with pytest.raises(sextant.UnsupportedOpError, match=r"(?s)input 'x'.*element type double is not supported"):
        import_onnx(model)


def test_shape_input_depending_on_data_is_explained() -> None:
    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"], name="dyn")]
    model = make(nodes, [value("x", [4]), value("s", [1], TensorProto.INT64)], [value("y", [4])])
    with pytest.raises(sextant.UnsupportedOpError, match="must be known at compile time"):
        import_onnx(model)


def test_missing_file_and_wrong_type() -> None:
    with pytest.raises(OnnxImportError, match="does not exist"):
        import_onnx("/nonexistent/model.onnx")
    with pytest.raises(TypeError, match="ModelProto"):
        import_onnx(42)


def test_calling_conventions() -> None:
    nodes = [helper.make_node("Sub", ["a", "b"], ["d"]), helper.make_node("Neg", ["d"], ["n"])]
    model = make(nodes, [value("a", [2, 3]), value("b", [2, 3])], [value("d", [2, 3]), value("n", [2, 3])])
    c = sextant.compile_onnx(model, target="cpu")
    a, b = np.random.rand(2, 3).astype(np.float32), np.random.rand(2, 3).astype(np.float32)
    for got in (c(a, b), c(a=a, b=b), c({"a": a, "b": b}), tuple(c.run({"a": a, "b": b}))):
        assert isinstance(got[0], np.ndarray)
        np.testing.assert_allclose(got[0], a - b)
        np.testing.assert_allclose(got[1], b - a)
    t = c(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(t[0], torch.Tensor)
    with pytest.raises(sextant.InputError, match=r"expected shape \[2, 3\]"):
        c(a[:1], b)
    with pytest.raises(sextant.InputError, match="missing"):
        c(a=a)
    with pytest.raises(sextant.InputError, match="expected dtype f32"):
        c(a.astype(np.float64), b)
    assert "OnnxCompiledModule" in repr(c) and c.target == "cpu"


def test_bad_output_declaration_is_caught() -> None:
    model = make([helper.make_node("Relu", ["x"], ["y"])], [value("x", [4])], [value("y", [5])])
    with pytest.raises(OnnxImportError, match=r"declares shape \[5\].*produced \[4\]"):
        import_onnx(model)


def test_constant_inputs_specialise_shape_deciding_values() -> None:
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0, name="sum")]
    model = make(nodes, [value("x", [3, 4]), value("axes", [1], TensorProto.INT64)], [value("y", [3])])
    with pytest.raises(sextant.UnsupportedOpError, match=r"depends on graph input.*'axes'") as info:
        import_onnx(model)
    assert info.value.needs_values == ["axes"]
    c = sextant.compile_onnx(model, constant_inputs={"axes": np.array([1])}, target="cpu")
    x = np.random.rand(3, 4).astype(np.float32)
    np.testing.assert_allclose(c(x, np.array([1])), x.sum(1), rtol=1e-6)
    np.testing.assert_allclose(c({"x": x, "axes": np.array([1])}),
                               x.sum(1), rtol=1e-6)
    with pytest.raises(sextant.InputError, match=r"'axes' was specialised to \[1\].*got \[0\]"):
        c(x, np.array([0]))
