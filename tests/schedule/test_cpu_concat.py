"""An outer-dim concat on the CPU picks its part once per row (kernels.py ``_concat_row``):
every part's value is computed only for its own rows, and the result matches eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
from sextant.kernel.ir import For, If, Kernel


class Cat(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        up = nn.functional.interpolate(c, scale_factor=2, mode="bilinear", align_corners=False)
        return torch.cat([torch.relu(a) * 2, torch.sigmoid(b), up], dim=self.dim)


def _ifs(kernel: Kernel) -> int:
    count, stack = 0, list(kernel.body)
    while stack:
        s = stack.pop()
        if isinstance(s, If):
            count += 1
            stack += [*s.then, *s.orelse]
        elif isinstance(s, For):
            stack += s.body
    return count


@pytest.mark.parametrize("dim, shapes", [
    (1, [(2, 3, 8, 6), (2, 5, 8, 6), (2, 4, 4, 3)]),  # channels, as SegFormer's head
    (0, [(1, 2, 8, 6), (2, 2, 8, 6), (1, 2, 4, 3)]),  # batch
    (2, [(2, 3, 2, 6), (2, 3, 6, 6), (2, 3, 4, 3)]),  # rows
])
def test_outer_concat_branches_per_row(dim, shapes):
    xs = tuple(torch.randn(s) for s in shapes)
    compiled = sextant.compile(Cat(dim), xs, target="cpu")
    fresh = tuple(torch.randn_like(x) for x in xs)
    torch.testing.assert_close(compiled(*fresh), Cat(dim)(*fresh), rtol=1e-5, atol=1e-6)
    program = compiled.stages["program"]
    (kernel,) = [program.kernels[lch.kernel] for lch in program.launches
                 if program.groups[lch.group].outputs[0].op == "concat"]
    assert _ifs(kernel) == 2, "three parts: an if / else-if / else chain per row"


def test_last_dim_concat_keeps_the_elementwise_form():
    a, b = torch.randn(2, 4, 3), torch.randn(2, 4, 5)

    class LastCat(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([a.exp(), b], dim=-1)

    compiled = sextant.compile(LastCat(), (a, b), target="cpu")
    torch.testing.assert_close(compiled(a, b), LastCat()(a, b))
    program = compiled.stages["program"]
    assert all(_ifs(k) == 0 for k in program.kernels.values())
