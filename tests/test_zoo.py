"""Every model of the benchmark set (sextant/zoo.py) compiled for the CPU and checked against
eager on fresh random inputs: the bench measures speed, this makes sure what it measures is right."""

from __future__ import annotations

import pytest
import torch

import sextant
from sextant.zoo import ZOO


def _fresh(a: torch.Tensor) -> torch.Tensor:
    if a.dtype.is_floating_point:
        return torch.randn_like(a)
    return torch.randint(0, int(a.max()) + 1, a.shape, dtype=a.dtype)  # token ids stay in the vocabulary


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_matches_eager(name: str) -> None:
    model, args = ZOO[name]()
    compiled = sextant.compile(model, args, target="cpu")
    fresh = tuple(_fresh(a) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad():
        want = model(*fresh)
    got = compiled(*fresh)
    scale = want.abs().max().item()
    assert scale > 1e-3, f"{name}: the output is ~0 (max {scale:.1e}), so the comparison would check nothing"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
