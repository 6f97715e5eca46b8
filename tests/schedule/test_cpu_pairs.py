"""bf16 GEMMs on the CPU's pair dot product (``schedule/cpu_pairs.py``): weights laid out in
pairs of K at compile time, ``PairDot`` micro-kernels; ragged and odd sizes, batches and fused
epilogues match eager's bf16 and the f32 product of the same bf16 values — with the instruction
where this CPU has it and lane by lane where it does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
import sextant.schedule.target as target_mod
from sextant.codegen import cpu_matrix
from sextant.host import host_pair_dot
from sextant.kernel.ir import PairDot, iter_stmts

BF16_TOL = dict(rtol=2e-2, atol=2e-2)


class Mlp(nn.Module):
    def __init__(self, k: int, hidden: int, n: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(k, hidden), nn.Linear(hidden, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class BatchedWeight(nn.Module):
    """``x @ W`` with a weight per batch element (a param, not a Linear's transposed one)."""

    def __init__(self, b: int, k: int, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(b, k, n) / k**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)


def pair_dots(cm) -> int:
    return sum(isinstance(s, PairDot) for k in cm.stages["program"].kernels.values() for s in iter_stmts(k.body))


def compiled(model: nn.Module, x: torch.Tensor | tuple[torch.Tensor, ...], monkeypatch, how: str):
    """``model`` compiled for ``x`` (one input or a tuple) on a CPU with the pair dot (``how``:
    "host" — this CPU's code, the instruction where it has it; "lane by lane" — as a CPU without it
    compiles the same kernels)."""
    monkeypatch.setattr(target_mod, "host_pair_dot", lambda: True)
    if how == "lane by lane":
        monkeypatch.setattr(cpu_matrix, "host_pair_dot", lambda: False)
        monkeypatch.setenv("SEXTANT_CACHE", "0")
        monkeypatch.setenv("SEXTANT_COMPILE_JOBS", "1")
    return sextant.compile(model, x if isinstance(x, tuple) else (x,), target="cpu", cache=False)


def check(cm, model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        out = cm(x)
        torch.testing.assert_close(out, model(x), **BF16_TOL)  # eager's bf16 (oneDNN)
        f32 = model.float()(x.float())  # the same bf16 weights, f32 arithmetic
        model.bfloat16()
        torch.testing.assert_close(out.float(), f32, **BF16_TOL)


@pytest.mark.parametrize("how", ["host", "lane by lane"])
@pytest.mark.parametrize("shape", [(37, 64, 96, 48), (8, 33, 70, 5), (130, 768, 200, 3)])
def test_bf16_mlp_on_pair_dots_matches_eager(shape, how, monkeypatch):
    m, k, hidden, n = shape  # odd K (33), N below a strip (5, 3), ragged M and N
    torch.manual_seed(0)
    model, x = Mlp(k, hidden, n).bfloat16().eval(), torch.randn(m, k).bfloat16()
    cm = compiled(model, x, monkeypatch, how)
    assert pair_dots(cm) > 0
    check(cm, model, x)


def test_k_blocked_pair_dot_gemm(monkeypatch):
    """K = 1100: blocks of K in pairs, partial sums kept between them, the last pair half past K."""
    torch.manual_seed(0)
    model, x = Mlp(1101, 64, 40).bfloat16().eval(), torch.randn(2, 19, 1101).bfloat16()
    cm = compiled(model, x, monkeypatch, "host")
    assert any(b.name == "part" for k in cm.stages["program"].kernels.values() for b in k.local)
    check(cm, model, x)


def test_batched_weight_on_pair_dots(monkeypatch):
    torch.manual_seed(0)
    model, x = BatchedWeight(3, 50, 40).bfloat16().eval(), torch.randn(3, 21, 50).bfloat16()
    cm = compiled(model, x, monkeypatch, "host")
    assert pair_dots(cm) > 0
    check(cm, model, x)


def test_only_bf16_weights_take_pair_dots(monkeypatch):
    """f32 Linear layers, and bf16 products of two activations, keep the widening path."""
    monkeypatch.setattr(target_mod, "host_pair_dot", lambda: True)
    lin = nn.Linear(64, 64).eval()
    assert pair_dots(sextant.compile(lin, (torch.randn(8, 64),), target="cpu", cache=False)) == 0

    class Scores(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return q @ k.transpose(-1, -2)

    q = torch.randn(2, 16, 32).bfloat16()
    cm = sextant.compile(Scores(), (q, q), target="cpu", cache=False)
    assert pair_dots(cm) == 0
    torch.testing.assert_close(cm(q, q), Scores()(q, q), **BF16_TOL)


def test_target_without_the_instruction_keeps_the_widening_path(monkeypatch):
    monkeypatch.setattr(target_mod, "host_pair_dot", lambda: False)
    model, x = Mlp(64, 64, 64).bfloat16().eval(), torch.randn(8, 64).bfloat16()
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    assert pair_dots(cm) == 0
    check(cm, model, x)


@pytest.mark.skipif(not host_pair_dot(), reason="this CPU has no AVX-512-BF16: bf16 GEMMs widen to f32 here")
def test_this_cpu_uses_pair_dots_by_default():
    model, x = Mlp(64, 128, 64).bfloat16().eval(), torch.randn(40, 64).bfloat16()
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    assert pair_dots(cm) > 0
    check(cm, model, x)


@pytest.mark.parametrize("how", ["host", "lane by lane"])
def test_activation_b_laid_out_per_call_on_pair_dots(how, monkeypatch):
    """A bf16 product whose B is computed per call (``a @ relu(b)``; a 1×1 convolution as ``W @ x``)
    with at least ``ACTIVATION_MIN_ROWS`` rows of A: B is laid out in pairs by a kernel of its own
    before the product's, with an odd K and N past a whole strip; fewer rows keep the widening path."""
    from sextant.schedule.cpu_pairs import ACTIVATION_MIN_ROWS

    class Product(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.relu(a @ torch.relu(b))

    torch.manual_seed(0)
    for m, expect_pairs in ((ACTIVATION_MIN_ROWS + 3, True), (ACTIVATION_MIN_ROWS // 2, False)):
        a, b = torch.randn(2, m, 37).bfloat16(), torch.randn(2, 37, 70).bfloat16()
        monkeypatch.setattr(target_mod, "host_pair_dot", lambda: True)
        if how == "lane by lane":
            monkeypatch.setattr(cpu_matrix, "host_pair_dot", lambda: False)
            monkeypatch.setenv("SEXTANT_CACHE", "0")
            monkeypatch.setenv("SEXTANT_COMPILE_JOBS", "1")
        cm = sextant.compile(Product(), (a, b), target="cpu", cache=False)
        program = cm.stages["program"]
        kinds = [program.groups[launch.group].kind for launch in program.launches]
        assert (pair_dots(cm) > 0) == expect_pairs
        assert kinds == (["elementwise", "matmul"] if expect_pairs else ["matmul"]), kinds
        with torch.no_grad():
            torch.testing.assert_close(cm(a, b), Product()(a, b), **BF16_TOL)
            f32 = Product()(a.float(), b.float())
            torch.testing.assert_close(cm(a, b).float(), f32, **BF16_TOL)


def test_pointwise_conv_as_matmul_lays_its_input_out_in_pairs(monkeypatch):
    """A bf16 1×1 layer with 64 input channels is ``W @ x`` (cpu_conv.pointwise_as_matmul), 256
    output channels its rows: x goes on the pair dot through a per-call layout."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 256, 1), nn.ReLU()).bfloat16().eval()
    x = torch.randn(1, 64, 16, 16).bfloat16()
    cm = compiled(model, x, monkeypatch, "host")
    program = cm.stages["program"]
    assert "matmul" in [program.groups[launch.group].kind for launch in program.launches]
    assert pair_dots(cm) > 0
    check(cm, model, x)
