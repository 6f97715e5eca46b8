"""Constant folding: uniform fulls (stage 1) and evaluated constant subgraphs (stage 2)."""

from __future__ import annotations

import math

import pytest
import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes import run_pipeline
from sextant.graph.passes.constant_fold import MIN_FOLD_NUMEL, constant_fold, fold_uniform
from sextant.graph.passes.dce import dce
from sextant.graph.printer import print_graph
from sextant.graph.reference import run_graph

F32, I32 = DType.f32, DType.i32


def fold(g):
    return dce(constant_fold(g))


def test_uniform_arithmetic_folds_to_full(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 2), F32)
    b.loc = "model.py:7"
    c = b.mul(b.add(b.full(2.0, (2, 2), F32), b.full(3.0, (2, 2), F32)), 4.0)
    b.loc = None
    g = b.build([b.add(x, c)])
    g2 = fold(g)
    assert print_graph(g2) == (
        "graph @main(%x: f32[2,2]) {\n"
        '  %0 = full() {value=20.0} : f32[2,2]  loc("model.py:7")\n'
        "  %1 = add(%x, %0) : f32[2,2]\n"
        "  return (%1)\n"
        "}")
    assert_equivalent(g, g2)


@pytest.mark.parametrize(("op", "a", "b", "dtype", "expected"), [
    ("div", 7, -2, I32, -3),  # integer div truncates
    ("floordiv", 7, -2, I32, -4),
    ("remainder", -7, 3, I32, 2),
    ("fmod", -7, 3, I32, -1),
    ("div", 1.0, 3.0, DType.f16, float(torch.tensor(1 / 3, dtype=torch.float16))),  # f16 rounding
    ("add", 2**31 - 1, 1, I32, -(2**31)),  # wraps like the runtime
    ("lt", 1.0, 2.0, F32, True),
])
def test_uniform_values_match_the_reference(op, a, b, dtype, expected):
    gb = GraphBuilder()
    out = gb.binary(op, gb.full(a, (3,), dtype), gb.full(b, (3,), dtype))
    g = gb.build([out])
    g2 = fold(g)
    (node,) = g2.nodes
    assert node.op == "full" and node.attr("value") == expected
    assert type(node.attr("value")) is type(expected)
    torch.testing.assert_close(run_graph(g2, [])[0], run_graph(g, [])[0])


def test_casts_of_fulls():
    b = GraphBuilder()
    outs = [b.cast(b.full(-3.7, (2,), F32), I32), b.cast(b.full(0.1, (2,), F32), DType.f16),
            b.cast(b.full(2, (2,), I32), DType.bool), b.cast(b.full(70000.0, (2,), F32), DType.f16)]
    g = b.build(outs)
    g2 = fold(g)
    assert [n.op for n in g2.nodes] == ["full"] * 4
    assert [n.attr("value") for n in g2.outputs] == [-3, float(torch.tensor(0.1, dtype=torch.float16)), True,
                                                     math.inf]
    for got, want in zip(run_graph(g2, []), run_graph(g, [])):
        torch.testing.assert_close(got, want)


def test_movement_and_reductions_of_fulls(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 3), F32)
    f = b.full(1.5, (3, 2), F32)
    moved = b.slice(b.permute(b.expand(b.reshape(f, (1, 3, 2)), (4, 3, 2)), (0, 2, 1)), 0, 1, 2)  # [2,2,3]
    moved = b.reshape(b.reduce("max", moved, (0,)), (2, 3))
    padded_same = b.pad(b.full(1.5, (2, 1), F32), (0, 0), (0, 2), 1.5)
    joined = b.concat([b.full(1.5, (2, 1), F32), b.full(1.5, (2, 2), F32)], axis=1)
    s = b.expand(b.reduce("sum", b.full(0.25, (4, 8), F32), (0, 1)), (2, 3))
    p = b.expand(b.reduce("prod", b.full(2.0, (10, 1), F32), (0,)), (2, 3))
    g = b.build([b.add(x, moved), b.add(x, padded_same), b.add(x, joined), b.add(x, s), b.add(x, p)])
    g2 = fold(g)
    assert g2.op_counts() == {"input": 1, "full": 5, "add": 5}
    assert [out.inputs[1].attr("value") for out in g2.outputs] == [1.5, 1.5, 1.5, 8.0, 1024.0]
    assert_equivalent(g, g2)


