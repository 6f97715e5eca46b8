"""Split-key ("flash-decoding") attention on the GPU (``schedule/gpu_flash_decoding.py``): decode
shapes — a few query rows against many keys — become a partials kernel over key splits and a
combine, run through cuda-sim against eager PyTorch; key tiles a static-cache mask hides are
skipped; prefill shapes keep the tensor-core flash kernel; ptxas assembles both kernels unspilled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
from sextant.graph.passes import run_pipeline
from sextant.schedule.gpu_flash_decoding import KEY_TILE, MIN_KEYS
from sextant.schedule.program import schedule
from sextant.schedule.target import gpu_target

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
PARTIALS, COMBINE = "attention-split-key-partials", "attention-split-key-combine"


class Sdpa(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class GqaStep(nn.Module):
    """A decode step's attention as ``sextant.decoder`` writes it: K/V heads repeated by expand,
    the static cache's boolean mask, and a residual add the combine fuses as its epilogue."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = groups

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                res: torch.Tensor) -> torch.Tensor:
        b, h, s, d = k.shape
        k = k[:, :, None].expand(b, h, self.groups, s, d).reshape(b, h * self.groups, s, d)
        v = v[:, :, None].expand(b, h, self.groups, s, d).reshape(b, h * self.groups, s, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + res


def _static_cache_mask(batch: int, rows: int, keys: int, pos: list[int]) -> torch.Tensor:
    """Row ``t`` of batch ``b`` sees keys ``0 .. pos[b] + t`` (the rest of the cache is stale)."""
    j = torch.arange(keys)
    return torch.stack([(j[None] <= (p + torch.arange(rows))[:, None])[None] for p in pos])


def _mappings(cm: object) -> list[str]:
    program = cm.stages["program"]  # type: ignore[attr-defined]
    return [program.kernels[la.kernel].meta.get("mapping", "") for la in program.launches
            if program.groups[la.group].kind == "attention"]


def _eager(model: nn.Module, args: tuple) -> torch.Tensor:
    return model(*(a.float() if a.is_floating_point() else a for a in args))


def _inputs(dtype: torch.dtype, batch: int, heads: int, kv_heads: int, rows: int, keys: int, d: int = 64,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, rows, d, generator=g).to(dtype),
            torch.randn(batch, kv_heads, keys, d, generator=g).to(dtype),
            torch.randn(batch, kv_heads, keys, d, generator=g).to(dtype))


CASES = [  # dtype, batch, rows, keys, mask
    (torch.float32, 1, 1, 256, "static"),
    (torch.float16, 1, 1, 1024, "static"),
    (torch.bfloat16, 3, 1, 512, "static"),
    (torch.float16, 3, 4, 300, "static"),
    (torch.float32, 1, 4, 1024, "none"),
    (torch.float16, 3, 1, 257, "bool"),
    (torch.bfloat16, 1, 4, 256, "additive"),
    (torch.float32, 3, 16, 384, "bool"),
]


@pytest.mark.parametrize("dtype,batch,rows,keys,mask", CASES)
def test_decode_attention_matches_eager(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, batch: int,
                                        rows: int, keys: int, mask: str) -> None:
    """Grouped-query heads (4 over 2), race-checked on cuda-sim, within the dtype's tolerance of f32 eager."""
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    q, k, v = _inputs(dtype, batch, 4, 2, rows, keys, seed=keys + rows)
    g = torch.Generator().manual_seed(1)
    if mask == "static":
        m = _static_cache_mask(batch, rows, keys, [min(keys - rows, 5 + 97 * b) for b in range(batch)])
    elif mask == "bool":  # row 0 of batch 0 sees no key: the guard gives 0, as eager does
        m = torch.rand(batch, 1, rows, keys, generator=g) > 0.3
        m[0, 0, 0] = False
    elif mask == "additive":
        m = torch.randn(batch, 1, rows, keys, generator=g).to(dtype)
    else:
        m = torch.ones(batch, 1, rows, keys, dtype=torch.bool)
    res = torch.randn(batch, 4, rows, 64, generator=g).to(dtype)
    model, args = GqaStep(2), (q, k, v, m, res)
    cm = sextant.compile(model, args, target="cuda-sim", cache=False)
    assert _mappings(cm) == [PARTIALS, COMBINE]
    torch.testing.assert_close(cm(*args).float(), _eager(model, args), rtol=TOL[dtype], atol=TOL[dtype])
    for _ in range(2):  # fresh inputs through the same compiled module (the scratch is rewritten each call)
        q2, k2, v2 = (torch.randn_like(x.float()).to(dtype) for x in (q, k, v))
        args = (q2, k2, v2, m, res)
        torch.testing.assert_close(cm(*args).float(), _eager(model, args), rtol=TOL[dtype], atol=TOL[dtype])


