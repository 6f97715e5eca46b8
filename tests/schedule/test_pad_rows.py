"""A kernel whose output is a constant ``pad`` (a convolution's explicitly padded input) fills and
copies each row range by range (``kernels._pad_row``): the padding value on a row the outer
indices put in the padding, else the value before and after the source row and a plain copy —
no select per element. Bit-exact against eager, f32 and bf16, padding on every kind of dim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
from sextant.codegen.simt import iter_expr, stmt_exprs
from sextant.kernel.ir import Select, iter_stmts


class Padded(nn.Module):
    def __init__(self, pads: tuple[int, ...], value: float = 0.0) -> None:
        super().__init__()
        self.pads, self.value = pads, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(torch.clamp(x, 0, 6) * 2 + 1, self.pads, value=self.value)


def selects(stmts) -> int:
    """How many ``Select`` expressions the statements (nested bodies included) evaluate."""
    return sum(isinstance(x, Select) for s in iter_stmts(stmts) for ex in stmt_exprs(s) for x in iter_expr(ex))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, pads, value", [
    ((1, 3, 5, 7), (1, 2, 3, 0), 0.0),           # rows and columns, uneven
    ((2, 4, 6, 6), (1, 1, 1, 1, 2, 0), -1.5),    # channels too, a non-zero value
    ((9,), (3, 4), 2.0),                          # one dim: the row is everything
    ((2, 3, 4), (0, 0, 2, 2), 0.0),               # only an outer dim
    ((1, 2, 3, 4), (0, 0, 0, 0, 0, 0, 1, 1), 0.5),  # only the batch dim
])
def test_padded_rows_match_eager(shape, pads, value, dtype):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype)
    model = Padded(pads, value)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    for t in (x, torch.randn_like(x)):
        torch.testing.assert_close(cm(t), model(t), atol=0, rtol=0)


def test_padded_rows_copy_without_selects():
    """The clamp's max/min stay, but no select chooses between padding and a clamped read."""
    x = torch.randn(1, 8, 12, 12)
    cm = sextant.compile(Padded((1, 1, 1, 1)), (x,), target="cpu", cache=False)
    (kernel,) = cm.stages["program"].kernels.values()
    assert selects(kernel.body) == 0
