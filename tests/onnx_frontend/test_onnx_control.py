"""ONNX control flow (If, Loop, Scan) resolved at compile time, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import sextant
from sextant.frontend.onnx import import_onnx

from .models import make, value

ort = pytest.importorskip("onnxruntime")
TARGETS = ("reference", "cpu")
F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
RNG = np.random.default_rng(0)


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], target: str, **kw: object) -> None:
    got = sextant.compile_onnx(model, target=target, **kw)(feeds)
    for g, w in zip(got if isinstance(got, (list, tuple)) else [got], _ort(model, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _branches(out: str = "y") -> dict[str, onnx.GraphProto]:
    """Branches that read the enclosing scope's ``x``."""
    then = helper.make_graph([helper.make_node("Add", ["x", "x"], ["t"])], "then", [], [value("t", [2, 3])])
    other = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["e"])], "else", [], [value("e", [2, 3])])
    return {"then_branch": then, "else_branch": other}


@pytest.mark.parametrize("target", TARGETS)
def test_if_with_constant_condition_inlines_the_taken_branch(target: str) -> None:
    nodes = [helper.make_node("ReduceSum", ["shape_src"], ["n"], keepdims=0),
             helper.make_node("Greater", ["n", "two"], ["c"]),  # a compile-time value computed in the graph
             helper.make_node("If", ["c"], ["y"], **_branches())]
    model = make(nodes, [value("x", [2, 3])], [value("y", [2, 3])],
                 {"shape_src": np.array([1, 1], np.int64), "two": np.array(2, np.int64)})
    graph = import_onnx(model)
    assert not any(n.op == "add" for n in graph.nodes)  # the then-branch was not translated
    _check(model, {"x": RNG.standard_normal((2, 3)).astype(np.float32)}, target)


@pytest.mark.parametrize("target", TARGETS)
def test_if_on_an_input_needs_constant_inputs(target: str) -> None:
    model = make([helper.make_node("If", ["c"], ["y"], **_branches())],
                 [value("x", [2, 3]), value("c", [], B)], [value("y", [2, 3])])
    with pytest.raises(sextant.UnsupportedOpError, match=r"condition.*must be known at compile time") as info:
        import_onnx(model)
    assert info.value.needs_values == ["c"]
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    for flag in (True, False):
        _check(model, {"x": x, "c": np.array(flag)}, target, constant_inputs={"c": np.array(flag)})


def _loop_model(trips: int) -> onnx.ModelProto:
    """acc += x * i, with an If on the iteration number inside; scan output: acc after each step."""
    inner = {"then_branch": helper.make_graph([helper.make_node("Neg", ["acc_new"], ["n"])], "neg", [],
                                              [value("n", [2, 3])]),
             "else_branch": helper.make_graph([helper.make_node("Identity", ["acc_new"], ["p"])], "pos", [],
                                              [value("p", [2, 3])])}
    body = helper.make_graph([
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["x", "fi"], ["xi"]),
        helper.make_node("Add", ["acc", "xi"], ["acc_new"]),
        helper.make_node("Equal", ["i", "two"], ["is2"]),
        helper.make_node("If", ["is2"], ["acc_out"], **inner),
        helper.make_node("Identity", ["cond"], ["cond_out"]),
        helper.make_node("Identity", ["acc_out"], ["step"]),
    ], "body", [value("i", [], I64), value("cond", [], B), value("acc", [2, 3])],
        [value("cond_out", [], B), value("acc_out", [2, 3]), value("step", [2, 3])])
    nodes = [helper.make_node("Loop", ["m", "", "acc0"], ["acc_final", "steps"], body=body)]
    return make(nodes, [value("x", [2, 3]), value("acc0", [2, 3])],
                [value("acc_final", [2, 3]), value("steps", [trips, 2, 3])],
                {"m": np.array(trips, np.int64), "two": np.array(2, np.int64)})


@pytest.mark.parametrize("target", TARGETS)
def test_loop_with_carried_value_and_scan_output(target: str) -> None:
    feeds = {"x": RNG.standard_normal((2, 3)).astype(np.float32), "acc0": np.ones((2, 3), np.float32)}
    _check(_loop_model(4), feeds, target)


def test_while_loop_with_a_compile_time_condition() -> None:
    """M is 'unbounded' (as exporters write while loops); the body's condition is a constant per iteration."""
    body = helper.make_graph([
        helper.make_node("Add", ["k", "one"], ["k_out"]),
        helper.make_node("Less", ["k_out", "three"], ["cond_out"]),
        helper.make_node("Mul", ["v", "v"], ["v_out"]),
    ], "body", [value("i", [], I64), value("cond", [], B), value("k", [], I64), value("v", [3])],
        [value("cond_out", [], B), value("k_out", [], I64), value("v_out", [3])])
    nodes = [helper.make_node("Loop", ["m", "t", "k0", "v"], ["k", "w"], body=body)]
    model = make(nodes, [value("v", [3])], [value("k", [], I64), value("w", [3])],
                 {"m": np.array(2**62, np.int64), "t": np.array(True), "k0": np.array(0, np.int64),
                  "one": np.array(1, np.int64), "three": np.array(3, np.int64)})
    _check(model, {"v": np.array([1.0, 1.5, -2.0], np.float32)}, "reference")


def test_too_many_iterations_are_refused() -> None:
    with pytest.raises(sextant.UnsupportedOpError, match=r"5000 iterations.*refuses more than 4096"):
        import_onnx(_loop_model(5000))


@pytest.mark.parametrize("target", TARGETS)
def test_scan_with_axes_and_directions(target: str) -> None:
    """A running sum over axis 1 of x, read backwards; outputs stacked on axis 1, one of them prepended."""
    body = helper.make_graph([
        helper.make_node("Add", ["s", "xt"], ["s_out"]),
        helper.make_node("Mul", ["s_out", "yt"], ["o1"]),
        helper.make_node("Identity", ["s_out"], ["o2"]),
    ], "body", [value("s", [2]), value("xt", [2]), value("yt", [2])],
        [value("s_out", [2]), value("o1", [2]), value("o2", [2])])
    nodes = [helper.make_node("Scan", ["s0", "x", "y"], ["s", "o1", "o2"], body=body, num_scan_inputs=2,
                              scan_input_axes=[1, 0], scan_input_directions=[1, 0],
                              scan_output_axes=[1, -1], scan_output_directions=[0, 1])]
    model = make(nodes, [value("s0", [2]), value("x", [2, 4]), value("y", [4, 2])],
                 [value("s", [2]), value("o1", [2, 4]), value("o2", [2, 4])])
    feeds = {"s0": np.zeros(2, np.float32), "x": RNG.standard_normal((2, 4)).astype(np.float32),
             "y": RNG.standard_normal((4, 2)).astype(np.float32)}
    _check(model, feeds, target)