def test_integer_reductions_wrap_and_empty_reductions():
    b = GraphBuilder()
    big = b.reduce("sum", b.full(2**30, (4,), I32), (0,))  # 2**32 wraps to 0
    prod = b.reduce("prod", b.full(3, (41,), DType.i64), (0,))  # 3**41 wraps in i64
    empty_sum = b.reduce("sum", b.full(5.0, (0, 3), F32), (0,))
    empty_prod = b.reduce("prod", b.full(5, (0, 3), I32), (0,))
    g = b.build([big, prod, empty_sum, empty_prod])
    g2 = fold(g)
    assert [n.attr("value") for n in g2.outputs] == [0, torch.tensor(3, dtype=torch.int64).pow(41).item(), 0.0, 1]
    for got, want in zip(run_graph(g2, []), run_graph(g, [])):
        torch.testing.assert_close(got, want)


def test_reductions_over_nothing_fold_to_their_identity():
    # The reference gives a reduction over no elements its identity (torch.amax would reject it):
    # stage 1 folds to the same value, also where the result is too big for stage 2.
    b = GraphBuilder()
    wide = MIN_FOLD_NUMEL + 1
    outs = [b.reduce("max", b.full(1.0, (0, wide), F32), (0,)),
            b.reduce("min", b.full(1.0, (2, 0), F32), (1,)),
            b.reduce("max", b.full(7, (0, 2), I32), (0,)),
            b.reduce("min", b.full(False, (0, 2), DType.bool), (0,)),
            b.reduce("sum", b.full(math.inf, (0, 2), F32), (0,)),  # not inf * 0
            b.reduce("prod", b.full(math.nan, (0, 2), F32), (0,))]
    g = b.build(outs)
    g2 = fold_uniform(g)
    assert [n.op for n in g2.outputs] == ["full"] * len(outs)
    assert [n.attr("value") for n in g2.outputs] == [-math.inf, math.inf, -(2**31), True, 0.0, 1.0]
    assert g2.outputs[0].shape == (1, wide)
    for got, want in zip(run_graph(g2, []), run_graph(g, [])):
        torch.testing.assert_close(got, want)
    assert [n.op for n in fold(g).outputs] == ["full"] * len(outs)


def test_constant_subgraph_becomes_folded_param(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (4, 3), F32)
    ramp = b.cast(b.iota((3, 4), 1), F32)
    wt = b.permute(ramp, (1, 0))
    b.loc = "net.py:3"
    scaled = b.mul(wt, 0.5)
    b.loc = None
    g = b.build([b.add(x, scaled)])
    g2 = fold(g)
    assert print_graph(g2) == (
        "graph @main(%x: f32[4,3]) {\n"
        '  %0 = param() {name="folded.0"} : f32[4,3]  loc("net.py:3")\n'
        "  %1 = add(%x, %0) : f32[4,3]\n"
        "  return (%1)\n"
        "}")
    assert set(g2.params) == {"folded.0"}
    torch.testing.assert_close(g2.params["folded.0"], torch.arange(4.0).expand(3, 4).T * 0.5)
    assert g2.params["folded.0"].is_contiguous()
    assert_equivalent(g, g2)


