"""Common-subexpression elimination."""

from __future__ import annotations

import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes.cse import cse
from sextant.graph.passes.dce import dce
from sextant.graph.printer import print_graph

F32 = DType.f32


def test_cse_merges_transitively(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 3), F32)
    y = b.input("y", (2, 3), F32)
    a1 = b.unary("exp", b.add(x, y))
    a2 = b.unary("exp", b.add(x, y))  # same as a1 only once the adds are merged
    out = b.mul(a1, a2)
    g = b.build([out, a2])
    g2 = dce(cse(g))
    assert print_graph(g2) == (
        "graph @main(%x: f32[2,3], %y: f32[2,3]) {\n"
        "  %0 = add(%x, %y) : f32[2,3]\n"
        "  %1 = exp(%0) : f32[2,3]\n"
        "  %2 = mul(%1, %1) : f32[2,3]\n"
        "  return (%2, %1)\n"
        "}")
    assert_equivalent(g, g2)


def test_cse_respects_attrs_types_and_operand_order(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 3), F32)
    y = b.input("y", (2, 3), F32)
    outs = [b.reshape(x, (3, 2)), b.reshape(x, (6,)), b.sub(x, y), b.sub(y, x),
            b.cast(x, DType.f16), b.cast(x, DType.bf16), b.reduce("sum", x, (0,)), b.reduce("max", x, (0,))]
    g = b.build(outs)
    assert cse(g) is g
    assert_equivalent(g, cse(g))


def test_cse_full_values_compare_by_bits(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (4,), F32)
    pos, neg = b.full(0.0, (4,), F32), b.full(-0.0, (4,), F32)
    nan1, nan2 = b.full(float("nan"), (4,), F32), b.full(float("nan"), (4,), F32)
    one_f, one_i = b.full(1.0, (4,), F32), b.full(1, (4,), DType.i32)
    g = b.build([b.div(x, pos), b.div(x, neg), b.add(x, nan1), b.add(x, nan2), one_f, one_i])
    g2 = dce(cse(g))
    assert g2.op_counts()["full"] == 5  # only the two NaNs merge
    out = g2.outputs
    assert out[0].inputs[1] is not out[1].inputs[1]
    assert out[2].inputs[1] is out[3].inputs[1]
    assert_equivalent(g, g2)


def test_cse_params_merge_by_name_only(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    t = torch.randn(3)
    w1 = b.param("w", t)
    w2 = b.param("w", t)  # the same tensor named twice
    v = b.param("v", t.clone())  # equal contents, different name: kept apart
    g = b.build([b.add(x, w1), b.add(x, w2), b.add(x, v)])
    g2 = cse(g)
    assert g2.op_counts() == {"input": 1, "param": 2, "add": 2}
    assert g2.outputs[0] is g2.outputs[1]
    assert g2.outputs[2] is not g2.outputs[0]
    assert_equivalent(g, g2)


def test_cse_never_merges_inputs(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    y = b.input("y", (3,), F32)
    g = b.build([b.unary("neg", x), b.unary("neg", y), b.unary("neg", x)])
    g2 = cse(g)
    assert g2.inputs == (x, y)
    assert g2.outputs[0] is g2.outputs[2] and g2.outputs[1] is not g2.outputs[0]
    assert_equivalent(g, g2)


def test_cse_is_idempotent():
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    g = b.build([b.add(b.unary("sin", x), b.unary("sin", x))])
    g2 = cse(g)
    assert g2 is not g
    assert cse(g2) is g2
