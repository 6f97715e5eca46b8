"""Convolution as an implicit GEMM on the GPU (``schedule/gpu_conv.py``), run through cuda-sim (the
same kernels on the CPU) against eager PyTorch on fresh random inputs, and assembled by ptxas.

Tolerances: f32 ``rtol=1e-4, atol=1e-5`` (only the summation order differs from eager). For
f16/bf16 the reference is the f32 model on the same half-rounded inputs and weights, so what remains
is the rounding of the conv result and of the epilogue to the half type — about 2 ulps of values
up to ~4: ``5e-3`` (f16, 2^-11 ulp) and ``3e-2`` (bf16, 2^-8 ulp). ``test_half_accumulates_in_f32``
uses a tighter bound that accumulating in f16 would fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.codegen.llvm_nvptx import emit_ptx
from sextant.codegen.ptxas import assemble
from sextant.examples import EXAMPLES
from sextant.graph.dtypes import DType
from sextant.graph.passes import run_pipeline
from sextant.kernel.ir import Barrier, For, If, Kernel, Stmt
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule import gpu_kernels
from sextant.schedule.gpu_conv import CONV_GEMM_MIN_CHANNELS
from sextant.schedule.program import schedule
from sextant.schedule.target import sm90_target

TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float16: {"rtol": 5e-3, "atol": 5e-3},
       torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2}}


class ConvReLU(nn.Module):
    """Conv with bias, ReLU and (optionally) a residual: the epilogue fused into the conv kernel."""

    def __init__(self, conv: nn.Module, residual: bool = False) -> None:
        super().__init__()
        self.conv, self.residual = conv, residual

    def forward(self, x: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
        y = F.relu(self.conv(x))
        return y + r if self.residual else y


def _stmts(body: tuple[Stmt, ...]) -> list[Stmt]:
    out: list[Stmt] = []
    for s in body:
        out.append(s)
        if isinstance(s, If):
            out += _stmts(s.then) + _stmts(s.orelse)
        elif isinstance(s, For):
            out += _stmts(s.body)
    return out


def _check_implicit_gemm(k: Kernel, dtype: torch.dtype) -> None:
    """f32: tiles of A and B in shared memory, a register micro-tile, and the two barriers of the
    K loop (after the loads, after the rank-1 updates). f16/bf16 (sm_80+): the tensor-core body
    instead — half-precision stages of each tile, f32 accumulators, the same two barriers in the K
    loop and the staged epilogue's (one after the C tile is written, per pass, and one between two)."""
    if dtype != torch.float32:
        assert k.meta["mapping"] == "tensor-core-implicit-gemm"
        assert {b.dtype for b in k.shared} == {DType.from_torch(dtype)} and k.buffer("acc").dtype == DType.f32
        assert sum(isinstance(s, Barrier) for s in _stmts(k.body)) in (3, 5)
        assert any(isinstance(s, For) and sum(isinstance(t, Barrier) for t in s.body) == 2 for s in _stmts(k.body))
        cout_g, positions, _ = k.meta["gemm"]
        bm, bn, _ = k.meta["tile"]
        assert k.grid == (math.ceil(positions / bn), math.ceil(cout_g / bm), k.meta["groups"])
        return
    assert k.meta["mapping"] == "implicit-gemm"
    assert k.block == (16, 16, 1)
    assert {(b.name, b.size, b.dtype) for b in k.shared} == {("As", 64 * 16, DType.f32), ("Bs", 16 * 64, DType.f32)}
    assert [(b.name, b.size) for b in k.local] == [("acc", 16)]
    assert sum(isinstance(s, Barrier) for s in _stmts(k.body)) == 2
    assert any(isinstance(s, For) and any(isinstance(t, Barrier) for t in s.body) for s in _stmts(k.body))
    cout_g, positions, _ = k.meta["gemm"]
    assert k.grid == (math.ceil(positions / 64), math.ceil(cout_g / 64), k.meta["groups"])


