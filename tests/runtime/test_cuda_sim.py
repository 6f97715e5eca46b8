"""target="cuda-sim": the GPU compilation (sm_90 schedules, PTX, ptxas) run on the CPU."""

import pytest
import torch

import sextant
from sextant.examples import EXAMPLES


@pytest.mark.parametrize("name", ["mlp", "transformer-block"])
def test_cuda_sim_matches_eager(name: str) -> None:
    model, args = EXAMPLES[name]()
    compiled = sextant.compile(model, args, target="cuda-sim")
    fresh = tuple(torch.randn_like(a) for a in args)
    with torch.no_grad():
        expected = model(*fresh)
    torch.testing.assert_close(compiled(*fresh), expected, rtol=1e-4, atol=2e-5)
    program = compiled.stages["program"]
    assert program.target.is_gpu
    assert all(k.threads_per_block > 1 for k in program.kernels.values())
    ptx = compiled.stages["ptx"].ptx
    assert ".target sm_90" in ptx and ".entry" in ptx
    resources = compiled.stages["ptxas"]
    assert set(program.kernels) <= set(resources.kernels)
