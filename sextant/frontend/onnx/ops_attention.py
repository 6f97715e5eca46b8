"""ONNX attention ops: Attention (softmax, with GQA, KV cache, masks), RotaryEmbedding, LinearAttention.

Written out as matmuls and an explicit softmax so each target compiles the same graph; masks of
every kind (boolean, additive, causal, padding lengths) fold into one additive bias.
LinearAttention's recurrent state update is unrolled over the (static) sequence length.
"""

from __future__ import annotations

import math

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.lowerings.attention import repeat_heads
from sextant.frontend.lowerings.reductions import softmax_terms
from sextant.frontend.onnx.dtypes import from_onnx
from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


# -- attention -----------------------------------------------------------------------------------
def _heads(b: GraphBuilder, x: Node, heads: int) -> Node:
    """[B, S, H*E] → [B, H, S, E]."""
    bs, s, hidden = x.shape
    if not heads or hidden % heads:
        raise Unsupported(f"Attention: hidden size {hidden} is not a multiple of {heads} heads")
    return b.permute(b.reshape(x, (bs, s, heads, hidden // heads)), (0, 2, 1, 3))


def _softmax(b: GraphBuilder, x: Node) -> Node:
    """Over the last axis, in the one form every lowering emits (the scheduler's patterns match it)."""
    _, _, e, s = softmax_terms(b, x, x.type.rank - 1)
    return b.div(e, b.expand(s, e.shape))


@onnx_op("Attention")
def _attention(ctx: OnnxContext, q: Node, k: Node, v: Node, mask: Node | None = None,
               past_k: Node | None = None, past_v: Node | None = None, nonpad: Node | None = None):
    b = ctx.b
    three_d = q.type.rank == 3
    if three_d:
        q = _heads(b, q, int(ctx.attr("q_num_heads", 0)))
        k = _heads(b, k, int(ctx.attr("kv_num_heads", 0)))
        v = _heads(b, v, int(ctx.attr("kv_num_heads", 0)))
    if (past_k is None) != (past_v is None):
        raise Unsupported("Attention: past_key and past_value must be given together")
    past = 0
    if past_k is not None:
        past = past_k.shape[2]
        k, v = b.concat([past_k, k], 2), b.concat([past_v, v], 2)
    present_k, present_v = k, v
    dtype = q.dtype
    scale = ctx.attr("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    nq, nkv = q.shape[2], k.shape[2]
    bias = None
    if mask is not None:
        if mask.shape[-1] < nkv:
            fill = False if mask.dtype == DType.bool else -math.inf
            mask = b.pad(mask, [0] * mask.type.rank, [0] * (mask.type.rank - 1) + [nkv - mask.shape[-1]], fill)
        is_bool = mask.dtype == DType.bool
        bias = b.where(mask, b.full(0, mask.shape, dtype), -math.inf) if is_bool else b.cast(mask, dtype)
    if ctx.attr("is_causal", 0):
        hide = b.binary("gt", b.iota((nq, nkv), 1), b.add(b.iota((nq, nkv), 0), past))
        causal = b.where(hide, -math.inf, b.full(0, hide.shape, dtype))
        bias = causal if bias is None else b.add(*b.broadcast(bias, causal))
    if nonpad is not None:
        keep = b.binary("lt", b.iota((q.shape[0], 1, 1, nkv), 3),
                        b.reshape(b.cast(nonpad, DType.i64), (q.shape[0], 1, 1, 1)))
        pad_bias = b.where(keep, b.full(0, keep.shape, dtype), -math.inf)
        bias = pad_bias if bias is None else b.add(*b.broadcast(bias, pad_bias))
    heads = q.shape[1]
    k, v = repeat_heads(b, k, heads), repeat_heads(b, v, heads)
    s = math.sqrt(scale)
    scores = b.matmul(b.mul(q, s), b.transpose(b.mul(k, s), 2, 3))
    softcap = float(ctx.attr("softcap", 0.0))
    if softcap > 0:
        scores = b.mul(b.unary("tanh", b.div(scores, softcap)), softcap)
    qk = scores
    if bias is not None:
        scores = b.add(scores, b.broadcast_to(bias, scores.shape))
    mode = int(ctx.attr("qk_matmul_output_mode", 0))
    if mode == 2:
        qk = scores
    prec = ctx.attr("softmax_precision")
    if prec is not None:
        t = from_onnx(int(prec))
        if t is None or not t.is_float:
            raise Unsupported(f"Attention: softmax_precision={prec}")
        scores = b.cast(scores, t)
    p = _softmax(b, scores)
    if mode == 3:
        qk = p
    y = b.cast(b.matmul(p, b.cast(v, p.dtype)), dtype)
    if three_d:
        bs, h, sq, e = y.shape
        y = b.reshape(b.permute(y, (0, 2, 1, 3)), (bs, sq, h * e))
    return [y, present_k, present_v, b.cast(qk, dtype)]


@onnx_op("RotaryEmbedding")
def _rotary(ctx: OnnxContext, x: Node, cos: Node, sin: Node, pos: Node | None = None) -> Node:
    b = ctx.b
    shape = x.shape
    if x.type.rank == 4:
        x = b.permute(x, (0, 2, 1, 3))  # [B, S, H, E]
    elif x.type.rank == 3:
        heads = int(ctx.attr("num_heads", 0))
        if not heads or shape[2] % heads:
            raise Unsupported(f"RotaryEmbedding: num_heads={heads} for hidden size {shape[2]}")
        x = b.reshape(x, (shape[0], shape[1], heads, shape[2] // heads))
    else:
        raise Unsupported(f"RotaryEmbedding: input of rank {x.type.rank}")
    bs, sq, _, e = x.shape
    rd = int(ctx.attr("rotary_embedding_dim", 0)) or e
    half = rd // 2
    if pos is not None:
        cos, sin = b.take(cos, 0, pos), b.take(sin, 0, pos)
    cos = b.broadcast_to(b.reshape(cos, cos.shape[:-1] + (1, half)), (bs, sq, 1, half))
    sin = b.broadcast_to(b.reshape(sin, sin.shape[:-1] + (1, half)), (bs, sq, 1, half))
    rot = b.slice(x, 3, 0, rd)
    interleaved = bool(ctx.attr("interleaved", 0))
    if interleaved:
        x1, x2 = b.slice(rot, 3, 0, half, 2), b.slice(rot, 3, 1, half, 2)
    else:
        x1, x2 = b.slice(rot, 3, 0, half), b.slice(rot, 3, half, half)
    cos, sin = b.cast(cos, x.dtype), b.cast(sin, x.dtype)
    real = b.sub(b.mul(cos, x1), b.mul(sin, x2))
    imag = b.add(b.mul(sin, x1), b.mul(cos, x2))
    if interleaved:
        pairs = [b.reshape(t, t.shape + (1,)) for t in (real, imag)]
        rot = b.reshape(b.concat(pairs, 4), rot.shape)
    else:
        rot = b.concat([real, imag], 3)
    if rd < e:
        rot = b.concat([rot, b.slice(x, 3, rd, e - rd)], 3)
    return b.permute(rot, (0, 2, 1, 3)) if len(shape) == 4 else b.reshape(rot, shape)


# -- linear attention ----------------------------------------------------------------------------
@onnx_op("LinearAttention")
def _linear_attention(ctx: OnnxContext, q: Node, k: Node, v: Node, past: Node | None = None,
                      decay: Node | None = None, beta: Node | None = None):
    """The recurrence unrolled over T (static), in f32 as ONNX's reference: a graph has no loop op,
    and the sequential form is exact for every update rule (chunk_size is only a tuning hint)."""
    b = ctx.b
    rule = ctx.attr("update_rule", "gated_delta")
    hq, hkv = int(ctx.attr("q_num_heads", 0)), int(ctx.attr("kv_num_heads", 0))
    if rule not in ("linear", "gated", "delta", "gated_delta"):
        raise Unsupported(f"LinearAttention: update_rule={rule!r}")
    if hq <= 0 or hkv <= 0 or hq % hkv:
        raise Unsupported(f"LinearAttention: q_num_heads={hq} is not a positive multiple of kv_num_heads={hkv}")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gated != (decay is not None) or delta != (beta is not None):
        raise Unsupported(f"LinearAttention: update_rule={rule!r} needs decay: {gated}, beta: {delta} "
                          f"(got decay: {decay is not None}, beta: {beta is not None})")
    f32 = DType.f32
    bs, t, _ = q.shape
    dk, dv, g = q.shape[2] // hq, v.shape[2] // hkv, hq // hkv
    # query head kv*g + j reads kv head kv's state: [B, Hkv, T, g, dk]
    qg = b.permute(b.reshape(b.cast(q, f32), (bs, t, hkv, g, dk)), (0, 2, 1, 3, 4))
    k4, v4 = _heads(b, b.cast(k, f32), hkv), _heads(b, b.cast(v, f32), hkv)
    gate = b.unary("exp", _heads(b, b.cast(decay, f32), hkv)) if decay is not None else None  # [B, Hkv, T, dk|1]
    rate = _heads(b, b.cast(beta, f32), beta.shape[2]) if beta is not None else None  # [B, Hkv|1, T, 1]
    state = b.full(0, (bs, hkv, dk, dv), f32) if past is None else b.cast(past, f32)
    outs = []
    for i in range(t):
        kt, vt = b.slice(k4, 2, i, 1), b.slice(v4, 2, i, 1)  # [B, Hkv, 1, d]
        if gate is not None:
            state = b.mul(state, b.broadcast_to(b.transpose(b.slice(gate, 2, i, 1), 2, 3), state.shape))
        if rate is not None:
            err = b.sub(vt, b.matmul(kt, state))
            vt = b.mul(b.broadcast_to(b.slice(rate, 2, i, 1), err.shape), err)
        state = b.add(state, b.matmul(b.transpose(kt, 2, 3), vt))
        qt = b.reshape(b.slice(qg, 2, i, 1), (bs, hkv, g, dk))
        outs.append(b.reshape(b.matmul(qt, state), (bs, 1, hq * dv)))
    scale = float(ctx.attr("scale", 0.0)) or 1.0 / math.sqrt(dk)
    y = b.cast(b.mul(b.concat(outs, 1), scale), q.dtype)
    return [y, b.cast(state, q.dtype if past is None else past.dtype)]
