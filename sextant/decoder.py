"""A Llama-style decoder with a static KV cache: the LLM-decoding workload (issue 22).

Written for compilers rather than for training: every call has a fixed shape. The K/V cache of
each layer is a registered buffer of its full length (``max_cache_len``), updated *in place* at
the positions being computed (``k_cache[:, :, input_pos] = k``, an ``index_put`` that
torch.export records as a BUFFER_MUTATION), and attention always runs over the whole cache with
a boolean mask row per query position (taken from a registered causal-mask buffer). So a model
needs exactly two programs whatever the sequence length so far: one prefill-shaped
(``[B, prompt]`` ids) and one decode-shaped (``[B, 1]``), and both share the same cache buffers
when they are compiled from the same module object.

The architecture is Llama's: RMSNorm before attention and MLP, rotary position embeddings
(cos/sin tables precomputed for every position and indexed by ``input_pos``), grouped-query
attention (``n_kv_heads`` K/V heads, each serving ``n_heads // n_kv_heads`` query heads), and a
SwiGLU MLP. Weights are random (seeded), never downloaded: the workload is about bytes moved and
FLOPs done, which do not depend on what the weights are.

    model = Decoder(DecoderConfig.tiny(), batch=1)
    tokens = greedy_generate(model, prompt_ids, n_new=16)   # any step_fn(ids, input_pos) -> logits
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a :class:`Decoder`. ``max_cache_len`` is also the longest sequence (prompt plus
    generated tokens) the model can handle: the cache is static, so it bounds positions."""

    vocab_size: int = 32000
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 4  # grouped-query attention: n_heads // n_kv_heads query heads per K/V head
    ffn_hidden: int = 2048  # SwiGLU's hidden width
    max_cache_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the LM head reuses the token embedding matrix

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def max_seq_len(self) -> int:
        """The longest sequence: the static cache's length."""
        return self.max_cache_len

    @classmethod
    def tiny(cls, **overrides: Any) -> DecoderConfig:
        """Three layers of width 64 (4 heads over 2 K/V heads), vocabulary 256, cache 64: the
        100M model's structure at test size (a millisecond per step)."""
        return replace(cls(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=172,
                           max_cache_len=64), **overrides)

    @classmethod
    def llama_100m(cls, **overrides: Any) -> DecoderConfig:
        """~100M parameters (100.1M: 12 layers × 768, 12 heads over 4 K/V heads, SwiGLU 2048,
        vocabulary 32000 with the head tied to the embedding), cache 256 = a 128-token prompt
        plus 128 generated tokens. Big enough that a decode step is bound by reading the weights
        (~400 MB in fp32), small enough for a CPU."""
        return replace(cls(), **overrides)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``: Llama's normalisation (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, ``[max_len, head_dim]`` each, in the
    rotate-half layout (channel ``i`` and ``i + head_dim/2`` form one rotated pair, so both halves
    repeat the same ``head_dim/2`` frequencies). Computed in float64, stored in float32: the
    angles of late positions lose digits in float32 arithmetic."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[B, heads, S, head_dim]``) by the angles of its positions (``cos``/``sin``:
    ``[S, head_dim]``, rows already selected by position). Slices, a negation and a concat rather
    than complex numbers: plain elementwise work any compiler fuses."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    """One layer's keys and values for every position, ``[B, n_kv_heads, max_cache_len, head_dim]``.

    Registered buffers (not persistent: the state dict stays weights only), written in place, so
    that a compiled program sees the cache as module state it mutates, not as an input it returns
    a new copy of."""

    def __init__(self, batch: int, n_kv_heads: int, max_cache_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_cache_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` (``[B, n_kv_heads, S, head_dim]``) at ``input_pos`` (``[S]``) and
        return the whole caches."""
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache

    def reset(self) -> None:
        self.k_cache.zero_()
        self.v_cache.zero_()


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, n_kv, L, D]`` → ``[B, n_kv * groups, L, D]``, K/V head ``j`` serving query heads
    ``j * groups … j * groups + groups - 1`` (what ``repeat_interleave(groups, dim=1)`` gives),
    written as expand + reshape: movement ops, no gather."""
    if groups == 1:
        return x
    b, h, length, d = x.shape
    return x[:, :, None].expand(b, h, groups, length, d).reshape(b, h * groups, length, d)


class Attention(nn.Module):
    """Grouped-query self-attention over the layer's KV cache."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.kv_cache: KVCache | None = None  # set by Decoder.setup_cache

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated) and values of ``x``: ``[B, heads, S, head_dim]``."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("no KV cache: call Decoder.setup_cache(batch) first")
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        k, v = self.kv_cache.update(input_pos, k, v)
        groups = self.n_heads // self.n_kv_heads
        # The whole cache, every call: a fixed shape. Slots after the current position hold zeros
        # (or stale values of an earlier sequence); the mask row hides them.
        y = F.scaled_dot_product_attention(q, expand_kv(k, groups), expand_kv(v, groups), attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.up = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.down = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``+ mlp(norm(·))``."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """The decoder: ``forward(idx [B, S], input_pos [S]) -> logits [B, S, vocab]``.

    ``input_pos`` are the positions of ``idx``'s tokens (``arange(S)`` for a prefill, ``[t]`` for
    the decode step at position ``t``); the same positions for every sequence of the batch. The
    caches are allocated for ``batch`` sequences here and by :meth:`setup_cache`.

    Weights are drawn from ``seed`` in a forked RNG (the global one is left as it was), so two
    ``Decoder(config, seed=s)`` are the same model — in another process too. Every matrix is
    N(0, 1/fan_in) (the embedding's fan-in taken as ``dim``): each layer's output has unit scale,
    the embedding a small one, so the residual stream is not dominated by the input token's
    embedding — with the tied head that made a random model repeat its last prompt token forever,
    a workload on which a broken cache goes unnoticed. Logits come out with unit scale."""

    def __init__(self, config: DecoderConfig, *, batch: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
            if config.tie_embeddings:
                self.output.weight = self.tok_embeddings.weight
            self._init_weights()
        cos, sin = rope_tables(config.head_dim, config.max_cache_len, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        causal = torch.tril(torch.ones(config.max_cache_len, config.max_cache_len, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)
        self.setup_cache(batch)

    @torch.no_grad()
    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, m.embedding_dim ** -0.5)
            elif isinstance(m, nn.Linear) and not (m is self.output and self.config.tie_embeddings):
                m.weight.normal_(0.0, m.in_features ** -0.5)

    def setup_cache(self, batch: int, dtype: torch.dtype | None = None) -> None:
        """(Re)allocate every layer's KV cache for ``batch`` sequences, zeroed; ``dtype`` defaults
        to the weights'. Replaces the buffers: a program compiled before holds the old ones."""
        dtype = dtype or self.tok_embeddings.weight.dtype
        device = self.tok_embeddings.weight.device
        c = self.config
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, c.n_kv_heads, c.max_cache_len, c.head_dim, dtype).to(device)
        self.cache_batch = batch

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero every cache in place (the same buffers: compiled programs keep seeing them).
        Not needed between sequences for correctness — the mask hides every slot after the
        current position — but it makes a run independent of the one before."""
        for layer in self.layers:
            layer.attention.kv_cache.reset()

    def caches(self) -> list[KVCache]:
        return [layer.attention.kv_cache for layer in self.layers]

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, S, max_cache_len]: row t lets 0..t through
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))


@torch.no_grad()
def greedy_generate(step_fn: StepFn, prompt_ids: torch.Tensor, n_new: int, *,
                    max_cache_len: int | None = None) -> torch.Tensor:
    """Greedy decoding: a prefill of ``prompt_ids`` (``[B, S]``, positions ``0 … S-1``), whose last
    logits give the first new token, then ``n_new`` one-token decode steps (positions ``S … S +
    n_new - 1``), each fed the token chosen before it. Returns the ``n_new + 1`` chosen tokens,
    ``[B, n_new + 1]`` (the prompt not included).

    ``step_fn(ids, input_pos) -> logits [B, S, vocab]`` is anything that runs the model on its
    cache: the eager :class:`Decoder`, ``torch.compile(model)``, ``sextant.compile``'d programs
    (one per shape, sharing the module's buffers). It makes exactly ``1 + n_new`` calls, the
    first prefill-shaped and the rest decode-shaped, so a caller can time them by wrapping it.
    ``max_cache_len``, if given, is checked against the last position."""
    s = prompt_ids.shape[1]
    if max_cache_len is not None and s + n_new > max_cache_len:
        raise ValueError(f"prompt {s} + {n_new} decode steps needs {s + n_new} cache slots, have {max_cache_len}")
    device = prompt_ids.device
    logits = step_fn(prompt_ids, torch.arange(s, device=device))
    token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    tokens = [token]
    for t in range(s, s + n_new):
        logits = step_fn(token, torch.tensor([t], device=device))
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1)
