"""Lowering of scaled dot-product attention, kept whole through export (see ``KEPT_WHOLE``).

torch's own SDPA decomposition can produce a graph its later ``view``s cannot replay (GPT-2
with transformers' default attention fails inside ``run_decompositions``), and one SDPA node
is also the shape a fused-attention kernel wants to find. So export leaves these ops alone
and they lower here to one canonical chain, every node carrying the SDPA call's source line::

    scores = (Q @ Kᵀ) * scale  [where(causal, ., -inf)]  [where(mask, ., -inf) | + mask]
    P      = softmax(scores)   (max → sub → exp → sum → div, as ``aten._softmax``)
    out    = P @ V
"""

from __future__ import annotations

import math

from torch.ops import aten

from sextant.frontend.lowerings.reductions import softmax_terms
from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower, opmath
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

KEPT_WHOLE = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_attention_math.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
)
"""Ops removed from torch's decomposition table: they reach translation as one node each."""


def repeat_heads(b: GraphBuilder, x: Node, heads: int) -> Node:
    """[..., Hkv, S, E] → [..., heads, S, E], query head h reading kv head h // (heads / Hkv)."""
    *lead, hkv, s, e = x.shape
    if hkv == heads:
        return x
    if heads % hkv:
        raise Unsupported(f"grouped-query attention with {heads} query heads and {hkv} key/value heads "
                          "(not a multiple)")
    rep = heads // hkv
    x = b.expand(b.reshape(x, (*lead, hkv, 1, s, e)), (*lead, hkv, rep, s, e))
    return b.reshape(x, (*lead, heads, s, e))


def attention(b: GraphBuilder, q: Node, k: Node, v: Node, mask: Node | None, dropout_p: float,
              is_causal: bool, scale: float | None, gqa: bool) -> tuple[Node, Node, Node, Node]:
    """(out, probabilities, row max, row sum) of softmax(Q·Kᵀ·scale + mask)·V, all in opmath.

    Half-precision inputs are computed in f32, as torch's CPU kernels accumulate. A row that
    the mask hides entirely gives 0, as eager does, not the NaN a plain softmax would.
    """
    if dropout_p:
        raise Unsupported(f"dropout_p={dropout_p}: attention dropout is not lowered yet (its backward would "
                          "need the forward's mask); it only belongs in training (pass dropout_p=0.0 outside "
                          "model.training)")
    t = opmath(q.dtype)
    q, k, v = b.cast(q, t), b.cast(k, t), b.cast(v, t)
    if gqa and q.type.rank >= 3:
        k, v = repeat_heads(b, k, q.shape[-3]), repeat_heads(b, v, q.shape[-3])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = b.matmul(q, b.transpose(k, -2, -1))
    if scale != 1.0:
        scores = b.mul(scores, scale)
    n_q, n_kv = scores.shape[-2:]
    if is_causal:  # top-left aligned, as torch: query i sees keys j <= i
        keep = b.binary("le", b.iota((n_q, n_kv), 1), b.iota((n_q, n_kv), 0))
        scores = b.where(keep, scores, -math.inf)
    if mask is not None:
        scores = b.where(mask, scores, -math.inf) if mask.dtype == DType.bool else b.add(scores, b.cast(mask, t))
    dim = scores.type.rank - 1
    m, _, e, s = softmax_terms(b, scores, dim)
    p = b.div(e, b.expand(s, e.shape))
    if mask is not None:  # torch zeroes fully masked rows instead of returning NaN
        p = b.where(b.binary("eq", m, -math.inf), 0.0, p)
    return b.matmul(p, v), p, m, s


@lower(aten.scaled_dot_product_attention.default)
def _sdpa(ctx: LoweringContext, q: Node, k: Node, v: Node, attn_mask: Node | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
          enable_gqa: bool = False) -> Node:
    out, *_ = attention(ctx.b, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return ctx.b.cast(out, ctx.out_dtype())


@lower(aten._scaled_dot_product_attention_math.default)
def _sdpa_math(ctx: LoweringContext, q: Node, k: Node, v: Node, attn_mask: Node | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, dropout_mask: Node | None = None, *,
               scale: float | None = None, enable_gqa: bool = False) -> tuple[Node, Node]:
    if dropout_mask is not None:
        raise Unsupported("an explicit dropout_mask")
    out, p, _, _ = attention(ctx.b, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    b = ctx.b
    return b.cast(out, ctx.out_dtype(0)), b.reshape(b.cast(p, ctx.out_dtype(1)), ctx.out_shape(1))


@lower(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_flash_cpu(ctx: LoweringContext, q: Node, k: Node, v: Node, dropout_p: float = 0.0,
                    is_causal: bool = False, *, attn_mask: Node | None = None,
                    scale: float | None = None) -> tuple[Node, Node]:
    gqa = q.type.rank >= 3 and q.shape[-3] != k.shape[-3]  # as torch's own decomposition of it
    out, _, m, s = attention(ctx.b, q, k, v, attn_mask, dropout_p, is_causal, scale, gqa)
    b = ctx.b
    lse = b.add(b.unary("log", s), m)
    if attn_mask is not None:  # a fully hidden row: torch's log-sum-exp is 0 there (the backward relies on it)
        lse = b.where(b.binary("eq", m, -math.inf), 0.0, lse)
    return b.cast(out, ctx.out_dtype(0)), b.reshape(b.cast(lse, ctx.out_dtype(1)), ctx.out_shape(1))
