"""Split-K (``schedule/split_k.py``): the cost model, the rewrite's graph (f32 partials, padding),
skinny half-precision products through cuda-sim against eager (race-checked, ragged K, fused
epilogues, tf32), the kernels' counters and ptxas figures, and the mixed-precision ``matmul``
(``out_dtype=f32``) the rewrite relies on, on every target."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.codegen.ptxas import assemble
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph
from sextant.graph.ops import IRTypeError
from sextant.graph.parser import parse_graph
from sextant.graph.passes import run_pipeline
from sextant.graph.reference import run_graph
from sextant.runtime.counting import count_program
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.program import schedule
from sextant.schedule.split_k import MAX_SPLITS, slice_depth, split_factor, split_k
from sextant.schedule.target import cpu_target, gpu_target

from .half_models import MLP, TOL, eager_f32

H100 = gpu_target("sm_90")


def _split_matmuls(graph: Graph) -> list:
    return [n for n in graph.nodes if n.op == "matmul" and n.dtype != n.inputs[0].dtype]


def test_split_factor_fills_the_sms_within_its_bounds() -> None:
    assert split_factor(4096, 4096, 4096, 1, H100) == 1  # 4096 tiles: the GPU is full
    assert split_factor(16, 768, 3072, 1, H100) == 11  # 12 tiles -> 11 slices of ~280 cover 132 SMs
    assert split_factor(16, 768, 768, 1, H100) == 3  # slices stay >= 256 deep
    assert split_factor(16, 768, 200, 1, H100) == 1  # too shallow to split at all
    assert split_factor(1, 64, 1 << 16, 1, H100) == MAX_SPLITS
    assert split_factor(16, 768, 3072, 12, H100) == 1  # the batch fills the GPU already
    assert split_factor(16 * 48, 768, 3072, 1, H100) == 1  # 144 tiles: more than a wave already
    assert split_factor(16, 3072, 768, 1, H100) == 2  # 48 tiles: 2 slices stay in one wave (3 would not)
    assert split_factor(16, 768, 3072, 1, gpu_target("sm_80")) == math.ceil(108 / 12)  # A100: 108 SMs


def test_slice_depth_prefers_whole_tiles_then_pads() -> None:
    assert slice_depth(3072, 11) == (8, 384)  # 8 slices divide 3072 into whole 32-deep tiles
    assert slice_depth(1024, 4) == (4, 256)
    assert slice_depth(1000, 3) == (3, 352)  # no divisor: K padded to 1056


def _decoder_graph(d: int, h: int, dtype: torch.dtype) -> tuple[MLP, torch.Tensor, Graph]:
    torch.manual_seed(0)
    model, x = MLP(d, h).to(dtype), torch.randn(1, 16, d).to(dtype)
    return model, x, run_pipeline(sextant.capture(model, (x,)))


def test_rewrite_keeps_partials_in_f32_and_computes_the_same_function() -> None:
    _, x, graph = _decoder_graph(200, 1000, torch.float16)
    rewritten, notes = split_k(graph, H100)
    (partial,) = _split_matmuls(rewritten)  # the up projection (K=200) is too shallow to split
    assert partial.dtype == DType.f32 and partial.shape == (3, 16, 200)
    assert any(n.op == "pad" for n in rewritten.nodes)  # K=1000 padded to 3 slices of 352
    assert len(notes) == 1 and "3 slices of K=352 (K padded by 56)" in notes[0]
    fresh = torch.randn_like(x)
    want, got = run_graph(graph, [fresh])[0], run_graph(rewritten, [fresh])[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    assert split_k(graph, cpu_target()) == (graph, [])  # the CPU's GEMM needs no split


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d,h", [(256, 1024), (200, 1000)], ids=["whole-slices", "padded-K"])
def test_skinny_products_split_and_match_eager_race_checked(dtype: torch.dtype, d: int, h: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    model, x, _ = _decoder_graph(d, h, dtype)
    cm = sextant.compile(model, (x,), target="cuda-sim", cache=False)
    program = cm.stages["program"]
    assert len(program.rewrites) == 1 and program.rewrites[0].startswith("split-K: matmul at ")
    assert "split-K" in program.describe()
    mappings = {program.kernels[la.kernel].meta["mapping"] for la in program.launches
                if program.groups[la.group].kind == "matmul"}
    assert mappings == {"tensor-core"}
    assert len(program.launches) == 3  # up (+GELU), the sliced down product, the sum (+bias, residual)
    if h == 1000:  # K padded to 3 slices of 352: the weight is padded once, at compile time
        assert any(b.kind == "param" and b.node.shape == (3, 352, d) for b in program.buffers)
    for args in ((x,), (torch.randn_like(x),)):
        got = cm(*args)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), eager_f32(model, *args), rtol=TOL[dtype], atol=TOL[dtype])


def test_batched_tf32_product_splits() -> None:
    class BMM(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.relu(a @ b)

    torch.manual_seed(2)
    a, b = torch.randn(2, 20, 1536), torch.randn(2, 1536, 40)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        cm = sextant.compile(BMM(), (a, b), target="cuda-sim", cache=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    program = cm.stages["program"]
    assert program.rewrites and "([2] 20x1536 . 1536x40: 2 tile(s) for 132 SMs)" in program.rewrites[0]
    assert {program.kernels[la.kernel].meta["mapping"] for la in program.launches
            if program.groups[la.group].kind == "matmul"} == {"tensor-core-tf32"}
    torch.testing.assert_close(cm(a, b), torch.relu(a @ b), rtol=1e-2, atol=5e-2)


def test_split_kernels_are_conflict_free_coalesced_and_count_every_mma() -> None:
    model, x, _ = _decoder_graph(256, 1024, torch.float16)
    cm = sextant.compile(model, (x,), target="cuda-sim", cache=False)
    program = cm.stages["program"]
    counters = count_program(program, (x,))
    split = next(la for la in program.launches if program.kernels[la.kernel].grid[2] > 1)
    kernel, got = program.kernels[split.kernel], counters[split.kernel]
    assert got.bank_conflicts == 0 and got.load_efficiency == 1.0  # A's slices: a strided view, cp.async
    bm, bn, bk = kernel.meta["tile"]
    wm, wn = kernel.meta["warps"]
    s, m, n, depth = 4, 16, 256, 256
    per_warp = (depth // bk) * (bk // 16) * (bm // wm // 16) * (bn // wn // 8)
    assert got.mma_instructions == s * math.ceil(m / bm) * math.ceil(n / bn) * wm * wn * per_warp
    total = next(la for la in program.launches if program.groups[la.group].kind == "elementwise")
    assert counters[total.kernel].load_efficiency == 1.0  # one thread per column: the partials are coalesced


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_split_kernels_assemble_without_spills(arch: str) -> None:
    model, x, _ = _decoder_graph(256, 1024, torch.float16)
    cm = sextant.compile(model, (x,), target="cuda-sim", arch=arch, cache=False)
    assert cm.stages["program"].rewrites
    for name, r in assemble(cm.stages["ptx"].ptx, arch).kernels.items():
        assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (name, r)


def test_attention_products_and_full_gemms_are_not_split() -> None:
    class Attn(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, k, v)

    q = torch.randn(1, 1, 16, 1024).half()  # one head of width 1024: deep, skinny Q·Kᵀ
    graph = run_pipeline(sextant.capture(Attn(), (q, q, q)))
    assert split_k(graph, H100)[1] == []  # fused attention owns its products
    big = run_pipeline(sextant.capture(MLP(512, 2048).half(), (torch.randn(8, 128, 512).half(),)))
    assert split_k(big, H100)[1] == []  # 128 tiles of 64 x 64 already occupy 128 of 132 SMs
    assert split_k(big, gpu_target("sm_75"))[1] == []  # no tensor cores: nothing to split


class CachedAttention(nn.Module):
    """A decode step against a KV cache, attention written out as HF models do (half products, the
    softmax in f32): the 16 new tokens' query projection splits (12 tiles), and P·V (16 queries ×
    512 cached keys, 12 heads: 12 tiles, K = 512) would too if it were not part of the chain."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(768, 768)

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(1, 16, 12, 64).transpose(1, 2)
        p = torch.softmax((q @ k.transpose(-1, -2)).float() / 8.0, dim=-1).to(q.dtype)
        return p @ v


