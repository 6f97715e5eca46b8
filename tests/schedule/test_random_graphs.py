"""Property-based: random small graphs of elementwise, reduction and movement ops, compiled
for the CPU (fusion + indexing + LLVM), agree with the reference executor."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sextant.codegen.llvm_cpu import compile_kernels
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.passes import run_pipeline
from sextant.graph.reference import run_graph
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target

UNARY = ["exp", "tanh", "neg", "abs", "sigmoid", "sin"]
BINARY = ["add", "sub", "mul", "maximum", "minimum"]
dims = st.integers(1, 6)


def _factor(data: st.DataObject, numel: int) -> tuple[int, ...]:
    """A random shape with ``numel`` elements."""
    shape = []
    rest = numel
    for _ in range(data.draw(st.integers(0, 2))):
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = data.draw(st.sampled_from(divisors))
        shape.append(d)
        rest //= d
    shape.append(rest)
    return tuple(shape)


def _step(b: GraphBuilder, data: st.DataObject, values: list[Node]) -> Node:
    x = data.draw(st.sampled_from(values))
    kind = data.draw(st.sampled_from(["unary", "binary", "reduce", "permute", "reshape", "slice", "pad",
                                      "concat", "expand", "where", "softmax"]))
    rank = x.type.rank
    if kind == "unary":
        return b.unary(data.draw(st.sampled_from(UNARY)), x)
    if kind == "binary":
        others = [v for v in values if v.shape == x.shape or v.type.numel == 1]
        y = data.draw(st.sampled_from(others))
        if y.shape != x.shape:
            y = b.expand(b.reshape(y, (1,) * rank), x.shape)
        return b.binary(data.draw(st.sampled_from(BINARY)), x, y)
    if kind == "where":
        return b.where(b.binary("gt", x, 0.0), x, b.mul(x, 0.1))
    if kind == "reduce" and rank:
        axes = data.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        return b.reduce(data.draw(st.sampled_from(["sum", "max", "min"])), x, axes,
                        keepdim=data.draw(st.booleans()))
    if kind == "softmax" and rank:
        axis = data.draw(st.integers(0, rank - 1))
        m = b.expand(b.reduce("max", x, [axis]), x.shape)
        e = b.unary("exp", b.sub(x, m))
        return b.div(e, b.expand(b.reduce("sum", e, [axis]), x.shape))
    if kind == "permute" and rank > 1:
        return b.permute(x, data.draw(st.permutations(range(rank))))
    if kind == "reshape":
        return b.reshape(x, _factor(data, x.type.numel))
    if kind == "slice" and rank:
        d = data.draw(st.integers(0, rank - 1))
        n = x.shape[d]
        step = data.draw(st.sampled_from([1, 2, -1]))
        start = data.draw(st.integers(0, n - 1))
        size = len(range(start, n if step > 0 else -1, step))
        size = data.draw(st.integers(1, size))
        return b.slice(x, d, start, size, step)
    if kind == "pad" and rank:
        low = tuple(data.draw(st.integers(0, 2)) for _ in range(rank))
        high = tuple(data.draw(st.integers(0, 2)) for _ in range(rank))
        return b.pad(x, low, high, data.draw(st.sampled_from([0.0, -1.5])))
    if kind == "concat" and rank:
        d = data.draw(st.integers(0, rank - 1))
        return b.concat([x, b.unary("neg", x)], d)
    if kind == "expand" and rank:
        d = data.draw(st.integers(0, rank - 1))
        shape = list(x.shape)
        if shape[d] == 1:
            shape[d] = data.draw(st.integers(2, 4))
            return b.expand(x, tuple(shape))
    return b.unary("neg", x)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_graphs_cpu_matches_reference(data: st.DataObject) -> None:
    b = GraphBuilder("random")
    shape = tuple(data.draw(st.lists(dims, min_size=1, max_size=3)))
    values = [b.input("x", shape, DType.f32)]
    if data.draw(st.booleans()):
        values.append(b.input("y", shape, DType.f32))
    for _ in range(data.draw(st.integers(1, 7))):
        values.append(_step(b, data, values))
    outs = [values[-1]]
    if data.draw(st.booleans()) and len(values) > 2:
        outs.append(data.draw(st.sampled_from(values[1:-1])))
    graph = run_pipeline(b.build(outs))
    program = schedule(graph, cpu_target())
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)
    inputs = [torch.randn(n.shape) for n in graph.inputs]
    got = runner(inputs)
    expected = run_graph(graph, inputs)
    for g, e in zip(got, expected):
        assert not math.isnan(g.sum().item()) or torch.isnan(e).any()
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, equal_nan=True)
