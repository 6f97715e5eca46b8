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
