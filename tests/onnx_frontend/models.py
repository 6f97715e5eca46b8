"""ONNX test models: built with onnx.helper, or exported from sextant's examples with torch.onnx.export."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OPSET = 18


def value(name: str, shape: list, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def make(nodes: list, inputs: list, outputs: list, initializers: dict[str, np.ndarray] | None = None,
         opset: int = OPSET, name: str = "test") -> onnx.ModelProto:
    inits = [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()]
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def mlp_with_shape_glue(batch: int = 4) -> onnx.ModelProto:
    """MatMul + bias + Relu, then the Shape → Gather → Concat → Reshape glue exporters emit, and a Softmax."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 32)).astype(np.float32) / 4
    bias = rng.standard_normal(32).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
        helper.make_node("Add", ["m", "b"], ["a"], name="bias"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Shape", ["r"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="batch_dim"),
        helper.make_node("Concat", ["n", "split"], ["newshape"], axis=0, name="newshape"),
        helper.make_node("Reshape", ["r", "newshape"], ["r3"], name="reshape"),
        helper.make_node("Softmax", ["r3"], ["y"], axis=-1, name="softmax"),
    ]
    inits = {"w": w, "b": bias, "zero": np.array([0], np.int64), "split": np.array([4, 8], np.int64)}
    return make(nodes, [value("x", [batch, 16])], [value("y", [batch, 4, 8])], inits)


@contextlib.contextmanager
def _quiet():
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def export(module: torch.nn.Module, args: tuple) -> onnx.ModelProto:
    """torch.onnx.export (the dynamo exporter) of ``module`` at the example shapes."""
    with _quiet():
        program = torch.onnx.export(module.eval(), args, dynamo=True, verbose=False, optimize=True)
    return program.model_proto
