"""The optimizer step under ``torch.compile(opt.step, backend="sextant")``: parameters and optimizer
state (momentum buffers, Adam's moments) are module state the graph updates — torch.export's
PARAMETER_MUTATION and BUFFER_MUTATION outputs — written back into the live tensors."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import sextant
import sextant.frontend.dynamo as dyn

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_updates_parameters_and_state_like_eager(name: str) -> None:
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    params = [p for p in model.parameters()]
    dyn.STATS.reset()
    step = torch.compile(opt.step, backend="sextant", options={"fallback": False})
    for _ in range(3):
        x = torch.randn(5, 8)
        for m in (model, ref):
            m(x).square().mean().backward()
        step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(p is q for p, q in zip(params, model.parameters()))  # updated in place, not replaced
    for p, q in zip(model.parameters(), ref.parameters()):  # the optimizer's state too
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=1e-6)
    records = dyn.STATS.graphs
    assert records and all(r.target == "cpu" and not r.externs for r in records), records


class _Accumulate(nn.Module):
    """A forward that updates a parameter in place (outside autograd), as an EMA of weights does."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w.mul_(0.5).add_(x)
        return self.w.sum(0)


def test_a_parameter_updated_in_forward_is_written_back() -> None:
    model, ref = _Accumulate(), _Accumulate()
    compiled = sextant.compile(model, (torch.randn(4, 3),))
    assert [m.kind for m in compiled.graph.mutations] == ["buffer"]
    for _ in range(2):
        x = torch.randn(4, 3)
        torch.testing.assert_close(compiled(x), ref(x))
        torch.testing.assert_close(model.w, ref.w)
