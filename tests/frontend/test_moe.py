"""Mixture-of-experts routing ops lowered natively (sextant/frontend/lowerings/moe.py), checked against
eager on awkward inputs (ties, NaN, infinities, empty experts), their declines, and MoE models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
from sextant.graph.reference import run_graph


class Call(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor):
        return self.fn(*xs)


def _check(fn, *xs: torch.Tensor, targets=("reference", "cpu")) -> None:
    """Compiled natively (strict: no extern call) and equal to eager on these inputs, exactly."""
    model = Call(fn)
    graph = sextant.capture(model, xs, strict=True)
    assert "extern" not in graph.op_counts()
    want = fn(*xs)
    want = want if isinstance(want, tuple) else (want,)
    for got, w in zip(run_graph(graph, list(xs)), want):
        torch.testing.assert_close(got, w, equal_nan=True)
    for target in targets:
        if target == "reference":
            continue
        compiled = sextant.compile(model, xs, target=target, strict=True, cache=False)
        got = compiled(*xs)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want):
            torch.testing.assert_close(g, w, equal_nan=True)


def test_topk_largest_smallest_and_other_axes() -> None:
    x = torch.randn(5, 7, 9)
    _check(lambda x: tuple(torch.topk(x, 3, dim=-1)), x, targets=("cpu", "cuda-sim"))
    _check(lambda x: tuple(torch.topk(x, 2, dim=1, largest=False)), x)
    distinct = torch.randperm(5 * 7 * 9).reshape(5, 7, 9).to(torch.int32)  # torch leaves the order of ties open
    _check(lambda x: tuple(torch.topk(x * 3, 4, dim=0)), distinct)


def test_topk_with_infinities_and_nan() -> None:
    x = torch.tensor([[1.0, -float("inf"), 3.0, float("inf"), float("nan"), 0.5],
                      [2.0, 1.0, -float("inf"), 0.0, -1.0, float("inf")]])  # no ties: torch leaves their order open
    _check(lambda x: tuple(torch.topk(x, 5)), x)
    _check(lambda x: tuple(torch.topk(x, 4, largest=False)), x)


def test_stable_sort_with_ties_nan_and_descending() -> None:
    ids = torch.randint(0, 4, (3, 33))
    _check(lambda x: tuple(torch.sort(x, stable=True)), ids, targets=("cpu", "cuda-sim"))
    _check(lambda x: tuple(torch.sort(x, dim=0, descending=True, stable=True)), ids)
    x = torch.randn(4, 10)
    x[0, 3] = x[2, 5] = float("nan")
    x[1, 1] = x[1, 2]
    _check(lambda x: tuple(torch.sort(x, stable=True)), x)
    _check(lambda x: tuple(torch.sort(x, descending=True, stable=True)), x)
    _check(lambda x: torch.argsort(x, dim=-1, stable=True), torch.randn(3, 17))


def test_unstable_sort_values_match() -> None:
    """torch.sort(stable=False) leaves the order of ties open: the values are the same, the indices valid."""
    ids = torch.randint(0, 3, (40,))
    values, index = sextant.compile(Call(lambda x: tuple(torch.sort(x))), (ids,), target="cpu", cache=False)(ids)
    torch.testing.assert_close(values, torch.sort(ids).values)
    torch.testing.assert_close(ids[index], values)


def test_histc_edges_and_values_outside_the_range() -> None:
    ids = torch.randint(0, 8, (64,)).float()
    _check(lambda x: torch.histc(x, bins=8, min=0, max=7), ids, targets=("cpu", "cuda-sim"))
    x = torch.tensor([-1.0, 0.0, 0.1, 0.5, 0.9999, 1.0, 1.5, float("nan"), 0.25, 0.75])
    _check(lambda x: torch.histc(x, bins=4, min=0, max=1), x)


def test_grouped_mm_with_empty_experts_and_sentinel_rows() -> None:
    pytest.importorskip("transformers")
    from transformers.integrations import moe  # noqa: F401 - registers transformers::grouped_mm_fallback

    x, w = torch.randn(10, 6), torch.randn(4, 6, 5)
    offs = torch.tensor([3, 3, 7, 9], dtype=torch.int32)  # expert 1 empty; row 9 past the last expert: 0
    fn = lambda x, w, offs: torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    want = fn(x, w, offs)
    assert want[9].abs().max() == 0
    model = Call(fn)
    graph = sextant.capture(model, (x, w, offs), strict=True)
    assert "extern" not in graph.op_counts()
    for target in ("cpu", "cuda-sim"):
        compiled = sextant.compile(model, (x, w, offs), target=target, strict=True, cache=False)
        torch.testing.assert_close(compiled(x, w, offs), want, rtol=1e-5, atol=1e-5)
        other = torch.tensor([0, 5, 5, 10], dtype=torch.int32)  # the offsets are data, read per call
        torch.testing.assert_close(compiled(x, w, other), fn(x, w, other), rtol=1e-5, atol=1e-5)


def test_past_the_native_sizes_the_op_runs_as_an_extern_call() -> None:
    fn = lambda x: tuple(torch.topk(x, 20, dim=-1))
    x = torch.randn(3, 40)
    graph = sextant.capture(Call(fn), (x,))
    assert {n.attr("fn") for n in graph.nodes if n.op == "extern"} == {"aten.topk.default"}
    for got, want in zip(sextant.compile(Call(fn), (x,), target="cpu", cache=False)(x), fn(x)):
        torch.testing.assert_close(got, want)
    with pytest.raises(sextant.UnsupportedOpError, match=r"aten.topk.default(.|\n)*k=20"):
        sextant.capture(Call(fn), (x,), strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen-moe"])
@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_moe_models_compile_natively_and_match_eager(name: str, target: str) -> None:
    from sextant.zoo import ZOO

    model, (ids,) = ZOO[name]()
    compiled = sextant.compile(model, (ids,), target=target, strict=True, cache=False)  # no extern call
    for _ in range(2):
        fresh = torch.randint(0, 1000, ids.shape)
        with torch.no_grad():
            want = model(fresh)
        torch.testing.assert_close(compiled(fresh), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
