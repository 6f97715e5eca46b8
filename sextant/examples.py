"""Built-in example models (random weights, no downloads) used by the demo, the tests and benchmarks.

Each factory returns ``(module, example_args)`` with the module in eval mode.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (64, 128, 128, 10)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class CNN(nn.Module):
    """Conv + BatchNorm (eval) + ReLU + max/avg pooling + linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(2)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.avg(F.relu(self.bn2(self.conv2(x))))
        x = x.mean(dim=(2, 3))
        return self.head(x)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: causal multi-head self-attention (SDPA) + GELU MLP, with residuals."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyBlock(nn.Module):
    """LayerNorm → Linear → GELU with a residual: the docs' running example, small enough to read
    whole (not in ``EXAMPLES``: the four models there are the test suite's)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class GPT2Logits(nn.Module):
    """Wraps a transformers GPT-2 so that export sees tensors only (no KV cache in the output)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class Regressor(nn.Module):
    """Linear, LayerNorm, GELU, Linear and an MSE loss: the model docs/training.md trains."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.fc1(x))
        h = F.gelu(h)
        return F.mse_loss(self.fc2(h), target)


def mlp(batch: int = 8) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return MLP().eval(), (torch.randn(batch, 64),)


def cnn(batch: int = 2) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = CNN().eval()
    for bn in (model.bn1, model.bn2):  # non-trivial running statistics
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
    return model, (torch.randn(batch, 3, 32, 32),)


def transformer_block(batch: int = 2, seq: int = 16) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return TransformerBlock().eval(), (torch.randn(batch, seq, 64),)


def gpt2(n_layer: int = 2, n_embd: int = 128, n_head: int = 4, batch: int = 1, seq: int = 32,
         vocab: int = 1000, attn: str = "eager") -> tuple[nn.Module, tuple]:
    """GPT-2 from transformers, built from a small config with random weights (no hub access).

    ``attn`` is transformers' ``attn_implementation``: "eager" (explicit matmul/softmax ops) or
    "sdpa" (transformers' default, one ``scaled_dot_product_attention`` call per layer).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:  # transformers is a test/dev extra
        raise ImportError("the gpt2 example needs `transformers` (pip install 'sextant[dev]')") from e
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                        n_positions=max(seq, 64), bos_token_id=0, eos_token_id=0,
                        attn_implementation=attn)
    model = GPT2Logits(GPT2LMHeadModel(config)).eval()
    return model, (torch.randint(0, vocab, (batch, seq)),)


EXAMPLES: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer-block": transformer_block,
    "gpt2": gpt2,
}
