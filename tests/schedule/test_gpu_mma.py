"""The tensor-core GEMM mapping (``schedule/gpu_mma.py``): f16/bf16 matmuls on sm_80+ through
cuda-sim against eager (both block tiles, ragged sizes, fused epilogues, race-checked), its PTX
through ptxas (0 spills, HMMA in the SASS), and when it is (not) chosen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
import sextant.schedule.gpu_mma as gpu_mma
from sextant.codegen.ptxas import assemble
from sextant.graph.passes import run_pipeline
from sextant.schedule.program import schedule
from sextant.schedule.target import gpu_target

from .half_models import MLP, TOL, eager_f32

DTYPES = [torch.float16, torch.bfloat16]


class Epilogue(nn.Module):
    """A batched product with bias, ReLU and a residual product fused into its store."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n) / k**0.5)
        self.b = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w + self.b) * r


def _mappings(cm: object) -> set[str]:
    program = cm.stages["program"]  # type: ignore[attr-defined]
    return {program.kernels[launch.kernel].meta["mapping"] for launch in program.launches
            if program.groups[launch.group].kind == "matmul"}


@pytest.mark.parametrize("tile", gpu_mma.CANDIDATES, ids=lambda t: f"{t.bm}x{t.bn}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ragged_matmul_with_epilogue_matches_eager(dtype: torch.dtype, tile: gpu_mma.TcTile,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_mma, "choose_tile", lambda m, n, batch, target, *a: tile)
    torch.manual_seed(0)
    model = Epilogue(130, 150).to(dtype)
    x, r = torch.randn(2, 133, 130).to(dtype), torch.randn(2, 133, 150).to(dtype)
    cm = sextant.compile(model, (x, r), target="cuda-sim", cache=False)
    assert _mappings(cm) == {"tensor-core"}
    for args in ((x, r), (torch.randn_like(x), torch.randn_like(r))):
        got = cm(*args)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), eager_f32(model, *args), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_race_checked_on_cuda_sim(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checked CPU build: no shared-memory race, no out-of-bounds access, converged warps."""
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    torch.manual_seed(1)
    model, x = MLP(72, 136).to(dtype), torch.randn(3, 21, 72).to(dtype)
    cm = sextant.compile(model, (x,), target="cuda-sim", cache=False)
    assert _mappings(cm) == {"tensor-core"}
    torch.testing.assert_close(cm(x).float(), eager_f32(model, x), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", [pytest.param("sm_80", marks=pytest.mark.slow), "sm_90"])  # sm_80 ~20 s a dtype
def test_tensor_core_kernels_assemble_without_spills(arch: str, dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from sextant.codegen.sass import disassemble, find_disassembler

    for tile in gpu_mma.CANDIDATES:
        monkeypatch.setattr(gpu_mma, "choose_tile", lambda m, n, batch, target, *a, tile=tile: tile)
        model, x = MLP(64, 256).to(dtype), torch.randn(4, 64, 64).to(dtype)
        cm = sextant.compile(model, (x,), target="cuda-sim", arch=arch, cache=False)
        ptx = cm.stages["ptx"].ptx
        short = "f16" if dtype == torch.float16 else "bf16"
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{short}.{short}.f32" in ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
        assert f".maxnreg {tile.registers}" in ptx  # the cost model's register figure is ptxas's budget
        if dtype == torch.bfloat16:  # rounding to bf16 is one instruction from sm_80 on
            assert "cvt.rn.bf16.f32" in ptx
        res = assemble(ptx, arch)
        for name, r in res.kernels.items():
            assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (tile, name, r)
            if "matmul" in name:  # the figure the tile choice's occupancy model uses
                assert r.registers <= tile.registers, (tile, name, r.registers)
        tool = find_disassembler()
        if tool is not None:
            assert "HMMA.16816.F32" in disassemble(res.cubin, tool)


def _matmul_mappings(model: nn.Module, args: tuple, arch: str) -> set[str]:
    program = schedule(run_pipeline(sextant.capture(model, args)), gpu_target(arch))
    return {program.kernels[launch.kernel].meta["mapping"] for launch in program.launches
            if program.groups[launch.group].kind == "matmul"}


def test_tensor_cores_are_used_only_where_they_apply() -> None:
    half = (MLP(32, 64).half(), (torch.randn(8, 32).half(),))
    assert _matmul_mappings(*half, "sm_80") == {"tensor-core"}
    assert _matmul_mappings(*half, "sm_75") == {"tiled"}  # no m16n8k16 before Ampere
    assert _matmul_mappings(MLP(32, 64), (torch.randn(8, 32),), "sm_90") == {"tiled"}  # f32 stays exact fp32


def test_tile_choice_fills_the_gpu() -> None:
    h100 = gpu_target("sm_90")
    assert gpu_mma.choose_tile(4096, 4096, 1, h100) == gpu_mma.CANDIDATES[0]  # 1024 tiles of 128×128
    assert gpu_mma.choose_tile(512, 768, 1, h100) == gpu_mma.CANDIDATES[-1]  # 24 tiles would idle 108 SMs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_style_lm_runs_its_half_matmuls_on_tensor_cores(dtype: torch.dtype) -> None:
    """A 2-layer Llama-style LM (the zoo's: RMSNorm, rotary embeddings, SwiGLU, GQA) in f16/bf16
    through cuda-sim: every matmul with half inputs on tensor cores, logits within 4 ulp (at the
    output's scale) of the f32 model on the same half weights."""
    from sextant.graph.dtypes import DType
    from sextant.zoo import ZOO

    model, (ids,) = ZOO["llama"]()
    model = model.to(dtype)
    cm = sextant.compile(model, (ids,), target="cuda-sim", cache=False)
    program = cm.stages["program"]
    half = [launch for launch in program.launches if program.groups[launch.group].kind == "matmul"
            and program.groups[launch.group].anchor.inputs[0].dtype == DType.from_torch(dtype)]
    assert len(half) >= 14  # q, k, v, o, gate, up, down per layer (and the LM head)
    assert {program.kernels[launch.kernel].meta["mapping"] for launch in half} == {"tensor-core"}
    got = cm(ids)
    want = eager_f32(model, ids)
    err = (got.float() - want).abs().max().item()
    assert err <= 4 * torch.finfo(dtype).eps * want.abs().max().item(), err


class ConvNet(nn.Module):
    """Padding, stride, groups, BatchNorm and ReLU in the epilogue, a 1×1 projection."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Conv2d(8, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.b = nn.Conv2d(32, 48, 3, stride=2, padding=1, groups=2)
        self.c = nn.Conv2d(48, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.bn(self.a(x))))))


@pytest.mark.slow  # ~31 s a dtype of cuda-sim; make test-slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_half_convolutions_run_on_tensor_cores(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The implicit GEMM through the same tensor-core body: race-checked on cuda-sim, conflict-free
    shared memory, 0 spills, within half tolerance of f32 eager on the same weights."""
    from sextant.runtime.counting import count_program

    torch.manual_seed(0)
    model, x = ConvNet().eval().to(dtype), torch.randn(2, 8, 15, 13).to(dtype)
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    cm = sextant.compile(model, (x,), target="cuda-sim", cache=False)
    program = cm.stages["program"]
    assert {k.meta["mapping"] for k in program.kernels.values()} == {"tensor-core-implicit-gemm"}
    torch.testing.assert_close(cm(x).float(), eager_f32(model, x), rtol=TOL[dtype], atol=TOL[dtype])
    for r in cm.stages["ptxas"].kernels.values():
        assert r.spill_stores == r.spill_loads == 0
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "0")
    for name, counted in count_program(program, (x,)).items():
        assert counted.bank_conflicts == 0 and counted.mma_instructions > 0, (name, counted.summary())
