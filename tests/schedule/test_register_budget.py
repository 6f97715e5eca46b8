"""A kernel that spills under its register budget (``.maxnreg``) is re-assembled with ptxas
choosing (``codegen/register_budget.py``): the spill goes, the note says so, the results still
match eager; and a budget is kept where lifting it does not help."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sextant
import sextant.schedule.gpu_mma as gpu_mma
from sextant.codegen.llvm_nvptx import emit_ptx
from sextant.codegen.ptxas import KernelResources, PtxasResult, assemble
from sextant.codegen.register_budget import relax_spilling, spill_bytes

from .half_models import MLP, TOL, eager_f32


def _starved(monkeypatch: pytest.MonkeyPatch, registers: int) -> None:
    """Every GEMM on the 64×64 tile with too small a budget for its accumulators."""
    tile = dataclasses.replace(gpu_mma.CANDIDATES[-1], registers=registers)
    monkeypatch.setattr(gpu_mma, "choose_tile", lambda m, n, batch, target, *a: tile)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_spilling_budget_is_lifted(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _starved(monkeypatch, 40)
    torch.manual_seed(0)
    model, x = MLP(64, 128).half(), torch.randn(3, 40, 64).half()
    cm = sextant.compile(model, (x,), target="cuda-sim", arch=arch, cache=False)
    program, res = cm.stages["program"], cm.stages["ptxas"]
    mma = [k for k in program.kernels.values() if k.meta.get("mapping") == "tensor-core"]
    assert mma and all(k.meta["max_registers"] is None for k in mma)
    assert all(k.meta["register_budget"].startswith("lifted: spilled") for k in mma)
    assert all(spill_bytes(res.kernels[k.name]) == 0 and res.kernels[k.name].registers > 40 for k in mma)
    assert ".maxnreg 40" not in cm.stages["ptx"].ptx
    assert sum("register budget:" in r and ".maxnreg 40" in r for r in program.rewrites) == len(mma)
    torch.testing.assert_close(cm(x).float(), eager_f32(model, x), rtol=TOL[torch.float16], atol=TOL[torch.float16])


def test_budget_kept_when_it_does_not_spill(monkeypatch: pytest.MonkeyPatch) -> None:
    _starved(monkeypatch, 128)
    model, x = MLP(64, 128).half(), torch.randn(3, 40, 64).half()
    cm = sextant.compile(model, (x,), target="cuda-sim", arch="sm_90", cache=False)
    program = cm.stages["program"]
    assert not any(r.startswith("register budget") for r in program.rewrites)
    assert ".maxnreg 128" in cm.stages["ptx"].ptx


def _scripted(spills: dict[tuple[str, bool], int]):
    """An assembler reporting ``spills[(kernel, budgeted)]`` bytes (budgeted: a ``.maxnreg`` in its PTX)."""

    def run(ptx: str, arch: str) -> PtxasResult:
        out = {}
        for name, budgeted in spills:
            entry = ptx.split(f".entry {name}(")[1] if f".entry {name}(" in ptx else None
            if entry is not None and (name, ".maxnreg" in entry.split("{")[0]) == (name, budgeted):
                out[name] = KernelResources(name, 64, spill_stores=spills[name, budgeted])
        return PtxasResult(arch, b"", out, "")

    return run


def test_each_kernel_keeps_the_allocation_that_spills_less(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two budgeted kernels spill; lifting the budget helps the first only: the final PTX has the
    first unbudgeted, the second still budgeted."""
    _starved(monkeypatch, 128)
    model, x = MLP(64, 128).half(), torch.randn(3, 40, 64).half()
    cm = sextant.compile(model, (x,), target="cuda-sim", arch="sm_90", cache=False)
    a, b = (k for k in cm.stages["program"].kernels.values() if k.meta.get("max_registers"))
    kernels = [a, b]
    ptx = emit_ptx(kernels, arch="sm_90")
    fake = _scripted({(a.name, True): 16, (a.name, False): 0, (b.name, True): 8, (b.name, False): 24})
    final, ptx2, res, notes = relax_spilling(kernels, ptx, fake(ptx.ptx, "sm_90"), fake)
    assert [k.meta["max_registers"] for k in final] == [None, 128]
    assert spill_bytes(res.kernels[a.name]) == 0 and spill_bytes(res.kernels[b.name]) == 8
    assert len(notes) == 1 and a.name in notes[0]
    assert ptx2.ptx.count(".maxnreg 128") == 1
    assemble(ptx2.ptx, "sm_90")  # the mixed module is still valid PTX
