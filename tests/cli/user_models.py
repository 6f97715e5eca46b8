"""Factories for the CLI tests, loaded as FILE.py:FACTORY the way a user's file would be."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * scale


class Sorts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(x, dim=-1).values + 1  # no lowering in sextant: an extern call, or --strict: refused


def tiny():
    torch.manual_seed(0)
    return Tiny().eval(), (torch.randn(4, 16),), {"scale": torch.randn(8)}


def sorts():
    return Sorts(), (torch.randn(4, 8),)


def returns_module_only():
    return Tiny()


def returns_wrong_types():
    return "model", (torch.randn(4, 16),)


def raises():
    raise RuntimeError("weights file missing")


NOT_CALLABLE = 3


class Drifts(nn.Module):
    """Computes something else in eager mode than when torch.export traces it: `run` must catch that."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (0.0 if torch.compiler.is_exporting() else 1.0)


def drifts():
    return Drifts(), (torch.randn(4, 8),)


def half_mlp():
    """An f16 MLP block whose two matmuls run on tensor cores (on cuda-sim, sm_80+)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).half()
    return model, (torch.randn(128, 64).half(),)
