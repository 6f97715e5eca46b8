"""Random ops compiled natively: dropout, ``rand``/``randn``/``bernoulli`` (``frontend/lowerings/random.py``).

sextant draws Philox numbers keyed by a seed each call takes from torch's generator, so its
numbers are not eager torch's: these tests check what must hold regardless — the keep rate and
scaling of dropout, the moments of ``rand`` and ``randn``, reproducibility under
``torch.manual_seed``, the same numbers on every target, and a backward pass that uses the
forward's mask — never bitwise equality with eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
import sextant.frontend.dynamo as dyn

TARGETS = ["cpu", "cuda-sim"]


class DropoutMLP(nn.Module):
    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(64, 256), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.fc(x))
        return self.drop(h), h


class Draws(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.rand_like(x), torch.randn(x.shape), torch.bernoulli(torch.full_like(x, 0.25)), \
            torch.rand(x.shape, dtype=torch.float16)


def _programs_externs(compiled) -> list[str]:
    program = compiled.stages.get("program")
    return [launch.extern.fn for launch in program.launches if launch.extern] if program is not None else []


@pytest.mark.parametrize("target", TARGETS)
def test_dropout_keeps_and_scales_like_torch(target: str) -> None:
    torch.manual_seed(0)
    m = DropoutMLP(0.3).train()
    x = torch.randn(64, 64)
    compiled = sextant.compile(m, (x,), target=target)
    assert "random" in compiled.stages["captured"].op_counts() and not _programs_externs(compiled)
    out, h = compiled(x)
    kept = out != 0
    live = h != 0
    rate = float(kept[live].float().mean())
    assert abs(rate - 0.7) < 0.02, f"keep rate {rate}, expected 0.7"
    torch.testing.assert_close(out[kept], h[kept] / 0.7)
    torch.testing.assert_close(h, F.relu(m.fc(x)), rtol=1e-4, atol=1e-5)


def test_manual_seed_reproduces_and_targets_agree() -> None:
    m = DropoutMLP(0.5).train()
    x = torch.randn(8, 64)
    outs = {}
    for target in ["reference", *TARGETS]:
        compiled = sextant.compile(m, (x,), target=target)
        torch.manual_seed(123)
        first = compiled(x)[0]
        second = compiled(x)[0]
        torch.manual_seed(123)
        again = compiled(x)[0]
        assert torch.equal(first, again), f"{target}: torch.manual_seed must reproduce the numbers"
        assert not torch.equal(first, second), f"{target}: each call must draw new numbers"
        outs[target] = first
    for target in TARGETS:  # the same Philox stream everywhere: the same mask, fp32 rounding aside
        assert torch.equal(outs[target] != 0, outs["reference"] != 0), target
        torch.testing.assert_close(outs[target], outs["reference"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_rand_randn_bernoulli_moments(target: str) -> None:
    x = torch.zeros(256, 128)
    u, n, b, h = sextant.compile(Draws(), (x,), target=target)(x)
    assert float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.005
    assert abs(float(n.mean())) < 0.02 and abs(float(n.std()) - 1) < 0.02
    assert set(b.unique().tolist()) <= {0.0, 1.0} and abs(float(b.mean()) - 0.25) < 0.01
    assert h.dtype == torch.float16 and float(h.max()) < 1 and abs(float(h.float().mean()) - 0.5) < 0.01
    assert not torch.equal(u, h.float()), "each op draws its own stream"


@pytest.mark.parametrize("target", TARGETS)
def test_training_backward_uses_the_forward_mask(target: str) -> None:
    torch._dynamo.reset()
    dyn.STATS.reset()
    p = 0.4

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * 2.0, p, training=True)

    step = torch.compile(f, backend="sextant", options={"target": target, "fallback": False})
    x = (torch.rand(32, 48) + 0.5).requires_grad_()
    out = step(x)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    mask = out.detach() != 0
    assert abs(float(mask.float().mean()) - (1 - p)) < 0.05
    torch.testing.assert_close(x.grad, upstream * mask * (2.0 / (1 - p)))
    records = {r.role: r for r in dyn.STATS.graphs}
    assert set(records) == {"forward", "backward"} and not any(r.externs for r in records.values())
    torch._dynamo.reset()


def test_eval_mode_dropout_is_the_identity() -> None:
    m = DropoutMLP(0.3).eval()
    x = torch.randn(4, 64)
    compiled = sextant.compile(m, (x,))
    assert compiled.graph.seed is None
    out, h = compiled(x)
    torch.testing.assert_close(out, h)
