"""The verifier rejects graphs that break IR invariants, naming the node and the rule."""

import dataclasses

import pytest
import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node, make_node
from sextant.graph.ops import IRTypeError, TensorType
from sextant.graph.verifier import VerificationError, verify


def _graph():
    b = GraphBuilder("v")
    x = b.input("x", (2, 3), DType.f32)
    w = b.param("w", torch.randn(3, 4))
    y = b.matmul(x, w)
    return b, b.build([b.unary("exp", y)])


def test_valid_graph_passes() -> None:
    verify(_graph()[1])


def test_use_before_definition() -> None:
    _, g = _graph()
    nodes = list(g.nodes)
    nodes[-1], nodes[-2] = nodes[-2], nodes[-1]
    with pytest.raises(VerificationError, match="before it is defined"):
        verify(dataclasses.replace(g, nodes=tuple(nodes)))


def test_wrong_stored_type() -> None:
    _, g = _graph()
    last = g.nodes[-1]
    bad = Node(last.op, last.inputs, last.attrs, TensorType((2, 5), DType.f32))
    with pytest.raises(VerificationError, match="stored type f32\\[2,5\\] but its operands give f32\\[2,4\\]"):
        verify(g.with_nodes(g.nodes[:-1] + (bad,), [bad]))


def test_param_tensor_mismatch() -> None:
    _, g = _graph()
    with pytest.raises(VerificationError, match="param tensor is"):
        verify(dataclasses.replace(g, params={"w": torch.randn(4, 4)}))
    with pytest.raises(VerificationError, match="has no tensor"):
        verify(dataclasses.replace(g, params={}))


def test_output_not_in_graph() -> None:
    _, g = _graph()
    stray = make_node("full", (), {"value": 1.0, "shape": (1,), "dtype": DType.f32})
    with pytest.raises(VerificationError, match="is an output but not in the node list"):
        verify(dataclasses.replace(g, outputs=(stray,)))


def test_error_names_the_pass() -> None:
    _, g = _graph()
    with pytest.raises(VerificationError, match="after pass 'broken'"):
        verify(dataclasses.replace(g, params={}), where="pass 'broken'")


@pytest.mark.parametrize(
    ("op", "types", "attrs", "message"),
    [
        ("add", [TensorType((2,), DType.f32), TensorType((3,), DType.f32)], {}, "identical types"),
        ("exp", [TensorType((2,), DType.i64)], {}, "needs a float operand"),
        ("where", [TensorType((2,), DType.f32)] * 3, {}, "condition must be bool"),
        ("matmul", [TensorType((2, 3), DType.f32), TensorType((4, 5), DType.f32)], {}, "do not line up"),
        ("reshape", [TensorType((2, 3), DType.f32)], {"shape": (5,)}, "cannot reshape"),
        ("expand", [TensorType((2, 3), DType.f32)], {"shape": (4, 3)}, "only size-1 dims expand"),
        ("slice", [TensorType((4,), DType.f32)], {"start": (2,), "step": (1,), "size": (3,)}, "reads indices 2..4"),
        ("reduce", [TensorType((4,), DType.f32)], {"fn": "mean", "axes": (0,)}, "unknown reduction"),
        ("gather", [TensorType((4, 2), DType.f32), TensorType((4, 2), DType.f32)], {"axis": 0}, "must be i32/i64"),
        ("conv", [TensorType((1, 4, 8, 8), DType.f32), TensorType((2, 3, 3, 3), DType.f32)],
         {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}, "channels/groups mismatch"),
    ],
)
def test_typing_rules_reject(op: str, types, attrs, message: str) -> None:
    from sextant.graph.ops import infer_type

    with pytest.raises(IRTypeError, match=message):
        infer_type(op, types, attrs)