def test_attention_below_a_split_projection_still_fuses() -> None:
    torch.manual_seed(3)
    model = CachedAttention().half()
    x, kv = torch.randn(1, 16, 768).half(), torch.randn(1, 12, 512, 64).half()
    program = schedule(run_pipeline(sextant.capture(model, (x, kv, kv))), H100)
    assert [g.kind for g in program.groups].count("attention") == 1
    assert len(program.rewrites) == 1 and "(16x768 . 768x768" in program.rewrites[0]  # the projection only


class PreNormStack(nn.Module):
    """``x = x + W·LayerNorm(x)``, 12 times, at a decode step's 16 tokens: every projection splits,
    so the residual stream is a chain of slice sums that no matmul epilogue stores."""

    def __init__(self, layers: int = 12) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(768) for _ in range(layers))
        self.projs = nn.ModuleList(nn.Linear(768, 768) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, proj in zip(self.norms, self.projs):
            x = x + proj(norm(x))
        return x


def test_a_split_residual_stream_is_stored_not_recomputed_by_every_layer() -> None:
    torch.manual_seed(4)
    model, x = PreNormStack().half(), torch.randn(1, 16, 768).half()
    program = schedule(run_pipeline(sextant.capture(model, (x,))), H100)
    assert len(program.rewrites) == 12
    # each LayerNorm reads the stream through at most a couple of layers' partials, not all before it
    widest = max(len(la.args) for la in program.launches)
    assert widest <= 12, widest


def test_no_slice_is_padding_only() -> None:
    for k in (1000, 4100, 3000, 777):
        for s in range(2, MAX_SPLITS + 1):
            t, depth = slice_depth(k, s)
            assert t * depth >= k > (t - 1) * depth and depth % 32 == 0, (k, s, t, depth)


# -- the mixed-precision matmul the rewrite emits ---------------------------------------------
def _mixed_graph() -> Graph:
    gb = GraphBuilder("mixed")
    a, b = gb.input("a", (3, 40, 72), DType.f16), gb.input("b", (3, 72, 24), DType.f16)
    return gb.build([gb.add(gb.emit("matmul", [a, b], out_dtype=DType.f32), 1.0)])


def test_mixed_precision_matmul_type_text_and_reference() -> None:
    graph = _mixed_graph()
    text = str(graph)
    assert "matmul(%a, %b) {out_dtype=f32} : f32[3,40,24]" in text
    assert str(parse_graph(text)) == text
    a, b = torch.randn(3, 40, 72).half(), torch.randn(3, 72, 24).half()
    got = run_graph(graph, [a, b])[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, a.float() @ b.float() + 1)
    gb = GraphBuilder()
    x = gb.input("x", (4, 4), DType.f32)
    with pytest.raises(IRTypeError, match="out_dtype f16 must be f32 or the operands' f32"):
        gb.emit("matmul", [x, x], out_dtype=DType.f16)


@pytest.mark.parametrize("target", [cpu_target(), gpu_target("sm_75"), gpu_target("sm_90")],
                         ids=["cpu", "sm_75-cuda-cores", "sm_90-tensor-cores"])
def test_mixed_precision_matmul_runs_on_every_mapping(target: object) -> None:
    graph = _mixed_graph()
    program = schedule(graph, target)  # type: ignore[arg-type]
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)
    a, b = torch.randn(3, 40, 72).half(), torch.randn(3, 72, 24).half()
    (got,) = runner([a, b])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, a.float() @ b.float() + 1, rtol=1e-4, atol=1e-4)


def test_split_program_survives_the_artifact_round_trip(tmp_path: Path) -> None:
    model, x, _ = _decoder_graph(256, 1024, torch.float16)
    cm = sextant.compile(model, (x,), target="cuda-sim", cache=False)
    loaded = sextant.load(cm.save(tmp_path / "decoder"))
    assert loaded.stages["program"].rewrites == cm.stages["program"].rewrites
    fresh = torch.randn_like(x)
    assert torch.equal(loaded(fresh), cm(fresh))
