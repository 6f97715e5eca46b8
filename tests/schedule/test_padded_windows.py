"""Windows over padding compile to kernels whose size does not grow with the window.

HF's EfficientNet pools its last 2×2 feature map with ``AvgPool2d(hidden_dim, ceil_mode=True)``:
the frontend turns a ``k×k`` window into ``k²`` strided slices of the padded input, all fused into
one elementwise kernel. A slice whose index is a constant inside the padding now reads the pad
value (no load, no bounds registers), and the padding zeros it adds in a row fold into one add
(``(x + 0.0) + 0.0`` is ``x + 0.0`` bit for bit), so the kernel stays the same size whatever ``k``
— it had ~14 statements per tap: 1.4M for hidden_dim=320. The depthwise convolutions with the
asymmetric padding of that model ("same" padding at stride 2) are checked against eager on both
targets; the whole model, slow, at the end.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes import run_pipeline
from sextant.graph.reference import run_graph
from sextant.kernel.exprs import statement_count
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.program import Program, schedule
from sextant.schedule.target import cpu_target, gpu_target


def _statements(program: Program) -> int:
    return sum(statement_count(k.body) for k in program.kernels.values())


def _programs(model: nn.Module, x: torch.Tensor) -> dict[str, Program]:
    graph = run_pipeline(sextant.capture(model.eval(), (x,)))
    return {"cpu": schedule(graph, cpu_target(cores=2, vector_bytes=32)), "gpu": schedule(graph, gpu_target("sm_90"))}


def test_pooling_window_over_ceil_mode_padding_does_not_grow_the_kernel() -> None:
    x = torch.randn(2, 8, 2, 2)
    sizes = {k: {t: _statements(p) for t, p in _programs(nn.AvgPool2d(k, ceil_mode=True), x).items()}
             for k in (4, 16)}
    assert sizes[16] == sizes[4], sizes  # 256 taps as small as 16: only the 4 inside the input are read
    assert all(n <= 60 for n in sizes[16].values()), sizes


@pytest.mark.parametrize("k", [3, 16])
def test_pooling_window_over_ceil_mode_padding_matches_eager(k: int) -> None:
    model, x = nn.AvgPool2d(k, ceil_mode=True).eval(), torch.randn(2, 8, 2, 2)
    compiled = sextant.compile(model, (x,), target="cpu", cache=False)
    torch.testing.assert_close(compiled(x), model(x))


def test_padding_zeros_added_in_a_row_fold_into_one_exact_add() -> None:
    """``((x + 0) + 0) + 0``: one add in the kernel, and ``-0.0`` comes out as the reference says
    (``+0.0``: adding a zero once already made it positive)."""
    b = GraphBuilder("zeros")
    x = b.input("x", (4, 8), DType.f32)
    y = x
    for _ in range(50):
        y = b.add(y, b.full(0.0, (4, 8), DType.f32))
    graph = b.build([y])
    program = schedule(graph, cpu_target(cores=2, vector_bytes=32))
    (kernel,) = program.kernels.values()
    assert statement_count(kernel.body) < 10
    value = torch.full((4, 8), -0.0)
    value[0, 0] = float("nan")
    value[1, 1] = 1.5
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)
    (got,), (want,) = runner([value]), run_graph(graph, [value])
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
@pytest.mark.parametrize(("k", "pad"), [(3, (0, 1, 0, 1)), (5, (1, 2, 1, 2))])
def test_depthwise_stride2_with_asymmetric_padding_matches_eager(target: str, k: int, pad: tuple) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ZeroPad2d(pad), nn.Conv2d(24, 24, k, stride=2, groups=24, bias=False)).eval()
    x = torch.randn(2, 24, 16, 16)
    compiled = sextant.compile(model, (x,), target=target, cache=False)
    fresh = torch.randn_like(x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(fresh), model(fresh), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_hf_efficientnet_with_its_pooler_compiles_and_matches_eager() -> None:
    """The model of the report: a 320×320 pooling window over a 2×2 map (took 10-20 minutes)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import EfficientNetConfig, EfficientNetModel

    torch.manual_seed(0)
    # hidden_dim is the top conv's width at this width_coefficient (transformers does not derive it)
    cfg = EfficientNetConfig(width_coefficient=0.25, depth_coefficient=0.25, image_size=64, hidden_dim=320)
    model = EfficientNetModel(cfg).eval()
    x = torch.randn(2, 3, 64, 64)
    compiled = sextant.compile(model, (x,), target="cpu", cache=False)
    program = compiled.stages["program"]
    assert max(statement_count(k.body) for k in program.kernels.values()) < 500
    fresh = torch.randn_like(x)
    with torch.no_grad():
        want = model(fresh)
    got = compiled(fresh)
    hidden, pooled = (got.last_hidden_state, got.pooler_output) if hasattr(got, "pooler_output") else got
    torch.testing.assert_close(hidden, want.last_hidden_state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pooled, want.pooler_output, rtol=1e-4, atol=1e-5)
