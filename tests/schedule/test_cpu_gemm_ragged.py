"""A strip cut by the matrix edge (N not a whole number of ``nr`` columns, B computed per call so
not padded at compile time) runs the vector micro-kernel from a zero-padded copy of its columns
(``cpu_gemm._pad_strip``) and stores only the columns that exist: unblocked and K-blocked, with a
ragged M and a fused epilogue, against eager (batches: ``test_cpu_matmul_tiles``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
from sextant.kernel.printer import print_kernel


class WeightTimesInput(nn.Module):
    """``W @ x + b``: the weight is A, the input B (a 1×1 convolution's orientation)."""

    def __init__(self, m: int, k: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(m, k) / k**0.5)
        self.b = nn.Parameter(torch.randn(m, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.w @ x + self.b)


@pytest.mark.parametrize(("batch", "m", "k", "n"), [
    ((), 70, 64, 196),  # ResNet's 14×14 positions: 12 whole strips and 4 columns
    ((), 37, 40, 21),  # one whole strip and 5 columns
    ((), 13, 1100, 49),  # K blocked: the copy is read by every K block
])
def test_ragged_strip_matches_eager(batch: tuple[int, ...], m: int, k: int, n: int) -> None:
    torch.manual_seed(m + k + n)
    model, x = WeightTimesInput(m, k), torch.randn(*batch, k, n)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    (mm,) = [kk for kk in cm.stages["program"].kernels.values() if kk.name.startswith("matmul")]
    assert any(b.name == "blast" for b in mm.local), print_kernel(mm)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)


def test_whole_strips_need_no_copy() -> None:
    model, x = WeightTimesInput(24, 16), torch.randn(16, 64)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    assert not any(b.name == "blast" for kk in cm.stages["program"].kernels.values() for b in kk.local)
