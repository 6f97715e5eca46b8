"""bf16 attention on the CPU's pair dot product (``cpu_attention.uses_pair_attention``): Q, K and V
staged as bf16 (K and V in pairs), both products as ``PairDot`` micro-tiles, P rounded to bf16 for
``P·V`` as eager's CPU flash kernel does. Each case matches eager's bf16 and the f32 attention of the
same bf16 values, with the instruction where this CPU has it and lane by lane where it does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .test_cpu_pairs import BF16_TOL, compiled, pair_dots


class Sdpa(nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)


def mappings(cm) -> list[str]:
    return [k.meta.get("mapping") for k in cm.stages["program"].kernels.values()]


def check(cm, model: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    with torch.no_grad():
        out = cm(*args)
        torch.testing.assert_close(out, model(*args), **BF16_TOL)  # eager's bf16
        f32 = model(*(a.float() if a.is_floating_point() else a for a in args))
        torch.testing.assert_close(out.float(), f32, **BF16_TOL)


@pytest.mark.parametrize("how", ["host", "lane by lane"])
@pytest.mark.parametrize("shape", [
    (1, 4, 128, 64, False),   # BERT-like heads
    (1, 3, 197, 64, False),   # ViT's 197 keys: ragged key tiles
    (2, 2, 70, 32, True),     # causal, ragged rows
    (1, 2, 9, 8, False),      # narrow head: 8-lane pair dots
])
def test_bf16_attention_on_pair_dots_matches_eager(shape, how, monkeypatch):
    b, h, s, d, causal = shape
    torch.manual_seed(0)
    args = tuple(torch.randn(b, h, s, d).bfloat16() for _ in range(3))
    model = Sdpa(causal)
    cm = compiled(model, args, monkeypatch, how)
    assert mappings(cm) == ["attention-cpu-flash-pairs"] and pair_dots(cm) > 0
    check(cm, model, args)


def test_masked_bf16_attention_on_pair_dots(monkeypatch):
    """A boolean mask hiding whole key tiles from some rows (skipped) and single keys from others."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 96, 32).bfloat16() for _ in range(3))
    mask = torch.rand(96, 96) > 0.3
    mask[:40, 64:] = False
    model = Sdpa()
    cm = compiled(model, (q, k, v, mask), monkeypatch, "host")
    assert mappings(cm) == ["attention-cpu-flash-pairs"]
    check(cm, model, (q, k, v, mask))


def test_odd_heads_and_f32_keep_the_widening_path(monkeypatch):
    torch.manual_seed(0)
    odd = tuple(torch.randn(1, 2, 16, 15).bfloat16() for _ in range(3))
    cm = compiled(Sdpa(), odd, monkeypatch, "host")
    assert mappings(cm) == ["attention-cpu-flash"] and pair_dots(cm) == 0
    check(cm, Sdpa(), odd)
    f32 = tuple(torch.randn(1, 2, 16, 16) for _ in range(3))
    cm = compiled(Sdpa(), f32, monkeypatch, "host")
    assert mappings(cm) == ["attention-cpu-flash"] and pair_dots(cm) == 0
