"""rebuild / replace_nodes / the pattern language."""

from __future__ import annotations

import pytest
import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node, make_node
from sextant.graph.passes.rewrite import P, PatternRewriter, rebuild, replace_nodes
from sextant.graph.printer import print_graph

F32 = DType.f32


def _graph():
    b = GraphBuilder()
    x = b.input("x", (2, 3), F32)
    y = b.input("y", (2, 3), F32)
    m = b.mul(x, 2.0)
    s = b.add(m, y)
    out = b.unary("exp", s)
    return b.build([out]), (x, y, m, s, out)


def test_rebuild_without_changes_returns_same_graph():
    g, _ = _graph()
    assert rebuild(g, lambda n: None) is g
    assert rebuild(g, lambda n: n) is g


def test_rebuild_substitutes_new_node_before_its_users(assert_equivalent):
    g, (x, _y, m, s, _out) = _graph()

    def fn(node: Node) -> Node | None:
        return make_node("add", [x, x]) if node is m else None  # x*2 -> x+x

    g2 = rebuild(g, fn)
    assert g2 is not g
    assert g2.nodes[0] is g.nodes[0] and g2.nodes[1] is g.nodes[1]  # untouched prefix keeps identity
    assert print_graph(g2) == (
        "graph @main(%x: f32[2,3], %y: f32[2,3]) {\n"
        "  %0 = full() {value=2.0} : f32[2,3]\n"
        "  %1 = add(%x, %x) : f32[2,3]\n"
        "  %2 = add(%1, %y) : f32[2,3]\n"
        "  %3 = exp(%2) : f32[2,3]\n"
        "  return (%3)\n"
        "}")
    assert s not in g2.nodes  # its operand changed, so it was recreated
    assert_equivalent(g, g2)


def test_rebuild_replacement_may_wrap_the_node_itself(assert_equivalent):
    g, (_x, _y, m, _s, _out) = _graph()

    def fn(node: Node) -> Node | None:
        if node.op == "mul":
            return make_node("neg", [make_node("neg", [node])])
        return None

    g2 = rebuild(g, fn)
    assert [n.op for n in g2.nodes] == ["input", "input", "full", "mul", "neg", "neg", "add", "exp"]
    assert m in g2.nodes
    assert_equivalent(g, g2)


def test_rebuild_pulls_forward_a_later_node_once(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (4,), F32)
    a = b.unary("sin", x)
    c = b.unary("cos", x)  # defined after a
    out = b.add(a, c)
    g = b.build([out])
    g2 = rebuild(g, lambda n: c if n is a else None)
    assert [n.op for n in g2.nodes] == ["input", "cos", "add"]
    assert g2.outputs[0].inputs == (c, c)
    b2 = GraphBuilder()
    x2 = b2.input("x", (4,), F32)
    c2 = b2.unary("cos", x2)
    ref = b2.build([b2.add(c2, c2)])
    assert_equivalent(ref, g2)


def test_rebuild_rejects_type_changing_replacement():
    g, (x, _y, m, _s, _out) = _graph()
    bad = make_node("reduce", [x], {"fn": "sum", "axes": (0,)})
    with pytest.raises(TypeError, match="does not have the type"):
        rebuild(g, lambda n: bad if n is m else None)


def test_rebuild_never_offers_inputs():
    g, _ = _graph()
    seen = []
    rebuild(g, lambda n: seen.append(n.op))
    assert "input" not in seen and len(seen) == len(g.nodes) - 2


def test_replace_nodes_keys_on_original_nodes(assert_equivalent):
    g, (x, y, m, s, out) = _graph()
    # s is recreated (m changes under it) before replace_nodes looks it up: keying on the original must still work
    g2 = replace_nodes(g, {m: make_node("add", [x, x]), s: make_node("sub", [y, x])})
    assert g2.op_counts() == {"input": 2, "full": 1, "sub": 1, "exp": 1, "add": 1}
    assert g2.outputs[0].inputs[0].op == "sub"
    assert out not in g2.nodes


def test_rebuild_handles_long_chains():
    b = GraphBuilder()
    x = b.input("x", (2,), F32)
    cur = x
    for _ in range(5000):
        cur = b.unary("neg", cur)
    g = b.build([cur])
    g2 = rebuild(g, lambda n: make_node("abs", n.inputs) if n is g.nodes[1] else None)
    assert len(g2.nodes) == len(g.nodes) and g2.nodes[1].op == "abs"
    assert all(n.op == "neg" for n in g2.nodes[2:])


# ---- patterns -------------------------------------------------------------------------------

def test_pattern_binds_and_checks_ops():
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    one = b.full(1.0, (3,), F32)
    m = b.emit("mul", [x, one])
    bindings: dict[str, Node] = {}
    assert P("mul", P.var("x"), P.full(1), name="root").match(m, bindings)
    assert bindings == {"x": x, "root": m}
    assert not P("add", P.var("x"), P.full(1)).match(m, {})
    assert P(("add", "mul"), P.var("x"), P.full(1)).match(m, {})
    assert not P("mul", P.full(1), P.var("x")).match(m, {})  # operand order matters
    assert not P("mul", P.var("x")).match(m, {})  # operand count must agree
    assert P("mul").match(m, {})  # no operand patterns: any operands


def test_pattern_full_value_is_exact():
    b = GraphBuilder()
    assert P.full(1).match(b.full(1.0, (2,), F32), {})
    assert not P.full(1).match(b.full(1.0000001, (2,), F32), {})
    assert P.full(0).match(b.full(-0.0, (2,), F32), {})
    assert not P.full(0).match(b.iota((2,), 0), {})


def test_pattern_repeated_name_needs_same_node():
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    y = b.input("y", (3,), F32)
    same = b.emit("add", [x, x])
    diff = b.emit("add", [x, y])
    pat = P("add", P.var("a"), P.var("a"))
    assert pat.match(same, {})
    assert not pat.match(diff, {})


def test_pattern_rewriter_reaches_fixed_point_and_guards_types(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    cur = x
    for _ in range(6):
        cur = b.unary("neg", cur)
    flag = b.unary("isnan", cur)
    g = b.build([cur, flag])
    rw = PatternRewriter([
        (P("neg", P("neg", P.var("x"))), lambda x: x),
        (P("isnan", P.var("x")), lambda x: x),  # wrong type (f32 for bool): must be discarded
    ])
    g2 = rw(g)
    assert g2.outputs[0] is x
    assert g2.outputs[1].op == "isnan" and g2.outputs[1].inputs == (x,)
    assert rw(g2) is g2
    assert_equivalent(g, g2)


def test_pattern_rewriter_first_matching_rule_wins():
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    n = b.unary("neg", x)
    g = b.build([n])
    declines = PatternRewriter([(P("neg", P.var("x")), lambda x: None),
                                (P("neg", P.var("x")), lambda x: make_node("abs", [x]))])
    assert declines(g).outputs[0].op == "abs"
    first = PatternRewriter([(P("neg", P.var("x")), lambda x: make_node("sin", [x])),
                             (P("neg", P.var("x")), lambda x: make_node("abs", [x]))])
    assert first(g).outputs[0].op == "sin"


def test_rebuild_replacement_values(assert_equivalent):
    """A replacement built on a param keeps the graph's params."""
    b = GraphBuilder()
    x = b.input("x", (2,), F32)
    w = b.param("w", torch.tensor([1.0, 2.0]))
    out = b.add(x, w)
    g = b.build([out])
    g2 = rebuild(g, lambda n: make_node("add", [w, x]) if n is out else None)
    assert g2.params["w"] is g.params["w"]
    assert_equivalent(g, g2)
