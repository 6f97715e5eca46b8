"""Shared fixtures for graph-pass tests: random inputs and an equivalence check via the reference executor."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from sextant.graph.ir import Graph
from sextant.graph.ops import TensorType
from sextant.graph.reference import run_graph
from sextant.graph.verifier import verify


def random_tensor(t: TensorType, gen: torch.Generator) -> torch.Tensor:
    if t.dtype.is_float:
        return torch.randn(t.shape, generator=gen).to(t.dtype.torch)
    if t.dtype.is_int:
        return torch.randint(-5, 6, t.shape, generator=gen).to(t.dtype.torch)
    return torch.rand(t.shape, generator=gen) < 0.5


@pytest.fixture
def assert_equivalent() -> Callable[..., None]:
    """``check(before, after)``: ``after`` verifies and computes what ``before`` does on fresh random inputs."""

    def check(before: Graph, after: Graph, *, seed: int = 0, trials: int = 3) -> None:
        verify(after)
        assert [n.type for n in after.inputs] == [n.type for n in before.inputs]
        gen = torch.Generator().manual_seed(seed)
        for _ in range(trials):
            ins = [random_tensor(n.type, gen) for n in before.inputs]
            expected, got = run_graph(before, ins), run_graph(after, ins)
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, equal_nan=True)

    return check