def test_folded_names_are_unique(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    w = b.param("folded.0", torch.randn(3))  # a weight that happens to have a folder's name
    v = b.param("v", torch.randn(3))
    ramp = b.cast(b.arange(3), F32)
    g = b.build([b.add(x, b.mul(w, b.unary("sin", ramp))), b.add(v, b.unary("cos", ramp))])
    g2 = dce(constant_fold(g))
    assert set(g2.params) == {"folded.0", "v", "folded.1", "folded.2"}
    assert g2.params["folded.0"] is g.params["folded.0"]
    torch.testing.assert_close(g2.params["folded.1"], torch.arange(3.0).sin())
    torch.testing.assert_close(g2.params["folded.2"], torch.arange(3.0).cos())
    assert_equivalent(g, g2)


def test_uniform_evaluated_result_becomes_full(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    ramp = b.cast(b.arange(3), F32)  # [0, 1, 2]
    zeros = b.sub(ramp, ramp)
    neg_zeros = b.unary("neg", b.mul(ramp, 0.0))
    mixed = b.mul(b.sub(ramp, 1.0), 0.0)  # [-0.0, 0.0, 0.0]
    g = b.build([b.add(x, zeros), b.div(x, neg_zeros), b.div(x, b.unary("abs", b.unary("neg", mixed))),
                 b.div(x, b.unary("neg", mixed))])
    g2 = fold(g)
    fulls = [n for n in g2.nodes if n.op == "full"]
    assert [repr(n.attr("value")) for n in fulls] == ["0.0", "-0.0", "0.0"]
    assert [n.op for n in g2.outputs[3].inputs] == ["input", "param"]  # 0.0 and -0.0 mixed: not uniform
    assert set(g2.params) == {"folded.0"}
    assert_equivalent(g, g2)


def test_iota_subgraphs_fold(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 5), F32)
    r = b.cast(b.iota((2, 5), 1), F32)
    g = b.build([b.mul(x, r)])
    g2 = fold(g)
    assert g2.op_counts() == {"input": 1, "param": 1, "mul": 1}
    torch.testing.assert_close(g2.params["folded.0"], torch.arange(5.0).expand(2, 5))
    assert_equivalent(g, g2)


def test_expand_of_a_constant_stays_lazy(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (4, 250, 250), F32)
    c = b.cast(b.iota((250, 250), 1), F32)  # 62500 elements: folds
    big = b.expand(b.reshape(c, (1, 250, 250)), (4, 250, 250))  # 250000: beyond the bound
    g = b.build([b.add(x, b.unary("neg", big))])
    g2 = fold(g)
    assert g2.op_counts() == {"input": 1, "param": 1, "expand": 1, "neg": 1, "add": 1}
    assert [t.shape for t in g2.params.values()] == [(1, 250, 250)]
    assert_equivalent(g, g2, trials=1)


def test_small_results_fold_even_from_small_constants(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (64, 1000), F32)
    w = b.cast(b.iota((1, 1000), 1), F32)
    ok = b.unary("neg", b.expand(w, (64, 1000)))  # 64000 <= 65536: folds
    too_big = b.unary("neg", b.expand(w, (66, 1000)))  # 66000 > 65536: stays lazy
    g = b.build([b.add(x, ok), b.reduce("sum", too_big, (0,))])
    g2 = fold(g)
    assert g2.outputs[0].inputs[1].op == "param"
    assert g2.outputs[0].inputs[1].shape == (64, 1000)
    (expand,) = g2.outputs[1].inputs[0].inputs
    assert expand.op == "expand" and expand.inputs[0].op == "param" and expand.inputs[0].shape == (1, 1000)
    assert_equivalent(g, g2, trials=1)


def test_broadcast_used_directly_and_by_other_constants(assert_equivalent):
    # The expand stays lazy for its direct user; its constant users still fold (from its value).
    b = GraphBuilder()
    x = b.input("x", (8, 4), F32)
    e = b.expand(b.cast(b.iota((1, 4), 1), F32), (8, 4))
    g = b.build([b.add(x, e), b.add(x, b.unary("neg", e))])
    g2 = fold(g)
    assert print_graph(g2) == (
        "graph @main(%x: f32[8,4]) {\n"
        '  %0 = param() {name="folded.0"} : f32[1,4]\n'
        "  %1 = expand(%0) {shape=[8,4]} : f32[8,4]\n"
        "  %2 = add(%x, %1) : f32[8,4]\n"
        '  %3 = param() {name="folded.1"} : f32[8,4]\n'
        "  %4 = add(%x, %3) : f32[8,4]\n"
        "  return (%2, %4)\n"
        "}")
    torch.testing.assert_close(g2.params["folded.0"], torch.arange(4.0)[None])
    assert g2.params["folded.0"].is_contiguous()
    assert constant_fold(g2) is g2
    assert_equivalent(g, g2)


def test_broadcast_feeding_a_rejected_constant_stays_lazy(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (8, 4), I32)
    e = b.expand(b.add(b.iota((1, 4), 1, I32), 1), (8, 4))
    g = b.build([b.add(x, b.div(e, b.full(0, (8, 4), I32)))])  # integer division by zero: rejected
    g2 = fold(g)
    (div,) = [n for n in g2.nodes if n.op == "div"]
    assert div.inputs[0].op == "expand" and div.inputs[0].inputs[0].op == "param"
    assert [t.shape for t in g2.params.values()] == [(1, 4)]
    torch.testing.assert_close(next(iter(g2.params.values())), torch.tensor([[1, 2, 3, 4]], dtype=torch.int32))


def test_broadcasts_of_constants_stay_lazy(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (8, 4), F32)
    bias = b.cast(b.arange(4), F32)
    g = b.build([b.add(x, b.expand(b.reshape(b.unary("neg", bias), (1, 4)), (8, 4)))])
    g2 = fold(g)
    assert print_graph(g2) == (
        "graph @main(%x: f32[8,4]) {\n"
        '  %0 = param() {name="folded.0"} : f32[1,4]\n'
        "  %1 = expand(%0) {shape=[8,4]} : f32[8,4]\n"
        "  %2 = add(%x, %1) : f32[8,4]\n"
        "  return (%2)\n"
        "}")
    torch.testing.assert_close(g2.params["folded.0"], -torch.arange(4.0)[None])
    assert_equivalent(g, g2)


def test_pad_of_full_with_other_value_is_evaluated(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (4,), F32)
    g = b.build([b.add(x, b.pad(b.full(1.0, (2,), F32), (1,), (1,), 0.0))])
    g2 = fold(g)
    (p,) = [n for n in g2.nodes if n.op == "param"]
    torch.testing.assert_close(g2.params[p.attr("name")], torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert_equivalent(g, g2)


def test_nothing_to_fold_returns_same_graph():
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    w = b.param("w", torch.randn(3))
    g = b.build([b.add(x, w), b.mul(x, b.full(2.0, (3,), F32))])
    assert constant_fold(g) is g


def test_constants_the_reference_rejects_stay_and_their_operands_fold():
    b = GraphBuilder()
    x = b.input("x", (3,), I32)
    den = b.sub(b.arange(3, I32), 1)  # [-1, 0, 1], evaluates fine
    zero = b.mul(b.arange(3, I32), 0)  # evaluates to a uniform 0
    bad = b.div(b.add(b.full(6, (3,), I32), zero), den)  # integer division by zero: rejected
    g = b.build([b.add(b.unary("neg", bad), x)])
    g2 = fold(g)
    assert print_graph(g2) == (
        "graph @main(%x: i32[3]) {\n"
        '  %0 = param() {name="folded.0"} : i32[3]\n'
        "  %1 = full() {value=6} : i32[3]\n"
        "  %2 = div(%1, %0) : i32[3]\n"
        "  %3 = neg(%2) : i32[3]\n"
        "  %4 = add(%3, %x) : i32[3]\n"
        "  return (%4)\n"
        "}")
    torch.testing.assert_close(g2.params["folded.0"], torch.tensor([-1, 0, 1], dtype=torch.int32))


def test_identical_folded_results_share_one_param(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    w = b.cast(b.add(b.arange(3), 1), F32)
    two_a = b.add(b.full(1.0, (3,), F32), b.full(1.0, (3,), F32))
    two_b = b.full(2.0, (3,), F32)
    g = b.build([b.add(x, b.mul(w, two_a)), b.sub(x, b.mul(w, two_b)), b.add(x, b.unary("neg", w))])
    g2 = fold(g)
    assert sorted(g2.params) == ["folded.0", "folded.1"]
    assert g2.outputs[0].inputs[1] is g2.outputs[1].inputs[1]
    assert g2.outputs[2].inputs[1] is not g2.outputs[0].inputs[1]
    assert_equivalent(g, g2)


# ---- weights (params) are no compile-time constants ---------------------------------------------


def test_weights_are_never_folded_or_renamed(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 4), F32)
    w = b.param("w", torch.randn(3, 4))
    bias = b.param("bias", torch.zeros(3))  # uniform, but a weight: no full
    scale = b.param("scale", torch.full((2, 3), 2.0))
    linear = b.add(b.matmul(x, b.permute(w, (1, 0))), b.expand(b.reshape(bias, (1, 3)), (2, 3)))
    g = b.build([b.mul(linear, b.mul(scale, b.full(0.5, (2, 3), F32))),  # mul(param, full)
                 b.unary("neg", bias), b.reduce("sum", b.unary("exp", bias), (0,))])
    assert constant_fold(g) is g
    g2 = run_pipeline(g)
    assert g2.op_counts() == g.op_counts()
    assert {n.attr("name") for n in g2.nodes if n.op == "param"} == {"w", "bias", "scale"}
    assert all(g2.params[k] is g.params[k] for k in ("w", "bias", "scale"))
    (permute,) = [n for n in g2.nodes if n.op == "permute"]
    assert permute.inputs[0].attr("name") == "w"
    assert [i.op for i in g2.outputs[0].inputs[1].inputs] == ["param", "full"]
    assert g2.outputs[1].inputs[0].attr("name") == "bias"
    assert_equivalent(g, g2)


def test_weights_meet_folded_constants_but_stay_weights(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (3,), F32)
    w = b.param("w", torch.zeros(3))
    g = b.build([b.add(x, b.mul(w, b.add(b.cast(b.arange(3), F32), 1.0)))])
    g2 = fold(g)
    mul = g2.outputs[0].inputs[1]
    assert mul.op == "mul" and [i.attr("name") for i in mul.inputs] == ["w", "folded.0"]
    assert g2.params["w"] is g.params["w"]
    torch.testing.assert_close(g2.params["folded.0"], torch.tensor([1.0, 2.0, 3.0]))
    assert_equivalent(g, g2)


def test_a_causal_mask_on_computed_values_stays_a_comparison(assert_equivalent):
    """``where(key <= query, x, -inf)`` keeps its comparison of iotas (a kernel recomputes it with
    one compare, and fused attention recognises it); the same predicate folded into a constant
    mask, or combined with other constants, still folds into one table."""
    b = GraphBuilder()
    x = b.input("x", (8, 8), F32)
    keep = b.binary("le", b.iota((8, 8), 1), b.iota((8, 8), 0))
    g = b.build([b.where(keep, x, -math.inf)])
    g2 = fold(g)
    assert not g2.params and "le(" in print_graph(g2)
    assert_equivalent(g, g2)

    b = GraphBuilder()
    x = b.input("x", (8, 8), F32)
    keep = b.binary("le", b.iota((8, 8), 1), b.iota((8, 8), 0))
    additive = b.where(keep, b.full(0.0, (8, 8), F32), -1e9)  # a constant mask: one table
    combined = b.binary("bitwise_and", keep, b.binary("ne", b.iota((8, 8), 1), b.full(3, (8, 8), DType.i64)))
    g = b.build([b.add(x, additive), b.where(combined, x, 0.0)])
    g2 = fold(g)
    assert "le(" not in print_graph(g2) and len(g2.params) == 2
    assert_equivalent(g, g2)
