"""bf16 GEMMs on the CPU's dot-product instruction: weights in pairs of K, ``PairDot`` micro-kernels.

A bf16 matmul otherwise widens both operands to f32 and runs the f32 micro-kernel: 16 FMAs per
vector instruction at best. AVX-512-BF16's ``vdpbf16ps`` multiplies *pairs* of bf16 values and
adds both products into one f32 lane — 32 multiply-adds per instruction on half the bytes. It
wants B with each pair of consecutive K rows interleaved ("VNNI" order), so a weight is laid out
once, at compile time, as ``[*batch, strips, K/2, nr, 2]``: ``nr`` columns per strip (the
micro-tile's), each strip contiguous over K as the f32 GEMM's packed weights are, K and N
zero-padded to whole pairs and strips. The micro-kernel (``cpu_gemm.gemm_kernel`` with
``Gemm.pairs``) then reads A's ``A[i, 2p]``, ``A[i, 2p+1]`` as one 32-bit broadcast per row and
each strip's ``2·nr`` values per pair as ``nr/lanes`` vector loads.

Taken when the target has the instruction (``TargetDesc.pair_dot``), both operands are bf16 and
B has static sizes. A weight (a param, or a movement of one) is laid out at compile time; any
other B — an activation, as in a 1×1 convolution run as ``W @ x`` — is laid out per call by a
kernel of its own, one copy of B (``K × N``, element by element) against ``M × K × N``
multiply-adds, so only where A has at least ``ACTIVATION_MIN_ROWS`` rows. Measured on 2 Zen 4
cores, bf16 1×1 layers as ``W @ x`` with BN + ReLU, GFLOP/s with B laid out per call against
widened: 64→256 at 56×56 169 / 136; 64→64 88 / 114 (the copy cost as much as the product);
MobileNet's 16→96, 24→144 68–70 either way. Convolutions' implicit GEMMs run on the same
micro-kernel with their weights in pairs (``cpu_conv.uses_pair_conv``). Attention's products
are fused into its own kernel and widen there.
"""

from __future__ import annotations

import math

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.schedule.cpu_amx import uses_amx
from sextant.schedule.cpu_gemv import uses_gemv
from sextant.schedule.partition import Group, movement_of_param
from sextant.schedule.target import TargetDesc

# rows of A from which a bf16 product whose B is not a weight lays B out in pairs per call
ACTIVATION_MIN_ROWS = 256


def uses_pair_dot(group: Group, target: TargetDesc) -> bool:
    """Whether the CPU maps this matmul group on the pair dot product (see the module docstring)."""
    if (target.is_gpu or not target.pair_dot or group.kind != "matmul" or uses_gemv(group, target)
            or uses_amx(group, target)):
        return False
    a, b = group.anchor.inputs
    k, n, m = b.shape[-2], b.shape[-1], a.shape[-2]
    return (a.dtype == b.dtype == DType.bf16 and isinstance(k, int) and isinstance(n, int) and k >= 2
            and isinstance(b.type.numel, int)
            and (movement_of_param(b) or (isinstance(m, int) and m >= ACTIVATION_MIN_ROWS)))


def pair_lanes(target: TargetDesc, nr: int) -> int:
    """f32 lanes of one pair dot: a whole vector register, or the micro-tile's columns if fewer."""
    return min(target.vector_bytes // 4, nr)


def pair_weight(b: Node, nr: int, n_multiple: int | None = None) -> Node:
    """``b`` (``[*batch, K, N]``) as ``[*batch, N/nr, K/2, nr, 2]``, padded with zeros to even K and
    whole strips of ``nr`` columns (N to a multiple of ``n_multiple``, default ``nr``): the layout
    the pair-dot micro-kernel streams, and AMX's tiles load (``cpu_amx``)."""
    *batch, k, n = b.shape
    nb = len(batch)
    g = GraphBuilder()
    g.loc = b.loc
    k2, n2 = k + k % 2, math.ceil(n / (n_multiple or nr)) * (n_multiple or nr)
    t = g.pad(b, (0,) * (nb + 2), (0,) * nb + (k2 - k, n2 - n)) if (k2, n2) != (k, n) else b
    t = g.reshape(t, (*batch, k2 // 2, 2, n2 // nr, nr))
    return g.permute(t, (*range(nb), nb + 2, nb, nb + 3, nb + 1))
