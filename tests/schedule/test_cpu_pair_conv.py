"""bf16 convolutions on the CPU's pair dot product (``cpu_conv.uses_pair_conv``): the implicit
GEMM's weight laid out in pairs of K, its k loop unrolled over whole windows *and* whole pairs so
every tap's offset stays a constant. Each layer matches eager's bf16 and the f32 convolution of the
same bf16 values, with the instruction where this CPU has it and lane by lane where it does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sextant.codegen.simt import iter_expr, stmt_exprs
from sextant.kernel.ir import Binary, For, iter_stmts

from .test_cpu_pairs import check, compiled, pair_dots


def binary_ops(stmts) -> set[str]:
    """Every binary operator the statements (nested bodies included) evaluate."""
    return {x.op for s in iter_stmts(stmts) for ex in stmt_exprs(s) for x in iter_expr(ex) if isinstance(x, Binary)}


def conv_layer(cin: int, cout: int, k: int, stride: int = 1, padding: int = 0, groups: int = 1) -> nn.Module:
    model = nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding, groups=groups), nn.BatchNorm2d(cout), nn.ReLU())
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    return model.bfloat16().eval()


def mappings(cm) -> list[str | None]:
    return [k.meta.get("mapping") for k in cm.stages["program"].kernels.values()]


@pytest.mark.parametrize("how", ["host", "lane by lane"])
@pytest.mark.parametrize("layer", [
    (64, 64, 3, 1, 1, 14, 1),   # ResNet's 3×3: two channels per trip of nine pair steps
    (32, 48, 3, 2, 1, 15, 1),   # stride 2, 48 output channels padded to whole strips
    (16, 40, 5, 1, 2, 9, 1),    # 25 taps: the innermost row unrolled, lcm(5, 2) = 10 k per trip
    (32, 64, 3, 1, 1, 8, 2),    # two groups
    (256, 96, 1, 1, 0, 7, 1),   # 1×1 with K = 256: stays an implicit GEMM on pairs
])
def test_bf16_conv_on_pair_dots_matches_eager(layer, how, monkeypatch):
    cin, cout, k, stride, padding, hw, groups = layer
    torch.manual_seed(0)
    model, x = conv_layer(cin, cout, k, stride, padding, groups), torch.randn(2, cin, hw, hw).bfloat16()
    cm = compiled(model, x, monkeypatch, how)
    assert "cpu-pair-dot" in mappings(cm) and pair_dots(cm) > 0
    check(cm, model, x)


def test_pair_conv_k_loop_divides_nothing(monkeypatch):
    """Unrolled over two channels of a 3×3 window, the k loop's offsets are the trip's plus
    constants: no division or remainder inside it (each was a dozen integer instructions)."""
    torch.manual_seed(0)
    model, x = conv_layer(64, 64, 3, 1, 1), torch.randn(1, 64, 14, 14).bfloat16()
    cm = compiled(model, x, monkeypatch, "host")
    (kernel,) = [k for k in cm.stages["program"].kernels.values() if k.meta.get("mapping") == "cpu-pair-dot"]
    k_loops = [s for s in iter_stmts(kernel.body) if isinstance(s, For) and s.var.name.startswith("k")]
    assert k_loops and all(s.stop.value == 64 * 9 // 18 for s in k_loops)  # 32 trips of 18 k
    ops = binary_ops(k_loops[0].body)
    assert "mul" in ops and not ops & {"div", "fmod", "mod"}, ops
    check(cm, model, x)


def test_odd_k_and_narrow_pointwise_layers_keep_the_widening_path(monkeypatch):
    """A stem's 3 input channels (K = 147, no whole trips) widens; so does a 1×1 layer with 64
    input channels, which is the matmul ``W @ x`` (its B an activation, not laid out in pairs)."""
    torch.manual_seed(0)
    stem, xs = conv_layer(3, 64, 7, 2, 3), torch.randn(1, 3, 32, 32).bfloat16()
    cm = compiled(stem, xs, monkeypatch, "host")
    assert "cpu-pair-dot" not in mappings(cm) and pair_dots(cm) == 0
    check(cm, stem, xs)
    narrow, xn = conv_layer(64, 128, 1), torch.randn(1, 64, 8, 8).bfloat16()
    cm = compiled(narrow, xn, monkeypatch, "host")
    kinds = [cm.stages["program"].groups[launch.group].kind for launch in cm.stages["program"].launches]
    assert "matmul" in kinds and pair_dots(cm) == 0
    check(cm, narrow, xn)


def test_f32_convolutions_never_take_pair_dots(monkeypatch):
    model, x = conv_layer(64, 64, 3, 1, 1).float(), torch.randn(1, 64, 8, 8)
    cm = compiled(model, x, monkeypatch, "host")
    assert pair_dots(cm) == 0
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x), atol=1e-4, rtol=1e-4)
