"""Compile time scales with the model: graphs thousands of nodes deep compile under Python's
default recursion limit, and the work the passes and fusion do grows linearly with depth.

Work is counted (:class:`sextant.work.WorkCounter`: nodes visited by the fusion walks, nodes
given to each pass, kernels generated), not timed, so the assertions do not depend on the
machine. The quadratic fusion walks this replaced did ~4x the work per doubling of depth.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from sextant.codegen.llvm_cpu import compile_kernels
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node
from sextant.graph.passes import run_pipeline
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target
from sextant.work import WorkCounter


@pytest.fixture(autouse=True)
def _default_recursion_limit() -> Iterator[None]:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(old)


def _run_cpu(graph: Graph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    program = schedule(run_pipeline(graph), cpu_target())
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)
    return runner(inputs)


# -- (a) deep graphs compile and match eager ---------------------------------------------------
def _chain_step(i: int) -> tuple[Callable[[GraphBuilder, Node], Node], Callable[[torch.Tensor], torch.Tensor]]:
    """Step ``i`` of an elementwise chain, as graph IR and as eager torch."""
    if i % 2:
        return (lambda b, x: b.add(b.mul(b.unary("sin", x), 0.5), 0.25)), (lambda x: torch.sin(x) * 0.5 + 0.25)
    return (lambda b, x: b.sub(b.mul(x, 1.01), 0.01)), (lambda x: x * 1.01 - 0.01)


def test_elementwise_chain_of_3000_ops_is_one_kernel_and_matches_eager() -> None:
    b = GraphBuilder("chain")
    x = b.input("x", (4, 16), DType.f32)
    value = torch.randn(4, 16)
    expected = value
    for i in range(1200):  # 1200 steps of 2-3 ops: 3000 elementwise ops in one dependency chain
        graph_step, eager_step = _chain_step(i)
        x = graph_step(b, x)
        expected = eager_step(expected)
    graph = b.build([x])
    assert len(graph.nodes) > 3000
    (got,) = _run_cpu(graph, [value])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_residual_stack_of_400_layers_matches_eager() -> None:
    """``x = x + relu(x @ W + b) * 0.1``, 400 times: every layer is one matmul kernel with its
    epilogue, and the dependency path through the graph is thousands of nodes long."""
    torch.manual_seed(0)
    b = GraphBuilder("residual")
    x = b.input("x", (4, 16), DType.f32)
    value = torch.randn(4, 16)
    expected = value
    for i in range(400):
        w, bias = torch.randn(16, 16) * 0.1, torch.randn(16) * 0.1
        h = b.add(b.matmul(x, b.param(f"w{i}", w)), b.expand(b.reshape(b.param(f"b{i}", bias), (1, 16)), (4, 16)))
        x = b.add(x, b.mul(b.maximum(h, 0.0), 0.1))
        expected = expected + torch.relu(expected @ w + bias) * 0.1
    graph = b.build([x])
    program = schedule(run_pipeline(graph), cpu_target())
    assert len(program.launches) == 400 and len(program.kernels) == 1  # the epilogue is fused
    (got,) = _run_cpu(graph, [value])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# -- (b) work grows linearly -------------------------------------------------------------------
C, S = 8, 4  # channels, spatial size


def _block(b: GraphBuilder, x: Node, i: int) -> Node:
    """A conv with bias and SiLU, the image as tokens (reshape/permute), LayerNorm, single-head
    attention, back to an image and a residual add: the fusion patterns of a hybrid CNN."""
    gen = torch.Generator().manual_seed(i)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    y = b.emit("conv", [x, b.param(f"w{i}", weight(C, C, 3, 3))], stride=(1, 1), padding=(1, 1),
               dilation=(1, 1), groups=1)
    y = b.add(y, b.expand(b.reshape(b.param(f"cb{i}", weight(C)), (1, C, 1, 1)), y.shape))
    y = b.mul(y, b.unary("sigmoid", y))
    t = b.permute(b.reshape(y, (1, C, S * S)), (0, 2, 1))
    d = b.sub(t, b.expand(b.mean(t, [2]), t.shape))
    n = b.mul(d, b.expand(b.unary("rsqrt", b.add(b.mean(b.mul(d, d), [2]), 1e-5)), t.shape))
    q, k, v = (b.matmul(n, b.param(f"{name}{i}", weight(C, C))) for name in "qkv")
    s = b.mul(b.matmul(q, b.transpose(k, 1, 2)), C ** -0.5)
    e = b.unary("exp", b.sub(s, b.expand(b.reduce("max", s, [2]), s.shape)))
    p = b.div(e, b.expand(b.reduce("sum", e, [2]), e.shape))
    return b.add(x, b.reshape(b.permute(b.matmul(p, v), (0, 2, 1)), (1, C, S, S)))


def _blocks(n: int) -> Graph:
    b = GraphBuilder("blocks")
    x = b.input("x", (1, C, S, S), DType.f32)
    for i in range(n):
        x = _block(b, x, i)
    return b.build([x])


def _work(n: int) -> WorkCounter:
    work = WorkCounter()
    graph = run_pipeline(_blocks(n), work=work)
    program = schedule(graph, cpu_target(cores=2, vector_bytes=32), work=work)
    # 6 kernels a block (the attention is one), and every third residual sum stored as a conv operand
    # + the CPU's copy of the padded first input, + the residual stream stored about once every
    # INLINE_OPS_LIMIT blocks (read by the next block's pad copy and the next residual add, its
    # chain of adds is recomputed until it costs more than that)
    assert 6 * n <= len(program.launches) <= 7 * n + 1 + n // 12
    return work


def test_block_graph_matches_eager_reference() -> None:
    """The synthetic block is a real program: the CPU result agrees with the reference."""
    from sextant.graph.reference import run_graph

    graph = run_pipeline(_blocks(2))
    value = torch.randn(1, C, S, S)
    (got,), (expected,) = _run_cpu(graph, [value]), run_graph(graph, [value])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_work_grows_linearly_with_depth() -> None:
    works = {n: _work(n) for n in (8, 16, 32, 64)}
    kinds = set(works[64].counts)
    assert {"fusion: reaches", "fusion: reachable groups", "fusion: row compatible", "kernels: generated",
            "passes: simplify"} <= kinds
    for small, big in ((8, 16), (16, 32), (32, 64)):
        ratio = works[big].total() / works[small].total()
        assert ratio <= 2.3, f"work grew {ratio:.2f}x from {small} to {big} blocks: {works[big].counts}"
        for kind in kinds:  # every walk on its own, so one quadratic walk cannot hide in the sum
            r = works[big].counts[kind] / works[small].counts.get(kind, 1)
            assert r <= 2.3, f"{kind}: {works[small].counts.get(kind)} -> {works[big].counts[kind]} ({r:.2f}x)"