def test_unmasked_decode_without_gqa() -> None:
    q, k, v = _inputs(torch.float16, 1, 12, 12, 1, 512, seed=3)
    cm = sextant.compile(Sdpa(), (q, k, v), target="cuda-sim", cache=False)
    assert _mappings(cm) == [PARTIALS, COMBINE]
    torch.testing.assert_close(cm(q, k, v).float(), _eager(Sdpa(), (q, k, v)), rtol=4e-3, atol=4e-3)


def test_hidden_key_tiles_are_skipped() -> None:
    """Keys past the current position are never read: poisoning them with NaN leaves the result
    finite and equal to eager on clean values (a computed, masked tile would give 0 · NaN = NaN);
    a split whose every key is hidden (most of them here) adds nothing in the combine."""
    batch, rows, keys, pos = 2, 1, 1024, [3, 200]
    q, k, v = _inputs(torch.float16, batch, 4, 2, rows, keys, seed=7)
    mask = _static_cache_mask(batch, rows, keys, pos)
    res = torch.zeros(batch, 4, rows, 64, dtype=torch.float16)
    model = GqaStep(2)
    cm = sextant.compile(model, (q, k, v, mask, res), target="cuda-sim", cache=False)
    (partials,) = [k_ for k_ in cm.stages["program"].kernels.values() if k_.meta.get("mapping") == PARTIALS]
    assert partials.meta["skips_hidden_tiles"]
    expected = _eager(model, (q, k, v, mask, res))
    kp, vp = k.clone(), v.clone()
    for b, p in enumerate(pos):  # whole tiles past the position's tile
        start = (p // KEY_TILE + 1) * KEY_TILE
        kp[b, :, start:], vp[b, :, start:] = float("nan"), float("nan")
    out = cm(q, kp, vp, mask, res).float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=4e-3, atol=4e-3)


def test_skipped_tiles_read_nothing_counters() -> None:
    """cuda-sim's counters (block 0: the first split, the first 64 keys) with those keys visible and
    hidden (left padding): hidden, block 0 reads Q and the mask, not one row of K or V."""
    from sextant.runtime.counting import count_program

    q, k, v = _inputs(torch.float16, 1, 1, 1, 1, 256, seed=2)
    counts = {}
    for name, start in (("visible", 0), ("hidden", 128)):
        mask = torch.arange(256)[None, None, None] >= start
        program = sextant.compile(Sdpa(), (q, k, v, mask), target="cuda-sim", cache=False).stages["program"]
        (counts[name],) = [c for n, c in count_program(program, (q, k, v, mask)).items()
                           if program.kernels[n].meta["mapping"] == PARTIALS]
    visible, hidden = counts["visible"], counts["hidden"]
    assert hidden.global_load_requests < visible.global_load_requests / 4, (visible.summary(), hidden.summary())


@pytest.mark.parametrize("rows,keys,expected", [
    (1, MIN_KEYS, [PARTIALS, COMBINE]),
    (16, 512, [PARTIALS, COMBINE]),
    (17, 512, ["flash-attention-tensor-core"]),  # more rows than a decode step: tensor cores pay
    (128, 512, ["flash-attention-tensor-core"]),  # prefill
    (1, 64, ["flash-attention-tensor-core"]),  # too few keys to split
])
def test_chosen_for_decode_shapes_only(rows: int, keys: int, expected: list[str]) -> None:
    q, k, v = _inputs(torch.float16, 1, 4, 4, rows, keys)
    program = schedule(run_pipeline(sextant.capture(Sdpa(), (q, k, v))), gpu_target("sm_90"))
    assert [program.kernels[la.kernel].meta["mapping"] for la in program.launches] == expected


def test_f32_decode_fuses_on_the_gpu_but_f32_prefill_does_not() -> None:
    """SIMT, so f32 attention fuses for a decode step; a longer f32 query keeps three kernels."""
    for rows, fused in ((1, True), (64, False)):
        q, k, v = _inputs(torch.float32, 1, 2, 2, rows, 256)
        program = schedule(run_pipeline(sextant.capture(Sdpa(), (q, k, v))), gpu_target("sm_90"))
        assert ("attention" in [g.kind for g in program.groups]) is fused


