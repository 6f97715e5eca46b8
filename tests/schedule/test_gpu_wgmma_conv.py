"""The Hopper convolution (implicit GEMM on wgmma, sm_90a): weights by TMA, the im2col fragment
gathered into registers. Correct through cuda-sim (race-checked, mbarrier phases included) against
eager for 1-D/2-D/3-D, strided, dilated, grouped and transposed convolutions with fused epilogues,
both tile shapes (one warpgroup; producer + two consumers), ragged positions, channels and K;
assembled by ptxas for sm_90a without spills or serialised wgmmas. Weights whose rows TMA cannot
address are laid out at compile time; what the kernel cannot take keeps mma.sync."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import sextant
from sextant.kernel.printer import print_kernel


class ConvBnRelu(nn.Module):
    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv, self.bn = conv, nn.BatchNorm2d(conv.out_channels) if isinstance(conv, nn.Conv2d) else None

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        return torch.relu(y) + r


def _compile(mod: nn.Module, args: tuple, monkeypatch: pytest.MonkeyPatch) -> sextant.CompiledModule:
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")  # shared-memory races and waits that would hang are errors
    monkeypatch.setenv("SEXTANT_COMPILE_CACHE", "0")
    return sextant.compile(mod, args, target="cuda-sim", arch="sm_90a")


def _randomize_bn(mod: nn.Module) -> None:
    for m in mod.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)


CASES = {
    # Cin = 3: K = 27 padded to 32 at compile time; 128 positions of a 128-row tile, 16 channels
    "first-layer": (lambda: nn.Conv2d(3, 16, 3, padding=1), (2, 3, 8, 8), torch.float16, (128, 16, 64), True),
    # 3 K tiles (ragged), ragged positions (2·9·9 = 162), N tile 64 of 64 + 256 channels: 4 tiles
    "deep": (lambda: nn.Conv2d(96, 320, 3, padding=1), (2, 96, 9, 9), torch.float16, (128, 256, 64), True),
    # one warpgroup (50 positions), stride and dilation, groups of 24 channels (N tile 24), bf16
    "grouped": (lambda: nn.Conv2d(32, 48, 3, stride=2, padding=2, dilation=2, groups=2), (2, 32, 9, 9),
                torch.bfloat16, (64, 24, 64), False),
    "1d": (lambda: nn.Conv1d(32, 40, 5, padding=2), (3, 32, 30), torch.float16, (128, 40, 64), True),
    "3d": (lambda: nn.Conv3d(8, 16, 3, padding=1), (1, 8, 4, 5, 6), torch.float16, (128, 16, 64), True),
    # a transposed conv: its weight (flipped, transposed) laid out as a Cout × K matrix at compile time
    "transposed": (lambda: nn.ConvTranspose2d(16, 24, 3, stride=2, padding=1), (2, 16, 5, 5), torch.float16,
                   (128, 24, 64), True),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "deep" else c
                                  for c in CASES])  # "deep" ~20 s: make test-slow
def test_conv_runs_on_wgmma_and_matches_eager(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make, shape, dt, tile, specialized = CASES[case]
    torch.manual_seed(0)
    mod = ConvBnRelu(make()).eval()
    _randomize_bn(mod)
    mod = mod.to(dt)
    x = torch.randn(shape).to(dt)
    r = torch.randn(mod.conv(x).shape).to(dt)
    cm = _compile(mod, (x, r), monkeypatch)
    (kern,) = cm.stages["program"].kernels.values()
    assert kern.meta["mapping"] == "wgmma-tma-implicit-gemm"
    assert kern.meta["tile"] == tile and kern.meta["warp_specialized"] == specialized
    text = print_kernel(kern)
    assert "wgmma" in text and "tma_load" in text and "regs(&xa[" in text
    x2, r2 = torch.randn(shape).to(dt), torch.randn(r.shape).to(dt)  # fresh inputs
    ref = mod.float()(x2.float(), r2.float())
    tol = 3e-2 if dt == torch.bfloat16 else 1e-2
    torch.testing.assert_close(cm(x2, r2).float(), ref, atol=tol, rtol=tol)
    res = cm.stages["ptxas"]
    assert not re.search(r"C751[12]|serialized", res.log), res.log
    assert all(v.spill_stores == v.spill_loads == 0 for v in res.kernels.values())


def test_unaligned_weight_is_padded_at_compile_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 27: the program holds the weight as a 16 × 32 constant, zero past column 27."""
    torch.manual_seed(1)
    mod = nn.Conv2d(3, 16, 3, padding=1).half()
    x = torch.randn(1, 3, 8, 8).half()
    cm = _compile(mod, (x,), monkeypatch)
    program = cm.stages["program"]
    (padded,) = [t for t in program.constants.values() if tuple(t.shape) == (16, 32)]
    torch.testing.assert_close(padded[:, :27], mod.weight.reshape(16, 27))
    assert not padded[:, 27:].any()


