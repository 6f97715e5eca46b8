"""A Llama-style decoder and its Megatron-style tensor-parallel plan, as users write them with
``torch.distributed.tensor.parallel``: the model of the collective tests (tests/collectives) and of
``dist_bench``. Built from a config with random weights (no hub)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = _Attention(dim, heads)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """A Llama-style decoder: RMSNorm, causal attention (no rotary embedding), SwiGLU MLP."""

    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tensor_parallel(model: TinyLlama, mesh: Any) -> TinyLlama:
    """Megatron-style TP as users write it: q/k/v and gate/up column-parallel, o and down row-parallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.layers)):
        for name in ("attn.q", "attn.k", "attn.v", "gate", "up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "down"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)
