"""Fused attention (``schedule/attention_match.py``, ``cpu_attention.py``, ``gpu_flash_attention.py``):
SDPA and the HF matmul → scale/mask → softmax → matmul chain become one kernel on the CPU and,
for f16/bf16 on sm_80+, one tensor-core flash kernel through cuda-sim, matching eager at ragged
sizes, with masks, fully masked rows and grouped-query heads."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
from sextant.graph.passes import run_pipeline
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target, gpu_target

HALF = [torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class Sdpa(nn.Module):
    def __init__(self, **kw: object) -> None:
        super().__init__()
        self.kw = kw

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kw)


class ExplicitChain(nn.Module):
    """Attention as HF's eager implementations write it: bmm, scale, additive mask, softmax, bmm."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, h, s, d = q.shape
        w = torch.bmm(q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2)) / d**0.5
        w = w.reshape(b, h, s, s) + bias
        p = torch.softmax(w, dim=-1).to(v.dtype)
        return torch.bmm(p.reshape(b * h, s, s), v.reshape(b * h, s, -1)).reshape(b, h, s, -1)


class ReturnsWeights(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return p @ v, p


def _case(name: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple]:
    """(module, inputs) of one attention variant."""
    g = torch.Generator().manual_seed(hash(name) % 1000)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "causal":
        return Sdpa(is_causal=True), (r(2, 3, 70, 16), r(2, 3, 70, 16), r(2, 3, 70, 16))
    if name == "bool-mask":  # row 5 of batch 0 sees no key: eager gives 0 there
        mask = torch.rand(2, 1, 33, 129, generator=g) > 0.4
        mask[0, 0, 5] = False
        return Sdpa(), (r(2, 2, 33, 32), r(2, 2, 129, 32), r(2, 2, 129, 32), mask)
    if name == "additive-mask":
        return Sdpa(scale=0.3), (r(1, 2, 7, 16), r(1, 2, 65, 16), r(1, 2, 65, 48), r(1, 2, 7, 65))
    if name == "gqa":  # 4 query heads share 2 key/value heads
        return Sdpa(is_causal=True, enable_gqa=True), (r(1, 4, 19, 32), r(1, 2, 19, 32), r(1, 2, 19, 32))
    if name == "one-query":
        return Sdpa(), (r(3, 2, 1, 16), r(3, 2, 130, 16), r(3, 2, 130, 16))
    if name == "explicit-chain":
        return ExplicitChain(), (r(2, 2, 24, 16), r(2, 2, 24, 16), r(2, 2, 24, 32), r(2, 1, 1, 24))
    raise KeyError(name)


CASES = ["causal", "bool-mask", "additive-mask", "gqa", "one-query", "explicit-chain"]


def _attention_mappings(cm: object) -> list[str]:
    program = cm.stages["program"]  # type: ignore[attr-defined]
    return [program.kernels[launch.kernel].meta["mapping"] for launch in program.launches
            if program.groups[launch.group].kind == "attention"]


def _eager_f32(model: nn.Module, args: tuple) -> torch.Tensor:
    return model(*(a.float() if a.is_floating_point() else a for a in args))


@pytest.mark.parametrize("name", CASES)
def test_attention_fuses_into_one_kernel_on_the_cpu(name: str) -> None:
    model, args = _case(name)
    cm = sextant.compile(model, args, target="cpu", cache=False)
    program = cm.stages["program"]
    assert [program.groups[launch.group].kind for launch in program.launches] == ["attention"], program.describe()
    assert _attention_mappings(cm) == ["attention-cpu-flash"]
    torch.testing.assert_close(cm(*args), model(*args), rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_the_score_matrix_is_never_stored() -> None:
    """The whole point: no buffer of the ``S × S`` score or probability shape is computed (the
    causal mask, folded to a constant by the graph passes, is the only ``S × S`` operand)."""
    model, args = _case("causal")
    program = schedule(run_pipeline(sextant.capture(model, args)), cpu_target())
    computed = [b.node.shape for b in program.buffers if b.kind in ("temp", "output")]
    assert computed == [(2, 3, 70, 16)], computed


def test_f32_attention_on_the_gpu_stays_three_kernels_and_says_why() -> None:
    """Without tensor cores the GPU keeps the tiled matmuls and the warp softmax."""
    model, args = _case("bool-mask")
    cm = sextant.compile(model, args, target="cuda-sim", cache=False)
    program = cm.stages["program"]
    assert [program.groups[launch.group].kind for launch in program.launches] == ["matmul", "reduce", "matmul"]
    assert any("not fused" in n and "f16/bf16" in n for n in program.notes), program.notes
    torch.testing.assert_close(cm(*args), model(*args), rtol=TOL[torch.float32], atol=TOL[torch.float32])


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [HALF[0], pytest.param(HALF[1], marks=pytest.mark.slow)], ids=str)  # ~13 s a case
def test_half_attention_runs_the_tensor_core_flash_kernel(name: str, dtype: torch.dtype,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda-sim executes the mma/ldmatrix fragments as the PTX ISA lays them out, race-checked; the
    result is within half tolerance of f32 eager on the same half inputs."""
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    model, args = _case(name, dtype)
    cm = sextant.compile(model, args, target="cuda-sim", cache=False)
    assert _attention_mappings(cm) == ["flash-attention-tensor-core"]
    torch.testing.assert_close(cm(*args).float(), _eager_f32(model, args), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("arch", ["sm_80", pytest.param("sm_90", marks=pytest.mark.slow)])  # ~15 s each
def test_flash_kernel_assembles_without_spills_and_runs_on_hmma(arch: str) -> None:
    from sextant.codegen.llvm_nvptx import emit_ptx
    from sextant.codegen.ptxas import assemble
    from sextant.codegen.sass import disassemble, find_disassembler

    for d, s, causal in ((16, 128, False), (32, 256, True), (64, 256, True), (64, 200, True), (128, 128, False)):
        q = torch.randn(2, 4, s, d).half()
        program = schedule(run_pipeline(sextant.capture(Sdpa(is_causal=causal), (q, q, q))), gpu_target(arch))
        assert [k.meta["mapping"] for k in program.kernels.values()] == ["flash-attention-tensor-core"]
        ptx = emit_ptx(list(program.kernels.values()), arch=arch).ptx
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
        assert "cp.async.cg.shared.global" in ptx  # Q, K and V are plain buffers: 16-byte async copies
        res = assemble(ptx, arch)
        for name, r in res.kernels.items():
            assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (d, s, name, r)
        tool = find_disassembler()
        if tool is not None:
            assert "HMMA.16816.F32" in disassemble(res.cubin, tool)


@pytest.mark.slow  # ~40 s of cuda-sim counters
def test_flash_kernel_counters() -> None:
    """Conflict-free ldmatrix on the padded K/V tiles, and both products on tensor cores."""
    from sextant.runtime.counting import count_program

    q = torch.randn(1, 2, 100, 64).half()
    program = schedule(run_pipeline(sextant.capture(Sdpa(is_causal=True), (q, q, q))), gpu_target("sm_90"))
    (counted,) = count_program(program, (q, q, q)).values()
    assert counted.bank_conflicts == 0, counted.summary()
    # 2 heads x 2 query tiles of 64, seeing 1 and 2 key tiles of 64 (causal: none past the diagonal)
    # x 4 warps; per warp and key tile: S = 4 k-steps x 8 MMAs, O = 4 x 8
    assert counted.mma_instructions == 2 * (1 + 2) * 4 * (4 * 8 + 4 * 8), counted.summary()
    assert counted.load_efficiency == 1.0  # the causal mask is index arithmetic, not a table


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_causal_attention_skips_the_masked_key_tiles(target: str) -> None:
    """The causal mask stays ``key <= query`` on iotas (constant folding keeps index predicates); the
    matcher sees it and the kernels stop each query (tile) at its diagonal — same result, fewer tiles."""
    from sextant.runtime.counting import count_program

    dtype = torch.float16 if target == "cuda-sim" else torch.float32
    q, k, v = (torch.randn(1, 1, 320, 16).to(dtype) for _ in range(3))
    cm = sextant.compile(Sdpa(is_causal=True), (q, k, v), target=target, cache=False)
    (group,) = cm.stages["program"].groups
    assert group.attention.causal
    torch.testing.assert_close(cm(q, k, v).float(), _eager_f32(Sdpa(is_causal=True), (q, k, v)),
                               rtol=TOL[dtype], atol=TOL[dtype])
    if target == "cuda-sim":  # 5 query tiles x (2, 4, ..., 10) of 10 key tiles of 32, 32 MMAs each
        (counted,) = count_program(cm.stages["program"], (q, k, v)).values()
        assert counted.mma_instructions == 30 * 32, counted.summary()


def test_the_gpu_fuses_only_what_the_flash_kernel_computes() -> None:
    def kinds_and_notes(model: nn.Module, args: tuple, arch: str) -> tuple[list[str], list[str]]:
        program = schedule(run_pipeline(sextant.capture(model, args)), gpu_target(arch))
        return [g.kind for g in program.groups], program.notes

    half = torch.randn(1, 2, 16, 16).half()
    assert kinds_and_notes(Sdpa(), (half, half, half), "sm_80")[0] == ["attention"]
    kinds, notes = kinds_and_notes(Sdpa(), (half, half, half), "sm_75")
    assert "attention" not in kinds and any("sm_80" in n for n in notes)
    odd = torch.randn(1, 2, 16, 24).half()
    kinds, notes = kinds_and_notes(Sdpa(), (odd, odd, odd), "sm_90")
    assert "attention" not in kinds and any("head sizes 24/24" in n for n in notes)


def test_unfusable_attention_is_reported() -> None:
    """Returning the attention weights keeps the chain apart; the schedule dump says why."""
    q = torch.randn(1, 2, 8, 16)
    program = schedule(run_pipeline(sextant.capture(ReturnsWeights(), (q, q, q))), cpu_target())
    assert "attention" not in [g.kind for g in program.groups]
    assert any("not fused" in n and "probability matrix" in n and "graph output" in n for n in program.notes), \
        program.notes
    assert "not fused" in program.describe()


def test_gpt2_attention_is_one_kernel_per_layer() -> None:
    """GPT-2 (transformers' default attention) through the HF chain matcher, matching eager."""
    from sextant.examples import EXAMPLES

    model, args = EXAMPLES["gpt2"]()
    cm = sextant.compile(model, args, target="cpu", cache=False)
    assert _attention_mappings(cm) == ["attention-cpu-flash"] * 2
    torch.testing.assert_close(cm(*args), model(*args), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_llama_attention_on_tensor_cores(dtype: torch.dtype) -> None:
    """The zoo's 2-layer Llama-style LM (GQA, rotary, causal) in f16/bf16 on cuda-sim: both
    attentions run the flash kernel; logits within half tolerance of the f32 model."""
    from sextant.zoo import ZOO

    model, (ids,) = ZOO["llama"]()
    model = model.to(dtype)
    cm = sextant.compile(model, (ids,), target="cuda-sim", cache=False)
    assert _attention_mappings(cm) == ["flash-attention-tensor-core"] * 2
    with torch.no_grad():
        want = copy.deepcopy(model).float()(ids)
    got = cm(ids).float()
    err = (got - want).abs().max().item()
    assert err <= 8 * torch.finfo(dtype).eps * want.abs().max().item(), err


class TableMasked(nn.Module):
    """Attention whose mask is a constant table, as transformers folds it: additive (0 / the
    dtype's lowest value) or boolean through ``where``."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        w = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if self.table.dtype == torch.bool:
            w = torch.where(self.table, w, torch.finfo(w.dtype).min)
        else:
            w = w + self.table
        return torch.softmax(w.float(), dim=-1).to(v.dtype) @ v


def _tables(s: int, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, bool]]:
    """name -> (mask table, whether it is the causal pattern)."""
    low = torch.finfo(dtype).min
    tril = torch.ones(s, s, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, s, s, dtype=dtype).masked_fill(~tril, low)
    padded = additive.clone()
    padded[1, :, :, -3:] = low  # batch 1 also hides its last 3 keys: not causal
    return {"additive": (additive, True), "bool": (tril[None, None].expand(2, 1, s, s).clone(), True),
            "padded": (padded, False), "shifted": (torch.zeros(2, 1, s, s, dtype=dtype).masked_fill(
                ~torch.ones(s, s, dtype=torch.bool).tril(1), low), False)}


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
@pytest.mark.parametrize("name", ["additive", "bool", "padded", "shifted"])
def test_causal_mask_tables_skip_the_masked_key_tiles(target: str, name: str) -> None:
    """A constant mask table is evaluated at schedule time: the causal pattern (GPT-2's folded
    additive mask, a boolean tril) skips the tiles past the diagonal like an iota mask, anything
    else (padding, a shifted diagonal) computes every tile; both match eager."""
    from sextant.runtime.counting import count_program

    dtype = torch.float16 if target == "cuda-sim" else torch.float32
    table, causal = _tables(320, dtype)[name]
    model = TableMasked(table)
    q, k, v = (torch.randn(2, 2, 320, 16).to(dtype) for _ in range(3))
    cm = sextant.compile(model, (q, k, v), target=target, cache=False)
    attention = [g for g in cm.stages["program"].groups if g.kind == "attention"]
    assert len(attention) == 1 and attention[0].attention.causal is causal
    torch.testing.assert_close(cm(q, k, v).float(), _eager_f32(model, (q, k, v)), rtol=TOL[dtype], atol=TOL[dtype])
    if target == "cuda-sim":  # 4 batch-heads x 5 query tiles x (causal: 2..10, else 10) key tiles of 32
        (counted,) = [c for n, c in count_program(cm.stages["program"], (q, k, v)).items() if "attention" in n]
        assert counted.mma_instructions == 4 * (30 if causal else 50) * 32, counted.summary()


@pytest.mark.parametrize(("heads", "n_q", "causal"), [(1, 300, False), (1, 300, True), (3, 611, False), (12, 40, True)])
def test_cpu_attention_chunks_of_query_rows(heads: int, n_q: int, causal: bool) -> None:
    """A CPU block owns a chunk of a head's query rows and stages each K/V tile once for all of
    them: chunks of at most 256 rows, smaller when there are few heads (every core two blocks at
    least), the last one ragged; masked rows, ragged key tiles (ViT-like 197 keys) and the
    causal diagonal per row block inside a chunk all match eager."""
    from sextant.schedule.cpu_attention import CHUNK_ROWS

    g = torch.Generator().manual_seed(n_q)
    n_kv = n_q if causal else 197
    q = torch.randn(2, heads, n_q, 32, generator=g)
    k, v = torch.randn(2, heads, n_kv, 32, generator=g), torch.randn(2, heads, n_kv, 32, generator=g)
    mask = torch.rand(2, 1, n_q, n_kv, generator=g) > 0.3
    mask[1, 0, 7] = False  # a row that sees no key: 0 there, as eager
    model, args = (Sdpa(is_causal=True), (q, k, v)) if causal else (Sdpa(), (q, k, v, mask))
    cm = sextant.compile(model, args, target="cpu", cache=False)
    (kernel,) = [kn for kn in cm.stages["program"].kernels.values() if kn.meta.get("mapping") == "attention-cpu-flash"]
    rows, chunk = kernel.meta["rows"], kernel.meta["chunk_rows"]
    assert rows <= chunk <= CHUNK_ROWS and chunk % rows == 0
    # enough heads and rows: a chunk is the whole head (in whole row blocks)
    if 2 * heads >= 2 * (os.cpu_count() or 1) and n_q <= CHUNK_ROWS:
        assert chunk == -(-n_q // rows) * rows
    else:
        assert chunk < n_q
    torch.testing.assert_close(cm(*args), model(*args), rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_cpu_attention_skips_tiles_a_row_block_does_not_see() -> None:
    """A boolean mask hiding whole key tiles from some row blocks of a chunk (the first rows see
    only the first keys, the later ones only the last keys): one pass over the mask per tile finds
    what each row block sees (``vis``); a tile hidden from all is not staged, one hidden from a row
    block is skipped for it — and the result matches eager."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 300, 32, generator=g)
    k, v = torch.randn(2, 1, 400, 32, generator=g), torch.randn(2, 1, 400, 32, generator=g)
    i, j = torch.arange(300)[:, None], torch.arange(400)[None, :]
    mask = torch.where(i < 150, j < 100, j >= 200).expand(2, 1, 300, 400).clone()
    mask[1, 0, 7] = False  # a row that sees no key: 0 there, as eager
    model = Sdpa()
    cm = sextant.compile(model, (q, k, v, mask), target="cpu", cache=False)
    (kernel,) = [kn for kn in cm.stages["program"].kernels.values() if kn.meta.get("mapping") == "attention-cpu-flash"]
    assert kernel.meta["chunk_rows"] > kernel.meta["rows"]  # several row blocks per chunk
    assert any(b.name == "vis" for b in kernel.local)
    for _ in range(2):
        torch.testing.assert_close(cm(q, k, v, mask), model(q, k, v, mask), rtol=TOL[torch.float32],
                                   atol=TOL[torch.float32])
        q, k, v = (torch.randn_like(t) for t in (q, k, v))
