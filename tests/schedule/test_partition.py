"""Fusion is asserted, not hoped for: kernel counts for the patterns the scheduler must fuse."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
from sextant.examples import EXAMPLES
from sextant.graph.passes import run_pipeline
from sextant.schedule import memory
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target


def _program(model: nn.Module, *args: torch.Tensor):
    return schedule(run_pipeline(sextant.capture(model.eval(), args)), cpu_target())


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 0.5, dim=-1)


class LinearGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


@pytest.mark.parametrize(
    ("model", "shape", "kinds"),
    [
        (nn.LayerNorm(64), (4, 10, 64), ["reduce"]),
        (RMSNorm(64), (4, 10, 64), ["reduce"]),
        (Softmax(), (3, 7, 33), ["reduce"]),
        (LinearGelu(), (5, 32), ["matmul"]),
        (nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)), (4, 32), ["matmul", "matmul"]),
        # the CPU copies the zero-padded input once (cpu_conv.explicit_padding); BN and ReLU fuse into the conv
        (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()), (1, 3, 12, 12),
         ["elementwise", "conv"]),
    ],
)
def test_fusion_kernel_counts(model: nn.Module, shape, kinds) -> None:
    p = _program(model, torch.randn(shape))
    assert [p.groups[launch.group].kind for launch in p.launches] == kinds, p.describe()


def test_layernorm_is_one_kernel_and_keeps_statistics_in_registers() -> None:
    p = _program(nn.LayerNorm(64), torch.randn(4, 64))
    (g,) = p.groups
    assert [o.type.shape for o in g.outputs] == [(4, 64)]  # mean/rstd are not stored
    assert sum(m.op == "reduce" for m in g.members) == 2


def test_transformer_block_kernels() -> None:
    model, args = EXAMPLES["transformer-block"]()
    p = _program(model, *args)
    kinds = [p.groups[launch.group].kind for launch in p.launches]
    # LN1, qkv, attention (q@k^T, scale, mask, softmax, all-masked-row fixup, @v), proj (+residual),
    # LN2, fc1 (+GELU), fc2 (+residual)
    assert kinds == ["reduce", "matmul", "attention", "matmul", "reduce", "matmul", "matmul"]


def test_gpt2_kernel_count_is_pinned() -> None:
    """2-layer GPT-2: per layer 7 kernels (LN, qkv, fused attention, out-proj + residual, LN,
    fc + GELU(tanh), proj + residual), then the final LN and the LM head (the token/position
    embedding gathers are fused into the first LN)."""
    model, args = EXAMPLES["gpt2"]()
    p = _program(model, *args)
    assert len(p.launches) == 2 * 7 + 2, p.describe()


def test_identical_layers_compile_once() -> None:
    layers = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)]
    p = _program(nn.Sequential(*layers), torch.randn(8, 32))
    assert len(p.launches) == 4
    assert len(p.kernels) == 1


def test_memory_plan_reuses_buffers() -> None:
    layers = [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]
    p = _program(nn.Sequential(*layers), torch.randn(16, 64))
    temps = [b for b in p.buffers if b.kind == "temp"]
    assert len(temps) == 5
    assert p.arena_bytes <= 2 * 16 * 64 * 4  # ping-pong between two buffers


def test_memory_plan_respects_lifetimes() -> None:
    ivs = [memory.Interval(0, 100, 0, 2), memory.Interval(1, 100, 1, 3), memory.Interval(2, 100, 3, 4)]
    offsets, size = memory.plan(ivs)
    assert offsets[0] != offsets[1]  # both live at launch 1-2
    assert offsets[2] != offsets[1]  # both live at launch 3
    assert offsets[2] == offsets[0]  # 0 is dead by launch 3: reused
    assert size == 2 * 128


def test_schedule_dump_names_kernels_and_sources() -> None:
    model, args = EXAMPLES["transformer-block"]()
    text = _program(model, *args).describe()
    assert "reduce" in text and "matmul" in text and "examples.py:" in text
    assert "planned peak" in text


class SoftmaxOfReducedSoftmax(nn.Module):
    """The second softmax reduces the first one's output, which is also returned; the first one's
    division reads two reduction domains (the row sums, and its own max and sum)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.softmax(x.sum(1), dim=0)
        return torch.softmax(s, dim=0), s


@pytest.mark.parametrize("shape", [(1, 1), (6, 5)])
def test_stored_value_read_back_by_its_reduction_is_not_a_cycle(shape: tuple[int, int]) -> None:
    """Regression (found by test_random_graphs): the stored first softmax became a kernel of its
    own that read the reduction group and was read by it — "fused groups depend on each other in
    a cycle". The group now computes and stores it."""
    model = SoftmaxOfReducedSoftmax()
    program = _program(model, torch.randn(shape))
    assert any(m.op == "div" for g in program.groups if g.kind == "reduce" for m in g.outputs)
    x = torch.randn(shape)
    got = sextant.compile(model, (x,), target="cpu", cache=False)(x)
    for g, e in zip(got, model(x)):
        torch.testing.assert_close(g, e)
