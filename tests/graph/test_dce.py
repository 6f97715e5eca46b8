"""Dead-code elimination."""

from __future__ import annotations

import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes.dce import dce
from sextant.graph.printer import print_graph

F32 = DType.f32


def test_dce_drops_dead_nodes_and_their_params(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 3), F32)
    unused = b.input("unused", (5,), DType.i64)
    w = b.param("w", torch.randn(2, 3))
    dead_w = b.param("dead_w", torch.randn(2, 3))
    b.add(x, dead_w)  # dead
    b.unary("exp", b.unary("sin", x))  # dead chain
    out = b.mul(x, w)
    g = b.build([out])
    g2 = dce(g)
    assert print_graph(g2) == (
        "graph @main(%x: f32[2,3], %unused: i64[5]) {\n"
        '  %0 = param() {name="w"} : f32[2,3]\n'
        "  %1 = mul(%x, %0) : f32[2,3]\n"
        "  return (%1)\n"
        "}")
    assert g2.inputs == (x, unused)  # the signature survives
    assert set(g2.params) == {"w"}
    assert g2.params["w"] is g.params["w"]
    assert_equivalent(g, g2)


def test_dce_drops_params_that_no_node_names():
    b = GraphBuilder()
    x = b.input("x", (2,), F32)
    g = b.build([b.unary("neg", x)])
    g = g.with_nodes(g.nodes, g.outputs, {"orphan": torch.zeros(2)})
    assert dce(g).params == {}


def test_dce_keeps_everything_live_and_returns_same_graph():
    b = GraphBuilder()
    x = b.input("x", (2,), F32)
    w = b.param("w", torch.ones(2))
    a = b.add(x, w)
    g = b.build([a, x, a])  # duplicate outputs and an input as output
    assert dce(g) is g


def test_dce_keeps_node_order_and_output_order(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    p = b.unary("sin", x)
    b.unary("cos", x)  # dead, between two live nodes
    q = b.unary("exp", x)
    g = b.build([q, p])
    g2 = dce(g)
    assert [n.op for n in g2.nodes] == ["input", "sin", "exp"]
    assert g2.outputs == (q, p)
    assert_equivalent(g, g2)


def test_dce_long_dead_chain():
    b = GraphBuilder()
    x = b.input("x", (2,), F32)
    cur = x
    for _ in range(3000):
        cur = b.unary("neg", cur)
    g = b.build([x])
    assert len(dce(g).nodes) == 1
