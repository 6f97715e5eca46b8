"""sextant.decoder: the KV-cached decoder against a cache-free recomputation, and its benchmark.

The reference below shares the model's weights and its norms/projections/MLP modules, but not its
attention: it recomputes every position's keys and values from the whole prefix at each step
(rotary angles from the formula, causal softmax written out, K/V heads repeated with
``repeat_interleave``), so a wrong cache slot, mask row, rotation position or head grouping in the
model shows up as a different token or logit.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sextant.decoder import Decoder, DecoderConfig, expand_kv, greedy_generate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    """Tiny tensors: one intra-op thread is enough, and under a loaded machine two spin-waiting
    OpenMP threads made a 0.5 s test take 15 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, H, T, D] at positions 0..T-1, pairs (i, i + D/2)."""
    t, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def reference(model: Decoder, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Logits of every position of ``ids`` [B, T] with no cache, and each layer's (K, V)
    [B, n_kv_heads, T, head_dim] (K rotated), recomputed from the whole prefix."""
    c = model.config
    b, t = ids.shape
    groups = c.n_heads // c.n_kv_heads
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = model.tok_embeddings.weight[ids]
    kvs = []
    for layer in model.layers:
        a = layer.attention
        h = layer.attention_norm(x)
        q = _rotate((h @ a.wq.weight.T).view(b, t, c.n_heads, c.head_dim).transpose(1, 2), c.rope_base)
        k = _rotate((h @ a.wk.weight.T).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2), c.rope_base)
        v = (h @ a.wv.weight.T).view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        kvs.append((k, v))
        scores = q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2) / math.sqrt(c.head_dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (probs @ v.repeat_interleave(groups, dim=1)).transpose(1, 2).reshape(b, t, c.dim)
        x = x + y @ a.wo.weight.T
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.norm(x) @ model.output.weight.T, kvs


def _reference_generate(model: Decoder, prompt: torch.Tensor, n_new: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    seq, tokens, logits = prompt, [], []
    for _ in range(n_new + 1):
        last = reference(model, seq)[0][:, -1]
        token = last.argmax(-1, keepdim=True)
        seq = torch.cat([seq, token], dim=1)
        tokens.append(token)
        logits.append(last)
    return torch.cat(tokens, dim=1), logits


def _prompt(config: DecoderConfig, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("batch", "tie"), [(1, True), (3, True), (2, False)])
def test_greedy_generate_matches_cache_free_reference(batch: int, tie: bool) -> None:
    config = DecoderConfig.tiny(tie_embeddings=tie)
    model = Decoder(config, batch=batch).eval()
    prompt, n_new = _prompt(config, batch, 9), 20
    seen: list[torch.Tensor] = []

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = model(ids, pos)
        seen.append(out[:, -1])
        return out

    tokens = greedy_generate(step, prompt, n_new, max_cache_len=config.max_cache_len)
    expected, expected_logits = _reference_generate(model, prompt, n_new)
    assert tokens.shape == (batch, n_new + 1)
    assert torch.equal(tokens, expected)
    assert len(set(tokens.flatten().tolist())) > 5, "a degenerate workload: the random model repeats itself"
    for got, want in zip(seen, expected_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cache_after_prefill_holds_recomputed_keys_and_values() -> None:
    config = DecoderConfig.tiny()
    model = Decoder(config, batch=2).eval()
    prompt = _prompt(config, 2, 11)
    with torch.no_grad():
        logits = model(prompt, torch.arange(11))
    ref_logits, kvs = reference(model, prompt)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for cache, (k, v) in zip(model.caches(), kvs, strict=True):
        assert cache.k_cache.shape == (2, config.n_kv_heads, config.max_cache_len, config.head_dim)
        torch.testing.assert_close(cache.k_cache[:, :, :11], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v_cache[:, :, :11], v, rtol=1e-5, atol=1e-5)
        assert not cache.k_cache[:, :, 11:].any() and not cache.v_cache[:, :, 11:].any()


def test_stale_cache_is_masked_and_reset_zeroes_the_same_buffers() -> None:
    config = DecoderConfig.tiny()
    model = Decoder(config).eval()
    first = greedy_generate(model, _prompt(config, 1, 12, seed=2), 30)  # fills slots 0..41
    buffers = [c.k_cache for c in model.caches()]
    short = _prompt(config, 1, 5, seed=3)
    again = greedy_generate(model, short, 6)  # no reset: slots 11.. still hold the first sequence's K/V
    model.reset_cache()
    assert all(c.k_cache is b and not b.any() for c, b in zip(model.caches(), buffers))
    assert torch.equal(again, greedy_generate(model, short, 6))
    assert not torch.equal(first[:, :7], again)  # (the two sequences differ at all)


def test_setup_cache_and_bounds() -> None:
    config = DecoderConfig.tiny()
    model = Decoder(config, batch=1)
    model.setup_cache(4)
    assert all(c.k_cache.shape[0] == 4 and c.v_cache.shape[0] == 4 for c in model.caches())
    assert model.state_dict().keys() == Decoder(config).state_dict().keys()  # caches, tables not saved
    with pytest.raises(ValueError, match="cache slots"):
        greedy_generate(model, _prompt(config, 4, 60), 10, max_cache_len=config.max_cache_len)
    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(expand_kv(x, 4), x.repeat_interleave(4, dim=1))


def test_same_seed_same_weights_and_presets() -> None:
    a, b = Decoder(DecoderConfig.tiny(), seed=7), Decoder(DecoderConfig.tiny(), seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    big = DecoderConfig.llama_100m()
    assert (big.n_layers, big.dim, big.n_heads, big.n_kv_heads, big.vocab_size) == (12, 768, 12, 4, 32000)
    assert big.max_cache_len >= 256


def test_export_records_each_cache_update_as_a_buffer_mutation() -> None:
    model = Decoder(DecoderConfig.tiny(n_layers=2))
    ep = torch.export.export(model, (torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]))).run_decompositions()
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == sorted(
        f"layers.{i}.attention.kv_cache.{kv}_cache" for i in range(2) for kv in "kv")


@pytest.mark.slow  # ~1-2 min on 2 cores: Inductor compiles the tiny model twice per batch
def test_decode_bench_quick_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "sextant.tools.decode_bench", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout
    assert "| path | batch |" in table and "GB/s" in table
    for path in ("eager", "inductor", "sextant"):
        assert f"| {path} | 1 |" in table and f"| {path} | 2 |" in table
    assert "MISMATCH" not in table
