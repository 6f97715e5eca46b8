"""The Hopper flash attention (wgmma fed by TMA, P from registers, sm_90a): chosen for f16/bf16
attention whose Q/K/V TMA can describe, correct through cuda-sim (race-checked, mbarrier phases
included) against eager — causal and not, ragged lengths, one or two warpgroups, heads of 16, 32,
64 and 128, masks, batch and head dims as the tensor maps' outer dimensions, the Q/K/V slices of one
projection — and assembled by ptxas for sm_90a without spills or serialised wgmmas; other
attention keeps the mma.sync flash kernel."""

from __future__ import annotations

import pytest
import torch

import sextant
from sextant.kernel.printer import print_kernel

F = torch.nn.functional
WGMMA = "flash-attention-wgmma-tma"


class Sdpa(torch.nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class Masked(torch.nn.Module):
    """An additive mask and a scale: logit ops fused at each score's (row, key)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)


class FusedQkv(torch.nn.Module):
    """GPT-2's layout: Q, K and V are column slices of one projection (K and V at offsets)."""

    def __init__(self, heads: int, head: int) -> None:
        super().__init__()
        self.heads, self.head = heads, head
        self.proj = torch.nn.Linear(heads * head, 3 * heads * head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.head).transpose(1, 2)
                   for t in self.proj(x).split(self.heads * self.head, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)


def _compile(mod: torch.nn.Module, args: tuple, monkeypatch: pytest.MonkeyPatch,
             arch: str = "sm_90a") -> sextant.CompiledModule:
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")  # shared-memory races and waits that would hang are errors
    return sextant.compile(mod, args, target="cuda-sim", arch=arch)


def _mappings(cm: sextant.CompiledModule) -> list[str]:
    return [k.meta["mapping"] for k in cm.stages["program"].kernels.values()]


def _assembled_cleanly(cm: sextant.CompiledModule) -> None:
    res = cm.stages["ptxas"]
    assert "C7512" not in res.log and "serialized" not in res.log  # no wgmma serialisation
    assert "C7508" not in res.log  # setmaxnreg not ignored: the entry register count is fixed
    assert all(r.spill_stores == r.spill_loads == 0 for r in res.kernels.values())


@pytest.mark.parametrize("shape,causal,dt", [
    ((1, 2, 64, 64), False, torch.float16),
    ((2, 3, 100, 64), True, torch.float16),  # ragged: keys past 100 masked, rows past it not stored
    ((1, 2, 200, 64), True, torch.bfloat16),  # two warpgroups, four key tiles, causal tiles skipped
    ((1, 2, 96, 128), False, torch.float16),  # head 128: two swizzled boxes per row
    ((1, 2, 130, 32), True, torch.float16),  # head 32: 64-byte swizzle
    ((2, 2, 64, 16), False, torch.bfloat16),  # head 16: 32-byte swizzle, P·V of N = 16
])
def test_sdpa_runs_on_wgmma_and_matches_eager(shape: tuple, causal: bool, dt: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    args = tuple(torch.randn(shape).to(dt) for _ in range(3))
    cm = _compile(Sdpa(causal), args, monkeypatch)
    assert _mappings(cm) == [WGMMA]
    fresh = tuple(torch.randn(shape).to(dt) for _ in range(3))
    ref = Sdpa(causal)(*(x.float() for x in fresh))
    tol = 2e-2 if dt == torch.float16 else 5e-2
    torch.testing.assert_close(cm(*fresh).float(), ref, atol=tol, rtol=tol)
    _assembled_cleanly(cm)


class Gqa(torch.nn.Module):
    """Grouped-query attention: 8 query heads share 2 K/V heads — repeated as Llama's ``repeat_kv``
    does (expand + reshape) or by SDPA's ``enable_gqa``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.mode == "enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b, kvh, n, d = k.shape
        rep = q.shape[1] // kvh
        k, v = (t[:, :, None].expand(b, kvh, rep, n, d).reshape(b, kvh * rep, n, d) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", ["repeat_kv", "enable_gqa"])
def test_grouped_query_attention_reads_shared_kv_heads(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repeated K/V are never materialised: each query head's K and V tensor maps address its
    K/V head (the repeat a stride-0 dim the map leaves out; Kᵀ looked through to K's rows)."""
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 8, 100, 64).half(), torch.randn(2, 2, 100, 64).half(), torch.randn(2, 2, 100, 64).half()
    cm = _compile(Gqa(mode), (q, k, v), monkeypatch)
    assert _mappings(cm) == [WGMMA]
    fresh = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
    ref = F.scaled_dot_product_attention(*(x.float() for x in fresh), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(cm(*fresh).float(), ref, atol=2e-2, rtol=2e-2)
    _assembled_cleanly(cm)


def test_kernel_reads_p_from_registers_and_kv_through_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 64, 64).half()
    cm = _compile(Sdpa(), (q, q, q), monkeypatch)
    (kern,) = cm.stages["program"].kernels.values()
    text = print_kernel(kern)
    assert "regs(&fp[" in text and "mn-major" in text  # P·V: A in registers, V read MN-major
    assert text.count("tma_load(") == 3 and "2 (stride 4096) x 64x64" in text  # Q, K, V: a head dim outside
    assert kern.meta["warpgroups"] == 1 and kern.meta["stages"] == 3 and kern.meta["warp_specialized"]
    assert kern.block == (256, 1, 1) and "setmaxnreg_dec(24)" in text and "setmaxnreg_inc(240)" in text
    assert text.count("__syncthreads()") == 1  # the producer and the consumer meet only at mbarriers


@pytest.mark.slow  # ~11 s; make test-slow
def test_checked_build_reports_a_producer_that_would_hang() -> None:
    """The consumers never release a K/V stage: the producer would wait forever for it."""
    import dataclasses

    from sextant.codegen import compile_kernels
    from sextant.codegen.race_check import MbarrierHangError
    from sextant.frontend.capture import capture
    from sextant.graph.passes import run_pipeline
    from sextant.kernel.ir import For, If, MbarrierArrive
    from sextant.schedule.program import schedule
    from sextant.schedule.target import gpu_target

    q = torch.randn(1, 1, 64, 64).half()
    kv = torch.randn(1, 1, 320, 64).half()  # 5 key tiles: the producer waits from its second on
    program = schedule(run_pipeline(capture(Sdpa(), (q, kv, kv))), gpu_target("sm_90a"))
    (kern,) = program.kernels.values()

    def drop_release(s):  # type: ignore[no-untyped-def]
        if isinstance(s, For):
            return dataclasses.replace(s, body=tuple(drop_release(x) for x in s.body
                                                     if not (isinstance(x, MbarrierArrive) and x.tx == 0)))
        if isinstance(s, If):
            return If(s.cond, tuple(drop_release(x) for x in s.then), tuple(drop_release(x) for x in s.orelse))
        return s

    bad = dataclasses.replace(kern, body=tuple(drop_release(s) for s in kern.body))
    assert bad != kern
    good = compile_kernels([kern], check_races=True)
    out = torch.zeros(1, 1, 64, 64).half()
    good.launch(kern.name, [q, kv, out])  # K and V are one tensor: one buffer
    torch.testing.assert_close(out.float(), Sdpa()(q.float(), kv.float(), kv.float()), atol=2e-2, rtol=2e-2)
    with pytest.raises(MbarrierHangError, match="mbarrier bar"):
        compile_kernels([bad], check_races=True).launch(bad.name, [q, kv, torch.zeros(1, 1, 64, 64).half()])


def test_additive_mask_and_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 72, 64).half() for _ in range(3))
    mask = torch.randn(2, 1, 72, 72).half()
    cm = _compile(Masked(), (q, k, v, mask), monkeypatch)
    assert WGMMA in _mappings(cm)
    ref = Masked()(q.float(), k.float(), v.float(), mask.float())
    torch.testing.assert_close(cm(q, k, v, mask).float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # ~13 s; make test-slow
def test_slices_of_one_projection_are_read_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """K and V start 128 and 256 elements into each row of the projection's output: the offset
    becomes a shift of the head coordinate, so no copy is made."""
    torch.manual_seed(2)
    mod = FusedQkv(2, 64).half()
    x = torch.randn(2, 90, 128).half()
    cm = _compile(mod, (x,), monkeypatch)
    kern = next(k for k in cm.stages["program"].kernels.values() if k.meta["mapping"] == WGMMA)
    assert "[2 (stride 34560) x 4 (stride 64) x 90x64, stride 384]" in print_kernel(kern)
    x2 = torch.randn(2, 90, 128).half()
    torch.testing.assert_close(cm(x2).float(), mod.float()(x2.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # ~30–38 s a dtype of cuda-sim; make test-slow
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_gpt2_two_layers_attention_on_wgmma(dt: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, n_positions=128, vocab_size=256,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2Model(cfg).eval().to(dt)

    class Hidden(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.m(ids).last_hidden_state

    ids = torch.randint(0, 256, (2, 100))
    cm = _compile(Hidden(model), (ids,), monkeypatch)
    maps = _mappings(cm)
    assert WGMMA in maps and "flash-attention-tensor-core" not in maps and "wgmma-tma" in maps
    ids2 = torch.randint(0, 256, (2, 100))
    ref = Hidden(model.float())(ids2)
    tol = 2e-2 if dt == torch.float16 else 8e-2
    torch.testing.assert_close(cm(ids2).float(), ref, atol=tol, rtol=tol)
    _assembled_cleanly(cm)


@pytest.mark.slow  # ~20 s a case; make test-slow
@pytest.mark.parametrize("head,arch,expected", [
    (48, "sm_90a", "flash-attention-tensor-core"),  # not a whole swizzled row
    (64, "sm_90", "flash-attention-tensor-core"),  # wgmma needs sm_90a
])
def test_other_attention_keeps_mma_sync(head: int, arch: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 64, head).half()
    cm = _compile(Sdpa(), (q, q, q), monkeypatch, arch=arch)
    assert _mappings(cm) == [expected]
    torch.testing.assert_close(cm(q, q, q).float(), Sdpa()(q.float(), q.float(), q.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # ~18 s: the mma.sync flash kernel through cuda-sim
def test_operands_tma_cannot_describe_keep_mma_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """K as a slice starting mid-row of the head dim: no outer shift expresses the offset."""

    class Shifted(torch.nn.Module):
        def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, kv[..., 8:72], kv[..., 8:72])

    q, kv = torch.randn(1, 2, 64, 64).half(), torch.randn(1, 2, 64, 80).half()
    cm = _compile(Shifted(), (q, kv), monkeypatch)
    assert WGMMA not in _mappings(cm)
    ref = Shifted()(q.float(), kv.float())
    torch.testing.assert_close(cm(q, kv).float(), ref, atol=2e-2, rtol=2e-2)
