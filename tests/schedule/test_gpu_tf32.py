"""tf32 tensor cores for f32 matmuls (``schedule/gpu_tf32.py``): off by default (exact fp32, as
eager), on with ``torch.backends.cuda.matmul.allow_tf32``; through cuda-sim the result equals the
product of the tf32-truncated inputs up to f32 accumulation (a wrong fragment element would not),
race-checked, conflict-free, 0 spills, HMMA in the SASS."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import sextant


class Epilogue(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(a @ b) + 1.0


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """What the tensor cores read of an f32: the top 19 bits (sign, exponent, 10 mantissa bits)."""
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


@pytest.fixture
def tf32_allowed() -> Iterator[None]:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _mappings(cm: object) -> list[str]:
    program = cm.stages["program"]  # type: ignore[attr-defined]
    return [program.kernels[launch.kernel].meta["mapping"] for launch in program.launches
            if program.groups[launch.group].kind == "matmul"]


def test_f32_matmuls_stay_exact_by_default() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    cm = sextant.compile(Epilogue(), (a, b), target="cuda-sim", cache=False)
    assert _mappings(cm) == ["tiled"]
    torch.testing.assert_close(cm(a, b), Epilogue()(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 32, 48), (130, 70, 200), (256, 64, 256)], ids=str)
def test_tf32_matmul_is_the_product_of_truncated_inputs(shape: tuple[int, int, int], tf32_allowed: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    cm = sextant.compile(Epilogue(), (a, b), target="cuda-sim", arch="sm_80", cache=False)
    assert _mappings(cm) == ["tensor-core-tf32"]
    a, b = torch.randn(m, k), torch.randn(k, n)  # fresh inputs
    exact = torch.relu(_tf32(a).double() @ _tf32(b).double()) + 1.0
    got = cm(a, b).double()
    assert (got - exact).abs().max().item() <= 4e-6 * k**0.5 * exact.abs().max().item()
    # and eager fp32 differs by tf32's rounding, not more
    torch.testing.assert_close(cm(a, b), Epilogue()(a, b), rtol=1e-2, atol=1e-2 * k**0.5)


@pytest.mark.slow  # ~16 s; make test-slow
def test_linear_layers_stage_the_weight_as_nxk(tf32_allowed: None) -> None:
    """A Linear's Wᵀ is read from the stored W (N×K) by cp.async; bias and GELU stay fused."""
    from sextant.runtime.counting import count_program

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(96, 80), nn.GELU(), nn.Linear(80, 40)), torch.randn(3, 37, 96)
    cm = sextant.compile(model, (x,), target="cuda-sim", cache=False)
    assert _mappings(cm) == ["tensor-core-tf32"] * 2
    torch.testing.assert_close(cm(x), model(x), rtol=1e-2, atol=1e-2)
    for name, counted in count_program(cm.stages["program"], (x,)).items():
        assert counted.bank_conflicts == 0 and counted.mma_instructions > 0, (name, counted.summary())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tf32_kernels_assemble_without_spills(arch: str, tf32_allowed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from sextant.codegen.ptxas import assemble
    from sextant.codegen.sass import disassemble, find_disassembler
    from sextant.schedule import gpu_mma, gpu_tf32

    a, b = torch.randn(1024, 256), torch.randn(256, 512)
    for tile in gpu_tf32.CANDIDATES:
        monkeypatch.setattr(gpu_mma, "choose_tile", lambda *args, tile=tile, **kw: tile)  # tuned_tile calls it
        cm = sextant.compile(Epilogue(), (a, b), target="cuda-sim", arch=arch, cache=False)
        ptx = cm.stages["ptx"].ptx
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx
        res = assemble(ptx, arch)
        for name, r in res.kernels.items():
            assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (name, r)
            assert r.registers <= tile.registers, (tile, name, r.registers)  # the cost model's figure
        tool = find_disassembler()
        if tool is not None:
            assert "HMMA.1688.F32.TF32" in disassemble(res.cubin, tool)


def test_older_gpus_and_half_types_are_unaffected(tf32_allowed: None) -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    assert _mappings(sextant.compile(Epilogue(), (a, b), target="cuda-sim", arch="sm_75", cache=False)) == ["tiled"]
    half = sextant.compile(Epilogue(), (a.half(), b.half()), target="cuda-sim", cache=False)
    assert _mappings(half) == ["tensor-core"]
