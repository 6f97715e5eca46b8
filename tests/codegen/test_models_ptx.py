"""Every kernel of every example model, scheduled for the GPU, assembles with ptxas for sm_80 and
sm_90 — with its register, shared-memory and spill figures recorded."""

import pytest

import sextant
from sextant.codegen.llvm_nvptx import emit_ptx
from sextant.codegen.ptxas import assemble
from sextant.examples import EXAMPLES
from sextant.graph.passes import run_pipeline
from sextant.schedule.program import schedule
from sextant.schedule.target import sm90_target


@pytest.fixture(scope="module")
def programs() -> dict:
    out = {}
    for name, factory in EXAMPLES.items():
        model, args = factory()
        out[name] = schedule(run_pipeline(sextant.capture(model, args)), sm90_target())
    return out


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_model_kernels_assemble(programs: dict, name: str, arch: str) -> None:
    kernels = list(programs[name].kernels.values())
    module = emit_ptx(kernels, arch=arch)
    result = assemble(module.ptx, arch)
    assert set(result.kernels) == {k.name for k in kernels}
    for k in kernels:
        res = result.kernels[k.name]
        assert 0 < res.registers <= 255
        assert res.spill_stores == 0 and res.spill_loads == 0, (k.name, res)
        assert res.shared_bytes == sum(b.size * b.dtype.itemsize for b in k.shared)


@pytest.fixture(scope="module")
def half_programs_sm90a() -> dict:
    from sextant.schedule.target import gpu_target

    out = {}
    for name, factory in EXAMPLES.items():
        model, args = factory()
        args = tuple(a.half() if a.is_floating_point() else a for a in args)
        out[name] = schedule(run_pipeline(sextant.capture(model.half(), args)), gpu_target("sm_90a"))
    return out


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_half_models_on_hopper_kernels_assemble_for_sm90a(half_programs_sm90a: dict, name: str) -> None:
    """Each example model in f16 for sm_90a: every matmul, convolution and attention on wgmma fed
    by TMA (none left on mma.sync: not the 10-class heads, whose weights are read in place, not the
    attention output projections, whose A is read head by head, not the first conv, whose weight
    is padded), every kernel assembled without spills, serialised wgmmas (C7512) or ignored setmaxnreg (C7508)."""
    kernels = list(half_programs_sm90a[name].kernels.values())
    mappings = [k.meta.get("mapping", "") for k in kernels]
    assert not {"tensor-core", "flash-attention-tensor-core", "tensor-core-implicit-gemm"} & set(mappings)
    assert "wgmma-tma" in mappings
    if name == "cnn":
        assert mappings.count("wgmma-tma-implicit-gemm") == 2
    result = assemble(emit_ptx(kernels, arch="sm_90a").ptx, "sm_90a")
    assert "C7512" not in result.log and "C7508" not in result.log
    for k in kernels:
        res = result.kernels[k.name]
        assert res.spill_stores == 0 and res.spill_loads == 0, (k.name, res)