def _check_ptxas(compiled: sextant.CompiledModule) -> None:
    """ptxas (run by cuda-sim's compile for its arch) reports no spills and the 8 KiB of tiles."""
    program = compiled.stages["program"]
    for name, k in program.kernels.items():
        res = compiled.stages["ptxas"].kernels[name]
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_frame == 0, res
        assert res.shared_bytes == sum(b.size * b.dtype.itemsize for b in k.shared)
        assert 0 < res.registers <= 255, res


def _compile_and_compare(model: nn.Module, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                         arch: str = "sm_90", tol: dict | None = None) -> sextant.CompiledModule:
    torch.manual_seed(0)
    model = model.eval().to(dtype)
    args = tuple(torch.randn(s).to(dtype) for s in shapes)
    compiled = sextant.compile(model, args, target="cuda-sim", arch=arch)
    fresh = tuple(torch.randn(s).to(dtype) for s in shapes)
    with torch.no_grad():
        expected = model.float()(*(a.float() for a in fresh))
    model.to(dtype)
    got = compiled(*fresh)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, **(tol or TOL[dtype]))
    return compiled


CASES = {  # name: (conv, input shape)
    "ragged-3to10-9x11-pad1": (lambda: nn.Conv2d(3, 10, 3, padding=1), (1, 3, 9, 11)),
    "stride2-pad2-dil2-groups2-batch3": (lambda: nn.Conv2d(8, 16, 3, stride=2, padding=2, dilation=2, groups=2),
                                         (3, 8, 9, 11)),
    "1x1-two-channel-tiles": (lambda: nn.Conv2d(5, 70, 1), (2, 5, 5, 7)),
    "stride2-pad0-nine-k-tiles": (lambda: nn.Conv2d(16, 24, 3, stride=2), (3, 16, 12, 10)),
    "per-dim-params-groups3": (lambda: nn.Conv2d(6, 12, (3, 5), stride=(1, 2), padding=(2, 1), dilation=(1, 2),
                                                 groups=3), (2, 6, 8, 13)),
    "13-position-tiles": (lambda: nn.Conv2d(4, 8, 3, padding=1), (2, 4, 20, 20)),
    "conv1d": (lambda: nn.Conv1d(6, 9, 5, stride=2, padding=2), (3, 6, 37)),
    "conv3d": (lambda: nn.Conv3d(3, 5, 3, padding=1), (1, 3, 5, 6, 4)),
    "transposed": (lambda: nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, output_padding=1), (2, 4, 5, 6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_conv_bias_relu_matches_eager(case: str) -> None:
    make, shape = CASES[case]
    torch.manual_seed(1)
    compiled = _compile_and_compare(ConvReLU(make()), [shape], torch.float32)
    (kernel,) = compiled.stages["program"].kernels.values()  # bias and ReLU fused into the conv
    _check_implicit_gemm(kernel, torch.float32)
    _check_ptxas(compiled)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_conv_with_residual(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    conv = nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2)
    compiled = _compile_and_compare(ConvReLU(conv, residual=True), [(3, 8, 9, 11), (3, 16, 5, 6)], dtype,
                                    arch="sm_80")
    (kernel,) = compiled.stages["program"].kernels.values()
    _check_implicit_gemm(kernel, dtype)
    _check_ptxas(compiled)
    # the tile's register figure is ptxas's budget, as for the GEMM (the cost model's occupancy)
    assert f".maxnreg {kernel.meta['max_registers']}" in compiled.stages["ptx"].ptx
    assert compiled.stages["ptxas"].kernels[kernel.name].registers <= kernel.meta["max_registers"]


def test_half_accumulates_in_f32() -> None:
    """K = 64·3·3 = 576 products of O(1) weights and inputs (sums up to ~40): rounded once to f16,
    the result is within 1e-3 + 2e-3·|y|; rounded to f16 after every add, it would exceed that by
    ~0.1 (an f16 running sum, emulated in torch, when this test was written)."""
    torch.manual_seed(3)
    conv = nn.Conv2d(64, 8, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.uniform_(-1, 1)
    compiled = _compile_and_compare(ConvReLU(conv), [(1, 64, 6, 7)], torch.float16, tol={"rtol": 2e-3, "atol": 1e-3})
    (kernel,) = compiled.stages["program"].kernels.values()
    assert kernel.meta["gemm"] == (8, 42, 576)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_folded_into_the_epilogue(dtype: torch.dtype) -> None:
    """Conv (no bias) → eval BatchNorm with non-trivial statistics → ReLU: one kernel."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1, bias=False), nn.BatchNorm2d(12), nn.ReLU())
    bn = model[1]
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    compiled = _compile_and_compare(model, [(3, 3, 7, 9)], dtype)
    (kernel,) = compiled.stages["program"].kernels.values()
    _check_implicit_gemm(kernel, dtype)


def test_depthwise_falls_back_to_the_direct_mapping() -> None:
    """Fewer than CONV_GEMM_MIN_CHANNELS output channels per group: one thread per output."""
    torch.manual_seed(5)
    conv = nn.Conv2d(6, 12, 3, padding=1, groups=6)  # 2 output channels per group
    per_group = conv.out_channels // conv.groups
    assert per_group < CONV_GEMM_MIN_CHANNELS
    compiled = _compile_and_compare(ConvReLU(conv), [(3, 6, 9, 11)], torch.float32)
    (kernel,) = compiled.stages["program"].kernels.values()
    assert kernel.meta["mapping"] == "thread-per-element" and not kernel.shared


def test_groups_folded_into_grid_x(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond CUDA's limit on grid y/z the channel tiles and groups are recovered from bid.x."""
    monkeypatch.setattr(gpu_kernels, "MAX_GRID_YZ", 2)
    torch.manual_seed(6)
    compiled = _compile_and_compare(ConvReLU(nn.Conv2d(12, 24, 3, padding=1, groups=3)), [(2, 12, 9, 11)],
                                    torch.float32)
    (kernel,) = compiled.stages["program"].kernels.values()
    assert kernel.grid == (math.ceil(2 * 9 * 11 / 64) * 1 * 3, 1, 1)


def test_no_shared_memory_races() -> None:
    """The race-checking CPU lowering: no thread reads a tile slot another wrote in the same
    barrier phase, and no access is out of bounds (padding, ragged tiles, several K steps)."""
    torch.manual_seed(7)
    model = ConvReLU(nn.Conv2d(6, 10, 3, stride=2, padding=2, dilation=2, groups=2)).eval()
    x = torch.randn(3, 6, 9, 11)
    program = schedule(run_pipeline(sextant.capture(model, (x,))), sm90_target())
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values()), check_races=True).launch)
    fresh = torch.randn_like(x)
    with torch.no_grad():
        torch.testing.assert_close(runner([fresh])[0], model(fresh), **TOL[torch.float32])


def test_cnn_example_end_to_end() -> None:
    """The CNN example (conv + BN + ReLU + pooling, twice): both convs are implicit GEMMs with BN
    and ReLU fused; it matches eager; every kernel assembles for sm_80 and sm_90 without spills."""
    model, args = EXAMPLES["cnn"]()
    compiled = sextant.compile(model, args, target="cuda-sim")
    program = compiled.stages["program"]
    convs = [program.kernels[launch.kernel] for launch in program.launches
             if program.groups[launch.group].kind == "conv"]
    assert len(convs) == 2
    for k in convs:
        _check_implicit_gemm(k, torch.float32)
    fresh = tuple(torch.randn_like(a) for a in args)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*fresh), model(*fresh), rtol=1e-4, atol=2e-5)
    _check_ptxas(compiled)
    ptx80 = emit_ptx(list(program.kernels.values()), arch="sm_80").ptx
    for k in convs:
        res = assemble(ptx80, "sm_80").kernels[k.name]
        assert res.spill_stores == res.spill_loads == 0 and res.shared_bytes == 8192 and res.barriers == 1