@pytest.mark.slow  # ~11 s; make test-slow
def test_what_the_kernel_cannot_take_keeps_mma_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """K ≤ 8 (a 1×1 conv of 8 channels, a 2×2 one of 1, a transposed 2×2 of 2), few output channels
    a group (depthwise: direct), sm_90 without the ``a`` features: the mma.sync implicit GEMM or the
    direct mapping."""
    torch.manual_seed(2)
    narrow = nn.Conv2d(8, 64, 1).half()
    tiny_k = nn.Conv2d(1, 16, 2).half()  # K = 4: not laid out for wgmma either (the fallback reads W itself)
    tiny_t = nn.ConvTranspose2d(2, 16, 2, stride=2).half()  # K = 8 of a flipped, transposed kernel
    depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16).half()
    x8, x16 = torch.randn(2, 8, 6, 6).half(), torch.randn(2, 16, 6, 6).half()
    x1, x2 = torch.randn(2, 1, 6, 6).half(), torch.randn(2, 2, 5, 5).half()
    for mod, x, mapping in ((narrow, x8, "tensor-core-implicit-gemm"), (tiny_k, x1, "tensor-core-implicit-gemm"),
                            (tiny_t, x2, "tensor-core-implicit-gemm"), (depthwise, x16, "thread-per-element")):
        cm = _compile(mod, (x,), monkeypatch)
        (kern,) = cm.stages["program"].kernels.values()
        assert kern.meta["mapping"] == mapping
        torch.testing.assert_close(cm(x).float(), mod.float()(x.float()), atol=1e-2, rtol=1e-2)
    from sextant.graph.passes import run_pipeline
    from sextant.schedule.program import schedule
    from sextant.schedule.target import gpu_target

    mod = nn.Conv2d(16, 32, 3, padding=1).half()
    graph = run_pipeline(sextant.capture(mod, (x16,)))
    (kern,) = schedule(graph, gpu_target("sm_90")).kernels.values()
    assert kern.meta["mapping"] == "tensor-core-implicit-gemm"


def test_weight_computed_per_call_keeps_mma_sync_when_unaligned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight that is an input (as in training) cannot be laid out at compile time: K = 27 keeps
    mma.sync, K = 144 reads it in place on wgmma."""

    class Functional(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.conv2d(x, w, padding=1)

    torch.manual_seed(3)
    for cin, mapping in ((3, "tensor-core-implicit-gemm"), (16, "wgmma-tma-implicit-gemm")):
        x, w = torch.randn(2, cin, 8, 8).half(), torch.randn(32, cin, 3, 3).half()
        cm = _compile(Functional(), (x, w), monkeypatch)
        (kern,) = cm.stages["program"].kernels.values()
        assert kern.meta["mapping"] == mapping
        w2 = torch.randn_like(w)
        ref = torch.nn.functional.conv2d(x.float(), w2.float(), padding=1)
        torch.testing.assert_close(cm(x, w2).float(), ref, atol=2e-2, rtol=2e-2)
