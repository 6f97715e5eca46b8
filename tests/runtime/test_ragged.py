"""Ragged sizes and divergent warps through the whole ``target="cuda-sim"`` pipeline, with the
checked CPU lowering on (``SEXTANT_CHECK_RACES=1``): a missing or wrong bounds guard at a size
that is not a multiple of the block, the warp, the row group or the matmul tile is reported as
an out-of-bounds access even when its value would not reach the output, and every warp
reduction is checked to be reached by all lanes of its warp (rows past the end of a ragged
row group are clamped, not skipped, so their lanes still take part and only their stores are
guarded). Results are compared with eager PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.codegen.race_check import CheckedCpuModule
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes import run_pipeline
from sextant.graph.reference import run_graph
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target, sm90_target

SIZES = (1, 31, 33, 63, 65, 127, 129)  # around the warp (32), the reduction block and the 64x64 matmul tile


class Ragged(nn.Module):
    """One of each GPU mapping on an ``(rows, n)`` input: elementwise, softmax and LayerNorm over
    rows of ``n``, a Linear (M=rows, K=n, N=m) with its bias in the epilogue, and a 3x3 conv over
    the ``rows x n`` plane."""

    def __init__(self, n: int, m: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(n)
        self.fc = nn.Linear(n, m)
        self.conv = nn.Conv2d(1, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (F.gelu(x) * 0.5 + x, torch.softmax(x, dim=-1), self.fc(self.ln(x)), self.conv(x[None, None]))


def _check(rows: int, n: int, m: int) -> sextant.CompiledModule:
    torch.manual_seed(rows * 1000 + n)
    model = Ragged(n, m).eval()
    with torch.no_grad():
        model.ln.weight.uniform_(0.5, 1.5)
        model.ln.bias.uniform_(-0.5, 0.5)
    compiled = sextant.compile(model, (torch.randn(rows, n),), target="cuda-sim")
    assert isinstance(compiled.stages["cpu_module"], CheckedCpuModule)
    for _ in range(2):
        x = torch.randn(rows, n)
        with torch.no_grad():
            want = model(x)
        for got, w in zip(compiled(x), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-4, atol=3e-5)
    return compiled


@pytest.fixture(autouse=True)
def _checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")


@pytest.mark.parametrize("i", range(len(SIZES)))
def test_ragged_sizes_every_mapping(i: int) -> None:
    rows, n, m = SIZES[i], SIZES[(i + 3) % len(SIZES)], SIZES[(i + 5) % len(SIZES)]
    compiled = _check(rows, n, m)
    program = compiled.stages["program"]
    maps = {program.groups[launch.group].kind: program.kernels[launch.kernel].meta.get("mapping")
            for launch in program.launches}
    assert {"elementwise", "reduce", "matmul", "conv"} <= set(maps), maps


@pytest.mark.parametrize(("rows", "n", "m"), [
    (7, 5, 3),  # 8 lanes a row, 4 rows a warp, the last group of rows clamped
    (33, 3, 65),  # 4 lanes a row
    (3, 1025, 33),  # a block per row: warp partials through shared memory and two barriers
    (2, 2049, 1),
])
def test_row_groups_and_long_rows(rows: int, n: int, m: int) -> None:
    program = _check(rows, n, m).stages["program"]
    mappings = {k.meta.get("mapping") for k in program.kernels.values()}
    assert ("block-per-row" in mappings) == (n > 1024)


# -- random shapes at the schedule level (no export, no PTX: fast enough for hypothesis) ---------------
def _softmax_matmul(rows: int, n: int, m: int) -> tuple:
    """softmax(x) @ w and softmax(x) * 2: the reduction's epilogue (``* 2``) comes after the matmul
    in the graph, which once made the matmul launch before the softmax it reads."""
    b = GraphBuilder("ragged")
    x = b.input("x", (rows, n), DType.f32)
    w = b.input("w", (n, m), DType.f32)
    e = b.unary("exp", b.sub(x, b.expand(b.reduce("max", x, [-1]), x.shape)))
    softmax = b.div(e, b.expand(b.reduce("sum", e, [-1]), x.shape))
    graph = run_pipeline(b.build([b.unary("tanh", b.matmul(softmax, w)), b.mul(softmax, 2.0)]))
    return graph, [torch.randn(rows, n), torch.randn(n, m)]


def _run_checked(graph: object, inputs: list[torch.Tensor], target: object) -> None:
    program = schedule(graph, target)
    module = compile_kernels(list(program.kernels.values()))
    assert isinstance(module, CheckedCpuModule)
    for got, want in zip(ProgramRunner(program, module.launch)(inputs), run_graph(graph, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", [sm90_target(), cpu_target()], ids=["sm90", "cpu"])
def test_consumer_launches_after_its_producer(target: object) -> None:
    graph, inputs = _softmax_matmul(5, 7, 3)
    program = schedule(graph, target)
    kinds = [program.groups[launch.group].kind for launch in program.launches]
    assert kinds == ["reduce", "matmul"]
    _run_checked(graph, inputs, target)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example compiles kernels
@given(rows=st.integers(1, 140), n=st.integers(1, 140), m=st.integers(1, 140))
def test_random_shapes_vs_reference(rows: int, n: int, m: int) -> None:
    _run_checked(*_softmax_matmul(rows, n, m), sm90_target())
