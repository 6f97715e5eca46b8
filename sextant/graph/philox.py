"""Philox4x32-10: the counter-based random numbers behind the graph IR's ``random`` op.

A counter-based generator (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11)
maps a 128-bit counter and a 64-bit key to four 32-bit words through ten rounds of multiplies
and xors. Element ``i`` of a random tensor needs no state from element ``i - 1``: every thread
of a kernel computes its own number from (key, counter) alone, so a GPU kernel, the CPU build
of the same kernel and this reference give the same bits, whatever the launch shape. This is
the generator CUDA's cuRAND, JAX and torch's CUDA backend use.

sextant's stream: key = the 64-bit seed drawn from torch's generator at each call (so
``torch.manual_seed`` makes runs reproducible); counter = (low word, high word of ``index +
offset``, the op's ``stream`` number, 0), where ``index`` is the element's row-major index and
``offset`` the seed's bits 1..62 (``OFFSET``). Two ``random`` ops of one graph differ by their
stream. The offset makes every counter depend on the call, as torch's own (seed, offset) Philox
state does: without it the first round's products of the element index would be compile-time
constants, which constant folding would store as tables (8 bytes an element) instead of
computing them.
Numbers differ from eager torch's (its CPU generator is a Mersenne twister): tests compare
statistics, never bits with eager.

This module is the reference (torch int64 arithmetic, 32-bit words kept in the low half);
``graph/passes/expand_random.py`` spells the same rounds out as graph-IR integer ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key schedule: the golden ratio and sqrt(3) - 1, as 32-bit fractions
ROUNDS = 10
MASK = 0xFFFFFFFF
OFFSET = (1 << 62) - 1  # the counter offset is (seed >> 1) & OFFSET: index + offset stays below 2**63
# bits of a 32-bit word a uniform of each float type keeps: exactly representable in [0, 1)
MANTISSA = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def philox4x32(ctr: Sequence[torch.Tensor], key: Sequence[torch.Tensor | int],
               rounds: int = ROUNDS) -> tuple[torch.Tensor, ...]:
    """The four output words for counters ``ctr`` (four int64 tensors of 32-bit values) and
    ``key`` (two 32-bit values): Philox4x32 with ``rounds`` rounds."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p1 = c0 * M0, c2 * M1  # < 2**64: int64 wraps, the masks below recover both words
        hi0, lo0 = (p0 >> 32) & MASK, p0 & MASK
        hi1, lo1 = (p1 >> 32) & MASK, p1 & MASK
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def words(seed: int, stream: int, shape: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Philox's four words for every element of a tensor of ``shape`` (row-major element index)."""
    n = math.prod(shape)
    idx = torch.arange(n, dtype=torch.int64) + ((seed >> 1) & OFFSET)
    ctr = (idx & MASK, (idx >> 32) & MASK, torch.full_like(idx, stream & MASK), torch.zeros_like(idx))
    key = (seed & MASK, (seed >> 32) & MASK)
    return tuple(w.reshape(tuple(shape)) for w in philox4x32(ctr, key))


def to_uniform(word: torch.Tensor, dtype: torch.dtype, open_low: bool = False) -> torch.Tensor:
    """A 32-bit word as a uniform number of ``dtype`` in [0, 1) (``open_low``: in (0, 1]), from its
    top mantissa bits so that every value is exact in ``dtype``."""
    bits = MANTISSA[dtype]
    top = (word >> (32 - bits)) + (1 if open_low else 0)
    return (top.to(torch.float32) * 2.0 ** -bits).to(dtype)


def random(seed: int, stream: int, shape: Sequence[int], dtype: torch.dtype, dist: str) -> torch.Tensor:
    """The values of ``random {stream, dist} : dtype[shape]`` for ``seed``: uniform in [0, 1), or
    standard normal by Box-Muller on the first two words (in fp32, rounded to ``dtype``)."""
    w = words(seed, stream, shape)
    if dist == "uniform":
        return to_uniform(w[0], dtype)
    if dist == "normal":
        u1, u2 = to_uniform(w[0], torch.float32, open_low=True), to_uniform(w[1], torch.float32)
        return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)).to(dtype)
    raise ValueError(f"random: unknown distribution {dist!r}")


def draw_seed(device: str | torch.device = "cpu") -> torch.Tensor:
    """A fresh 64-bit seed from torch's default generator of ``device`` (what ``torch.manual_seed``
    resets), as the ``i64[]`` tensor a compiled program's seed input takes."""
    return torch.empty((), dtype=torch.int64, device=device).random_()
