"""Algebraic simplification rules: each identity fires, and each near-miss does not."""

from __future__ import annotations

import pytest

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes.dce import dce
from sextant.graph.passes.simplify import simplify
from sextant.graph.printer import print_graph

F32, F16, I32 = DType.f32, DType.f16, DType.i32
SHAPE = (2, 3)


def _full(b, v, dtype=F32, shape=SHAPE):
    return b.full(v, shape, dtype)


# Each case: (name, dtype of x, build(b, x) -> node). Identities must reduce to exactly x.
IDENTITIES = [
    ("x+0", F32, lambda b, x: b.emit("add", [x, _full(b, 0.0)])),
    ("x+-0", F32, lambda b, x: b.emit("add", [x, _full(b, -0.0)])),
    ("0+x", I32, lambda b, x: b.emit("add", [_full(b, 0, I32), x])),
    ("x-0", F32, lambda b, x: b.emit("sub", [x, _full(b, 0.0)])),
    ("x*1", F32, lambda b, x: b.emit("mul", [x, _full(b, 1.0)])),
    ("1*x", I32, lambda b, x: b.emit("mul", [_full(b, 1, I32), x])),
    ("x/1", F32, lambda b, x: b.emit("div", [x, _full(b, 1.0)])),
    ("x/1 int", I32, lambda b, x: b.emit("div", [x, _full(b, 1, I32)])),
    ("neg neg", F32, lambda b, x: b.emit("neg", [b.emit("neg", [x])])),
    ("not not", DType.bool, lambda b, x: b.emit("logical_not", [b.emit("logical_not", [x])])),
    ("reshape same", F32, lambda b, x: b.emit("reshape", [x], shape=SHAPE)),
    ("reshape chain", F32, lambda b, x: b.emit("reshape", [b.emit("reshape", [x], shape=(6,))], shape=SHAPE)),
    ("permute id", F32, lambda b, x: b.emit("permute", [x], perm=(0, 1))),
    ("permute chain", F32, lambda b, x: b.emit("permute", [b.emit("permute", [x], perm=(1, 0))], perm=(1, 0))),
    ("expand same", F32, lambda b, x: b.emit("expand", [x], shape=SHAPE)),
    ("cast same", F32, lambda b, x: b.emit("cast", [x], dtype=F32)),
    ("f16->f32->f16", F16, lambda b, x: b.cast(b.cast(x, F32), F16)),
    ("i32->i64->i32", I32, lambda b, x: b.cast(b.cast(x, DType.i64), I32)),
    ("bool->f16->bool", DType.bool, lambda b, x: b.cast(b.cast(x, F16), DType.bool)),
    ("slice whole", F32, lambda b, x: b.emit("slice", [x], start=(0, 0), step=(1, 1), size=SHAPE)),
    ("pad zeros", F32, lambda b, x: b.emit("pad", [x], low=(0, 0), high=(0, 0), value=5.0)),
    ("where true", F32, lambda b, x: b.emit("where", [_full(b, True, DType.bool), x, _full(b, 2.0)])),
    ("where false", F32, lambda b, x: b.emit("where", [_full(b, False, DType.bool), _full(b, 2.0), x])),
    ("where same", F32, lambda b, x: b.emit("where", [b.emit("gt", [x, _full(b, 0.0)]), x, x])),
    ("concat one", F32, lambda b, x: b.emit("concat", [x], axis=1)),
    ("nested", F32, lambda b, x: b.emit("mul", [b.emit("add", [b.emit("neg", [b.emit("neg", [x])]),
                                                                 _full(b, 0.0)]), _full(b, 1.0)])),
]

