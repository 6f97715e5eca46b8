"""The CPU GEMM's K blocking (``cpu_gemm.gemm_kernel`` with ``k_block``): from K = 1024 the
kernel keeps a strip's partial sums in a local buffer between K blocks; ragged M, N and K,
batches and a fused epilogue still match eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
import sextant.schedule.kernels as kernels


class Bmm(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n) / k**0.5)
        self.b = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w + self.b)


@pytest.mark.parametrize("shape", [(2, 37, 1100, 70), (1, 129, 3072, 64), (3, 8, 1024, 1024)])
def test_k_blocked_matmul_matches_eager(shape: tuple[int, int, int, int]) -> None:
    batch, m, k, n = shape
    torch.manual_seed(0)
    model, x = Bmm(k, n), torch.randn(batch, m, k)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    (mm,) = [kk for kk in cm.stages["program"].kernels.values() if kk.name.startswith("matmul")]
    assert any(b.name == "part" for b in mm.local)  # the partial sums between K blocks
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)


def test_short_k_is_not_blocked() -> None:
    model, x = Bmm(768, 64), torch.randn(16, 768)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    assert kernels.MATMUL_BLOCKED_K_FROM > 768
    assert not any(b.name == "part" for kk in cm.stages["program"].kernels.values() for b in kk.local)
