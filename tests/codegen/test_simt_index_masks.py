"""cuda-sim: an index ``(tid & mask) + row * width`` with a row of known range (a table row picked by a
position, broadcast over the threads — RoPE's ``cos[pos]``) must not load the next row for lanes past
the mask. LLVM 22's loop vectoriser did so on the thread loop (``llvm_cpu._KernelLowering._op``)."""

from __future__ import annotations

import pytest
import torch

import sextant


class RowTimes(torch.nn.Module):
    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(64, width).to(dtype))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x * self.table[pos]


@pytest.mark.parametrize("width,dtype", [(8, torch.float32), (16, torch.float32), (16, torch.float16),
                                         (8, torch.bfloat16)])
def test_table_row_broadcast_over_threads(width, dtype):
    torch.manual_seed(0)
    model = RowTimes(width, dtype)
    x, pos = torch.randn(4, width).to(dtype), torch.tensor([5])
    compiled = sextant.compile(model, (x, pos), target="cuda-sim", cache=False)
    for p in (5, 0, 63):
        x = torch.randn(4, width).to(dtype)
        torch.testing.assert_close(compiled(x, torch.tensor([p])), model(x, torch.tensor([p])))
