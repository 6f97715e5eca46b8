"""The CPU's GEMV mapping (``schedule/cpu_gemv.py``): a Linear layer on a few rows — a decode step —
reads its weight ``W[N, K]`` in place, as dot products along K, with no prepacked copy; prefill-shaped
products keep the GEMM. Both register layouts (AVX2's 8-lane and AVX-512's 16-lane vectors) are
checked whatever the host (the JIT-compiled code runs on any x86-64 host)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.decoder import Decoder, DecoderConfig, greedy_generate
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes import run_pipeline
from sextant.graph.reference import run_graph
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.cpu_gemv import GEMV_MAX_ROWS, uses_gemv
from sextant.schedule.program import prepack_weights, schedule
from sextant.schedule.target import cpu_target, gpu_target


def _linear_graph(batch: tuple[int, ...], m: int, k: int, n: int, dtype: DType, *, bias: bool = False,
                  residual: bool = False, silu: bool = False):
    """``x @ W.T`` (+ bias, SiLU, + residual) with W a param ``[N, K]``, as torch.export writes a Linear:
    ``matmul(x, permute(W))`` (expanded over the batch dims of a batched ``x``)."""
    torch.manual_seed(m * 1000 + k * 7 + n)
    b = GraphBuilder("linear")
    x = b.input("x", (*batch, m, k), dtype)
    w = b.permute(b.param("w", torch.randn(n, k).to(dtype.torch)), (1, 0))
    if batch:
        w = b.expand(b.reshape(w, (1,) * len(batch) + (k, n)), (*batch, k, n))
    y = b.matmul(x, w)
    if bias:
        bias_row = b.reshape(b.param("bias", torch.randn(n).to(dtype.torch)), (1,) * (len(batch) + 1) + (n,))
        y = b.add(y, b.expand(bias_row, y.shape))
    if silu:
        y = b.mul(y, b.emit("sigmoid", [y]))
    if residual:
        y = b.add(y, b.input("r", (*batch, m, n), dtype))
    return run_pipeline(b.build([y]))


def _gemv_kernels(program) -> list:
    return [k for k in program.kernels.values() if k.meta.get("mapping") == "cpu-gemv"]


@pytest.mark.parametrize("vector_bytes", [32, 64])
@pytest.mark.parametrize(("batch", "m", "k", "n", "dtype", "epilogue"), [
    ((), 1, 1, 1, DType.f32, ()),
    ((), 1, 64, 32, DType.f32, ()),
    ((), 1, 100, 7, DType.f32, ("bias",)),  # K not a multiple of the vector width; N not of the rows per step
    ((), 2, 33, 130, DType.f32, ("bias", "residual")),
    ((), 4, 172, 64, DType.f32, ("bias", "silu", "residual")),
    ((), 4, 768, 1000, DType.f32, ("residual",)),  # several blocks
    ((), 3, 19, 45, DType.f32, ("bias",)),
    ((2,), 1, 40, 70, DType.f32, ("bias",)),  # batch dims folded into the rows
    ((), 1, 70, 45, DType.f16, ("bias",)),
    ((), 3, 37, 20, DType.bf16, ("residual",)),
])
def test_gemv_matches_reference(vector_bytes: int, batch: tuple[int, ...], m: int, k: int, n: int, dtype: DType,
                                epilogue: tuple[str, ...]) -> None:
    graph = _linear_graph(batch, m, k, n, dtype, bias="bias" in epilogue, residual="residual" in epilogue,
                          silu="silu" in epilogue)
    program = schedule(graph, cpu_target(cores=2, vector_bytes=vector_bytes))
    assert len(_gemv_kernels(program)) == 1
    assert set(program.constants) == {b.index for b in program.buffers if b.kind == "param" and b.node.op == "param"}
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)
    inputs = [torch.randn(node.shape).to(node.dtype.torch) for node in graph.inputs]
    (got,) = runner(inputs)
    (want,) = run_graph(graph, inputs)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == DType.f32 else {"atol": 5e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_gemv_only_for_few_rows_and_cpu() -> None:
    """Up to ``GEMV_MAX_ROWS`` rows a Linear is a GEMV and its weight is not prepacked; a prefill
    (128 rows) keeps the GEMM and its weight laid out in panels; GPUs keep their mappings."""
    cpu = cpu_target(cores=2)
    for m, gemv in ((1, True), (4, True), (GEMV_MAX_ROWS, True), (GEMV_MAX_ROWS + 1, False), (128, False)):
        graph = _linear_graph((), m, 96, 80, DType.f32, bias=True)
        program = schedule(graph, cpu)
        (group,) = [g for g in program.groups if g.kind == "matmul"]
        assert uses_gemv(group, cpu) == gemv
        assert bool(_gemv_kernels(program)) == gemv
        assert not uses_gemv(group, gpu_target("sm_90"))
        assert not prepack_weights(program.graph, program.groups, cpu)  # row-major copies: GPUs only now
        assert bool(group.packed) != gemv  # a GEMM's weight laid out in panels (cpu_panels), a GEMV's read in place
        assert len(prepack_weights(program.graph, program.groups, gpu_target("sm_90"))) == 1
        packed = [b for b in program.buffers if b.kind == "param" and b.node.op != "param"]
        assert bool(packed) != gemv


def test_gemv_not_for_a_computed_right_hand_side() -> None:
    """B must be a weight read along K: an input (attention's per-step products) keeps the GEMM."""
    b = GraphBuilder("mm")
    x, w = b.input("x", (1, 32), DType.f32), b.input("w", (32, 16), DType.f32)
    program = schedule(run_pipeline(b.build([b.matmul(x, w)])), cpu_target(cores=2))
    assert not _gemv_kernels(program)


def test_decode_step_linears_are_gemvs_and_prefill_gemms() -> None:
    """The tiny decoder: every Linear of a decode step is a GEMV with no packed weight copy; the
    prefill's are GEMMs; the tokens match eager's, token for token."""
    torch.manual_seed(0)
    cfg = DecoderConfig.tiny()
    model, prompt = Decoder(cfg).eval(), torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        want = greedy_generate(model, prompt, 12)
    pre = sextant.compile(model, (prompt, torch.arange(16)), target="cpu", cache=False)
    dec = sextant.compile(model, (prompt[:, :1], torch.tensor([16])), target="cpu", cache=False)
    pp, dp = pre.stages["program"], dec.stages["program"]
    linears = 7 * cfg.n_layers + 1
    matmuls = [g for g in dp.groups if g.kind == "matmul"]
    assert len(matmuls) == linears and all(uses_gemv(g, dp.target) for g in matmuls)
    assert not [b for b in dp.buffers if b.kind == "param" and b.node.op != "param"]  # no packed copies
    assert not [g for g in pp.groups if g.kind == "matmul" and uses_gemv(g, pp.target)]
    for buf in model.buffers():  # the cache starts empty again
        if buf.dtype.is_floating_point and buf.dim() == 4:
            buf.zero_()

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return (pre if ids.shape[1] > 1 else dec)(ids, pos)

    got = greedy_generate(step, prompt, 12)
    assert torch.equal(got, want)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(48, 120), nn.Linear(120, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_compiled_mlp_matches_eager(rows: int) -> None:
    torch.manual_seed(rows)
    model, x = _Mlp().eval(), torch.randn(rows, 1, 48)
    compiled = sextant.compile(model, (x,), target="cpu", cache=False)
    assert len(_gemv_kernels(compiled.stages["program"])) == 2
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
