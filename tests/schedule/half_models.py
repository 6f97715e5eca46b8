"""Small models shared by the half-precision GPU mapping tests (tensor-core GEMM, split-K)."""

from __future__ import annotations

import copy

import torch
from torch import nn

TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}  # against the f32 model on the same half inputs


class MLP(nn.Module):
    """``down(gelu(up(x))) + x``: two Linear layers with bias, GELU and the residual in their epilogues."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x))) + x


def eager_f32(model: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """The model in f32 on the half inputs (what f32 accumulation should approach)."""
    with torch.no_grad():
        return copy.deepcopy(model).float()(*(a.float() if a.is_floating_point() else a for a in args))
