"""Scaled dot-product attention stays one op through export and lowers to a clean graph that matches eager."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
from sextant.examples import gpt2
from sextant.frontend import capture as capture_mod

B, H, L, S, E = 2, 4, 8, 6, 16


class Attention(nn.Module):
    """F.scaled_dot_product_attention with fixed keyword options; the mask (if any) is an input."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, *mask, **self.options)  # the SDPA line


def _bool_mask(shape: tuple[int, ...]) -> torch.Tensor:
    m = torch.rand(shape) > 0.4
    m[..., 0] = True  # every row sees at least one key (fully hidden rows: see test_fully_masked_row)
    return m


CASES: dict[str, tuple[dict[str, Any], int, int, Any]] = {
    # name: (sdpa options, key heads, key length, mask factory(dtype) or None)
    "plain": ({}, H, S, None),
    "self": ({}, H, L, None),
    "causal": ({"is_causal": True}, H, L, None),
    "causal-longer-keys": ({"is_causal": True}, H, S + 5, None),
    "scale": ({"scale": 0.3}, H, S, None),
    "bool-mask": ({}, H, S, lambda dt: _bool_mask((B, 1, L, S))),
    "bool-mask-2d": ({"scale": 1.0}, H, S, lambda dt: _bool_mask((L, S))),
    "float-mask": ({}, H, S, lambda dt: torch.randn(B, H, L, S).to(dt)),
    "gqa": ({"enable_gqa": True, "is_causal": True}, 2, L, None),
}
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def _inputs(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    _, hk, s, mask = CASES[case]
    qkv = (torch.randn(B, H, L, E, dtype=dtype), torch.randn(B, hk, s, E, dtype=dtype),
           torch.randn(B, hk, s, E, dtype=dtype))
    return qkv + ((mask(dtype),) if mask else ())


@pytest.mark.parametrize("target", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_matches_eager(case: str, dtype: torch.dtype, target: str) -> None:
    torch.manual_seed(0)
    model = Attention(**CASES[case][0])
    compiled = sextant.compile(model, _inputs(case, dtype), target=target)
    for _ in range(2):
        fresh = _inputs(case, dtype)
        torch.testing.assert_close(compiled(*fresh), model(*fresh), **TOL[dtype])


def test_sdpa_is_kept_whole_and_lowers_cleanly() -> None:
    """One SDPA node in the export; two matmuls and one exp in the graph, all at the user's line."""
    args = _inputs("bool-mask", torch.float32)
    ep = capture_mod.export(Attention(), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.aten.scaled_dot_product_attention.default]
    graph = sextant.capture(Attention(), args)
    ops = [n.op for n in graph.nodes]
    assert ops.count("matmul") == 2 and ops.count("exp") == 1
    computed = [n for n in graph.nodes if n.op not in ("input", "param")]
    assert {n.loc for n in computed} == {f"test_sdpa.py:{_sdpa_line()}"}


def _sdpa_line() -> int:
    import inspect

    lines, start = inspect.getsourcelines(Attention.forward)
    return start + next(i for i, text in enumerate(lines) if "the SDPA line" in text)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_fully_masked_row(mask_kind: str) -> None:
    """A query that sees no key gives 0, as eager does (a plain softmax would give NaN)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    keep = _bool_mask((3, 5))
    keep[1] = False
    mask = keep if mask_kind == "bool" else torch.zeros(3, 5).masked_fill(~keep, -math.inf)
    model = Attention()
    expected = model(q, k, v, mask)
    assert (expected[:, :, 1] == 0).all()
    for target in ("reference", "cpu"):
        torch.testing.assert_close(sextant.compile(model, (q, k, v, mask), target=target)(q, k, v, mask),
                                   expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_gpt2_sdpa_matches_eager(target: str) -> None:
    """transformers' default attention (SDPA) used to fail inside torch's own decomposition."""
    model, args = gpt2(attn="sdpa")
    compiled = sextant.compile(model, args, target=target)
    for _ in range(2):
        fresh = (torch.randint(0, 1000, args[0].shape),)
        with torch.no_grad():
            expected = model(*fresh)
        torch.testing.assert_close(compiled(*fresh), expected, rtol=1e-4, atol=1e-4)


def test_dropout_is_reported() -> None:
    """dropout_p survives export even in eval mode (F.sdpa ignores .training): a clear error, not RNG."""
    model = Attention(dropout_p=0.1).eval()
    with pytest.raises(sextant.UnsupportedOpError) as info:
        sextant.capture(model, _inputs("plain", torch.float32))
    msg = str(info.value)
    assert "aten.scaled_dot_product_attention.default" in msg
    assert "dropout_p=0.1" in msg
    assert f"test_sdpa.py:{_sdpa_line()}" in msg


def test_decomposition_failure_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any other failure inside torch's decompositions is still an ExportError with the cause chained."""
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a decomposition that cannot run")

    table = capture_mod.decomposition_table()
    table[torch.ops.aten.relu.default] = broken
    monkeypatch.setattr(capture_mod, "decomposition_table", lambda: table)
    with pytest.raises(sextant.ExportError, match="Core ATen decomposition failed: ValueError") as info:
        sextant.capture(nn.ReLU(), (torch.randn(4),))
    assert isinstance(info.value.__cause__, ValueError)


class Variants(nn.Module):
    """The backend-specific SDPA overloads, called directly: also kept whole and lowered by the same code."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
        out2, probs = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, scale=0.5)
        return out, lse, out2, probs


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_sdpa_variants(target: str) -> None:
    torch.manual_seed(0)
    args = _inputs("float-mask", torch.float32)
    ep = capture_mod.export(Variants(), args)
    assert {n.target for n in ep.graph.nodes if n.op == "call_function" and "attention" in str(n.target)} == {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_attention_math.default}
    compiled = sextant.compile(Variants(), args, target=target)
    fresh = _inputs("float-mask", torch.float32)
    torch.testing.assert_close(compiled(*fresh), Variants()(*fresh), rtol=1e-4, atol=1e-5)