# Near misses: the rule must not fire.
NON_IDENTITIES = [
    ("x+1", F32, lambda b, x: b.emit("add", [x, _full(b, 1.0)])),
    ("0-x", F32, lambda b, x: b.emit("sub", [_full(b, 0.0), x])),
    ("x*1.0000001", F32, lambda b, x: b.emit("mul", [x, _full(b, 1.0000001)])),
    ("x*0", F32, lambda b, x: b.emit("mul", [x, _full(b, 0.0)])),
    ("x/2", F32, lambda b, x: b.emit("div", [x, _full(b, 2.0)])),
    ("1/x", F32, lambda b, x: b.emit("div", [_full(b, 1.0), x])),
    ("neg", F32, lambda b, x: b.emit("neg", [x])),
    ("not not float", F32, lambda b, x: b.emit("logical_not", [b.emit("logical_not", [x])])),
    ("transpose square", F32, lambda b, x: b.emit("permute", [b.emit("reshape", [x], shape=(1, 6))], perm=(1, 0))),
    ("f32->f16->f32", F32, lambda b, x: b.cast(b.cast(x, F16), F32)),
    ("i32->f32->i32", I32, lambda b, x: b.cast(b.cast(x, F32), I32)),
    ("f16->bf16->f16", F16, lambda b, x: b.cast(b.cast(x, DType.bf16), F16)),
    ("reversed slice", F32, lambda b, x: b.emit("slice", [x], start=(0, 2), step=(1, -1), size=SHAPE)),
    ("partial slice", F32, lambda b, x: b.slice(x, 1, 1, 2)),
    ("pad", F32, lambda b, x: b.emit("pad", [x], low=(0, 1), high=(0, 0), value=0.0)),
    ("where", F32, lambda b, x: b.emit("where", [b.emit("gt", [x, _full(b, 0.0)]), x, _full(b, 0.0)])),
    ("concat two", F32, lambda b, x: b.emit("concat", [x, x], axis=0)),
]


@pytest.mark.parametrize(("name", "dtype", "build"), IDENTITIES, ids=[c[0] for c in IDENTITIES])
def test_identity_is_removed(name, dtype, build, assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", SHAPE, dtype)
    g = b.build([build(b, x)])
    g2 = dce(simplify(g))
    assert g2.outputs == (x,), print_graph(g2)
    assert len(g2.nodes) == 1
    assert_equivalent(g, g2)


@pytest.mark.parametrize(("name", "dtype", "build"), NON_IDENTITIES, ids=[c[0] for c in NON_IDENTITIES])
def test_near_miss_is_kept(name, dtype, build, assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", SHAPE, dtype)
    g = b.build([build(b, x)])
    assert simplify(g) is g
    assert_equivalent(g, g)


def test_reshape_chain_becomes_one_reshape(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4), F32)
    b.loc = "m.py:9"
    out = b.reshape(b.reshape(b.reshape(x, (6, 4)), (24,)), (4, 6))
    g = b.build([out])
    g2 = dce(simplify(g))
    assert print_graph(g2) == (
        "graph @main(%x: f32[2,3,4]) {\n"
        '  %0 = reshape(%x) {shape=[4,6]} : f32[4,6]  loc("m.py:9")\n'
        "  return (%0)\n"
        "}")
    assert_equivalent(g, g2)


def test_permute_chain_composes(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4), F32)
    out = b.permute(b.permute(x, (1, 2, 0)), (0, 2, 1))  # [3,4,2] -> [3,2,4]
    g = b.build([out])
    g2 = dce(simplify(g))
    assert g2.op_counts() == {"input": 1, "permute": 1}
    assert g2.outputs[0].attr("perm") == (1, 0, 2)
    assert_equivalent(g, g2)


def test_simplify_keeps_shared_operands_and_other_users(assert_equivalent):
    b = GraphBuilder()
    x = b.input("x", SHAPE, F32)
    zero = b.full(0.0, SHAPE, F32)
    s = b.emit("add", [x, zero])
    g = b.build([b.unary("exp", s), b.mul(zero, x)])  # zero still used by the mul
    g2 = dce(simplify(g))
    assert print_graph(g2) == (
        "graph @main(%x: f32[2,3]) {\n"
        "  %0 = full() {value=0.0} : f32[2,3]\n"
        "  %1 = exp(%x) : f32[2,3]\n"
        "  %2 = mul(%0, %x) : f32[2,3]\n"
        "  return (%1, %2)\n"
        "}")
    assert_equivalent(g, g2)
