"""CPU matmuls with a constant weight read it in panels (``schedule/cpu_panels.py``): laid out
``[*batch, N/nr, K, nr]`` at compile time, zero-padded to whole strips; ragged and narrow N, K
blocks, batches, f16 and fused epilogues match eager, and products of two activations keep
reading B as it is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.reference import eval_node
from sextant.schedule.cpu_panels import panel_weight
from sextant.schedule.kernels import micro_tile
from sextant.schedule.target import cpu_target

from .test_cpu_pairs import BatchedWeight


class Mlp(nn.Module):
    def __init__(self, k: int, hidden: int, n: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(k, hidden), nn.Linear(hidden, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x))) + x[..., : self.down.out_features]


def panel_weights(cm) -> list[str]:
    return [k.meta["weight"] for k in cm.stages["program"].kernels.values()
            if str(k.meta.get("weight", "")).endswith("in panels")]


@pytest.mark.parametrize("shape", [(37, 64, 96, 48), (8, 33, 70, 5), (130, 1100, 200, 3), (6, 16, 40, 12)])
def test_mlp_on_panels_matches_eager(shape):
    """Ragged M and N (70, 200: a padded last strip), N below a strip (5, 3, 12: narrow tiles),
    K = 1100 walked in K blocks, a residual add in the epilogue."""
    m, k, hidden, n = shape
    torch.manual_seed(0)
    model, x = Mlp(k, hidden, n).eval(), torch.randn(m, k)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    assert len(panel_weights(cm)) == 2
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)


def test_batched_and_half_weights_on_panels():
    torch.manual_seed(0)
    model, x = BatchedWeight(3, 50, 40).eval(), torch.randn(3, 21, 50)
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    nr = micro_tile(cpu_target())[1]  # 16 with AVX2, 32 with AVX-512
    assert panel_weights(cm) == [f"[3, {-(-40 // nr)}, 50, {nr}] in panels"]
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
    half, xh = Mlp(64, 96, 40).half().eval(), torch.randn(2, 9, 64).half()
    cm = sextant.compile(half, (xh,), target="cpu", cache=False)
    assert len(panel_weights(cm)) == 2
    with torch.no_grad():
        torch.testing.assert_close(cm(xh).float(), half.float()(xh.float()), rtol=2e-2, atol=2e-2)


def test_products_of_activations_read_b_as_it_is():
    class Scores(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return q @ k.transpose(-1, -2)

    q, k = torch.randn(2, 16, 32), torch.randn(2, 24, 32)
    cm = sextant.compile(Scores(), (q, k), target="cpu", cache=False)
    assert panel_weights(cm) == []
    torch.testing.assert_close(cm(q, k), Scores()(q, k))


@pytest.mark.parametrize(("k", "n", "nr"), [(5, 32, 16), (7, 45, 16), (3, 4, 8)])
def test_panel_layout_puts_each_strip_together(k, n, nr):
    b = GraphBuilder("w")
    w = b.input("w", (2, k, n), DType.f32)
    p = panel_weight(w, nr)
    value = torch.randn(2, k, n)
    nodes, x = [], p
    while x is not w:
        nodes.append(x)
        x = x.inputs[0]
    out = value
    for node in reversed(nodes):
        out = eval_node(node, [out], None)
    strips = -(-n // nr)
    assert tuple(out.shape) == (2, strips, k, nr)
    padded = torch.nn.functional.pad(value, (0, strips * nr - n))
    for s in range(strips):
        torch.testing.assert_close(out[:, s], padded[..., s * nr:(s + 1) * nr], rtol=0, atol=0)
