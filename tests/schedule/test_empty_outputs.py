"""Values with no elements need buffers, not kernels: a program may have empty outputs, or no kernel at all."""

import pytest
import torch

import sextant


class EmptySum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(dim=2, keepdim=True) * 2, x.sum(dim=1) + 1  # [2,0,1] (empty) and [2,4] (zeros + 1)


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_empty_outputs(target: str) -> None:
    x = torch.randn(2, 0, 4)
    compiled = sextant.compile(EmptySum(), (x,), target=target)
    got, want = compiled(x), EmptySum()(x)
    assert got[0].shape == (2, 0, 1)
    torch.testing.assert_close(got[1], want[1])
    program = compiled.stages["program"]
    empty = program.outputs[0]
    assert program.buffers[empty].node.shape == (2, 0, 1)
    assert all(empty not in launch.args for launch in program.launches)  # no kernel computes it