def test_splits_fill_the_sms_and_the_dump_says_so() -> None:
    """Batch 1, 12 heads, 4096 keys on 132 SMs: ~2 blocks per SM in whole tiles."""
    q, k, v = _inputs(torch.float16, 1, 12, 12, 1, 4096)
    program = schedule(run_pipeline(sextant.capture(Sdpa(), (q, k, v))), gpu_target("sm_90"))
    partials, combine = (program.kernels[la.kernel] for la in program.launches)
    assert partials.grid == (22, 12, 1) and combine.meta["mapping"] == COMBINE
    dump = program.describe()
    assert "split-key: 22 splits of 192 keys (3 tiles of 64)" in dump
    assert "temp:f32[22,12,66]" in dump and "[combine" in dump


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_decode_kernels_assemble_without_spills(arch: str) -> None:
    from sextant.codegen.llvm_nvptx import emit_ptx
    from sextant.codegen.ptxas import assemble

    for dtype, rows, d, masked in ((torch.float16, 1, 64, True), (torch.float32, 1, 128, False),
                                   (torch.bfloat16, 4, 128, True), (torch.float16, 16, 128, True)):
        q, k, v = _inputs(dtype, 1, 4, 4, rows, 512, d=d)
        mask = (torch.arange(512)[None, None, None] <= 100 + torch.arange(rows)[:, None]) if masked else None
        args = (q, k, v) + ((mask,) if masked else ())
        program = schedule(run_pipeline(sextant.capture(Sdpa(), args)), gpu_target(arch))
        assert [k_.meta["mapping"] for k_ in program.kernels.values()] == [PARTIALS, COMBINE]
        res = assemble(emit_ptx(list(program.kernels.values()), arch=arch).ptx, arch)
        for name, r in res.kernels.items():
            assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (dtype, rows, d, name, r)


@pytest.mark.slow  # ~33 s of cuda-sim; make test-slow
def test_decoder_steps_on_cuda_sim_match_eager() -> None:
    """``sextant.decoder`` (one layer) with a 256-slot static cache (fp16, 4 heads over 2): a prefill, then decode
    steps whose attention is split-key, updating the caches in place; the tokens are eager's."""
    from sextant.decoder import Decoder, DecoderConfig, greedy_generate

    torch.manual_seed(0)
    config = DecoderConfig.tiny(max_cache_len=256, n_layers=1)
    eager, model = Decoder(config).eval().half(), Decoder(config).eval().half()
    model.load_state_dict(eager.state_dict())
    prompt = torch.randint(0, config.vocab_size, (1, 9))
    prefill = sextant.compile(model, (prompt, torch.arange(9)), target="cuda-sim", cache=False)
    decode = sextant.compile(model, (prompt[:, :1], torch.tensor([9])), target="cuda-sim", cache=False)
    assert _mappings(decode) == [PARTIALS, COMBINE] * config.n_layers

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return (prefill if ids.shape[1] > 1 else decode)(ids, pos)

    with torch.no_grad():
        want = greedy_generate(eager, prompt, 6)
        got = greedy_generate(step, prompt, 6)
    assert torch.equal(got, want)


def test_artifact_round_trip_and_cost_of_a_chain(tmp_path: object) -> None:
    """The scratch buffer is a node of the program's graph: an artifact saves and loads it like any
    temporary; the cost report gives the FLOPs to the partials launch, the scratch to both."""
    from sextant.report.cost import program_costs
    from sextant.runtime import artifact

    q, k, v = _inputs(torch.float16, 1, 4, 4, 1, 300)
    cm = sextant.compile(Sdpa(), (q, k, v), target="cuda-sim", cache=False)
    loaded = artifact.load(artifact.save(cm, f"{tmp_path}/decode"))
    torch.testing.assert_close(loaded(q, k, v), cm(q, k, v), rtol=0, atol=0)
    partials, combine = program_costs(cm.stages["program"])
    scratch = 5 * 4 * 66 * 4  # 5 splits x 4 heads x (64 + m + l) f32
    assert partials.flops > 0 and partials.bytes_written == scratch
    assert combine.flops == 0 and combine.bytes_read == scratch and combine.bytes_written == 4 * 64 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_sizes_that_are_not_multiples_of_the_block(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Head 80 for Q·Kᵀ, 48 for V, 3 query rows: the accumulators' rows and columns are computed per
    element (no constant row per accumulator), the last ones clamped and never stored."""
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 3, 80, generator=g).to(dtype), torch.randn(2, 3, 300, 80, generator=g).to(dtype),
               torch.randn(2, 3, 300, 48, generator=g).to(dtype))
    mask = _static_cache_mask(2, 3, 300, [40, 280])
    cm = sextant.compile(Sdpa(), (q, k, v, mask), target="cuda-sim", cache=False)
    assert _mappings(cm) == [PARTIALS, COMBINE]
    torch.testing.assert_close(cm(q, k, v, mask).float(), _eager(Sdpa(), (q, k, v, mask)),
                               rtol=TOL[dtype], atol=TOL[dtype])
