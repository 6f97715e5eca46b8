"""Lowerings of the backward ops Core ATen keeps whole, as they reach AOTAutograd's backward graphs.

Training under ``torch.compile`` (``frontend/training.py``) hands sextant backward graphs in Core
ATen. Most gradients decompose into elementwise ops and reductions (``threshold_backward``,
``native_layer_norm_backward``, ...); these do not, and without a lowering each would run as an
extern call between kernels. Each is expressed here on the same primitives as the forward ops:

* ``convolution_backward``: the input gradient is the *transposed* convolution of the output
  gradient (a transposed conv's is the plain convolution); the weight gradient a convolution with
  the roles exchanged — the input, batch as channels, convolved with the output gradient as the
  kernel (stride and dilation swap) — so both are ``conv`` nodes (implicit GEMMs), groups and
  depthwise included; the bias gradient a ``reduce``.
* average pools (plain and adaptive): separable, so one dim at a time each input position sums the
  few output gradients whose windows cover it (``take`` with constant tap tables, weighted by
  1/divisor) — a ``reshape`` + ``expand`` when windows tile the input exactly.
* max pools (plain and adaptive, 2-D and 3-D): each input position reads the output gradients of
  the windows that cover it and keeps those whose saved index is its own position.
* ``_scaled_dot_product_flash_attention_for_cpu_backward``: the probabilities recomputed from Q, K
  and the saved log-sum-exp, then the standard attention gradients as matmuls.
* ``replication_pad*_backward``: the middle of the gradient plus each border's summed overhang.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch.ops import aten

from sextant.frontend.lowerings.attention import repeat_heads
from sextant.frontend.lowerings.nn import _conv_transpose, _per_dim, avg_pool_counts
from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower, opmath
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


# -- convolution ---------------------------------------------------------------------------------
def conv_weight_grad(b: GraphBuilder, x: Node, gy: Node, kernel: Sequence[int], stride: Sequence[int],
                     padding: Sequence[int], dilation: Sequence[int], groups: int) -> Node:
    """d(loss)/d(weight) [Cout, Cin/groups, *kernel] of ``conv(x, w)`` given its output gradient ``gy``.

    gW[co, ci, k] = Σ_{n,o} gy[n, co, o] · x[n, ci, o·stride + k·dilation − padding]: a convolution of
    x with batch and channels exchanged ([Cin/g, g·N, *in]) by gy as the kernel ([g·Cout/g, N, *out]),
    where stride and dilation swap roles; its output covers at least ``kernel`` and is cropped to it.
    """
    n, cin = x.shape[:2]
    cout, sp = gy.shape[1], x.type.rank - 2
    cig, cog = cin // groups, cout // groups
    tail = list(range(3, 3 + sp))
    xt = b.reshape(b.permute(b.reshape(x, (n, groups, cig) + x.shape[2:]), [2, 1, 0] + tail),
                   (cig, groups * n) + x.shape[2:])
    gt = b.reshape(b.permute(b.reshape(gy, (n, groups, cog) + gy.shape[2:]), [1, 2, 0] + tail),
                   (groups * cog, n) + gy.shape[2:])
    r = b.emit("conv", [xt, gt], stride=tuple(dilation), padding=tuple(padding), dilation=tuple(stride),
               groups=groups)  # [Cin/g, Cout, *k']
    for d in range(sp):
        r = b.slice(r, 2 + d, 0, kernel[d])
    return b.permute(r, [1, 0] + list(range(2, 2 + sp)))


@lower(aten.convolution_backward.default)
def _convolution_backward(ctx: LoweringContext, gy: Node, x: Node, w: Node, bias_sizes, stride, padding,
                          dilation, transposed: bool, output_padding, groups: int,
                          output_mask: Sequence[bool]) -> tuple[Node | None, Node | None, Node | None]:
    b = ctx.b
    unbatched = x.type.rank == w.type.rank - 1
    if unbatched:
        x, gy = b.reshape(x, (1,) + x.shape), b.reshape(gy, (1,) + gy.shape)
    sp = x.type.rank - 2
    stride, padding, dilation = _per_dim(stride, sp), _per_dim(padding, sp), _per_dim(dilation, sp)
    kernel = w.shape[2:]
    gx = gw = gb = None
    if output_mask[0]:
        if transposed:  # the adjoint of a transposed conv is the plain conv with the same weight
            gx = b.emit("conv", [gy, w], stride=stride, padding=padding, dilation=dilation, groups=groups)
            for d in range(sp):  # output padding >= stride (allowed when below the dilation) adds outputs
                gx = b.slice(gx, 2 + d, 0, x.shape[2 + d])
        else:  # output padding makes the transposed conv as long as the input (the rows no window read)
            extra = tuple(x.shape[2 + d] - ((gy.shape[2 + d] - 1) * stride[d] - 2 * padding[d]
                                            + dilation[d] * (kernel[d] - 1) + 1) for d in range(sp))
            gx = _conv_transpose(b, gy, w, stride, padding, dilation, extra, groups)
        gx = b.reshape(b.cast(gx, ctx.out_dtype(0)), ctx.out_shape(0))
    if output_mask[1]:
        # a transposed conv's weight gradient is the plain one with input and output gradient exchanged
        gw = conv_weight_grad(b, gy, x, kernel, stride, padding, dilation, groups) if transposed else \
            conv_weight_grad(b, x, gy, kernel, stride, padding, dilation, groups)
        gw = b.cast(gw, ctx.out_dtype(1))
    if output_mask[2]:
        gb = b.cast(b.reduce("sum", gy, [0] + list(range(2, 2 + sp)), keepdim=False), ctx.out_dtype(2))
    return gx, gw, gb


# -- pooling: each input position gathers the output gradients of the windows covering it ---------
Windows = Callable[[int], Sequence[int]]  # output position -> the input positions its window reads


def _taps(n_in: int, n_out: int, window: Windows) -> tuple[torch.Tensor, torch.Tensor]:
    """([J, n_in] output position, [J, n_in] valid) per input position: the windows that read it."""
    covering: list[list[int]] = [[] for _ in range(n_in)]
    for o in range(n_out):
        for p in window(o):
            if 0 <= p < n_in and o not in covering[p]:
                covering[p].append(o)
    j = max((len(c) for c in covering), default=0)
    idx = torch.zeros(max(j, 1), n_in, dtype=torch.int64)
    valid = torch.zeros(max(j, 1), n_in, dtype=torch.bool)
    for p, c in enumerate(covering):
        idx[:len(c), p] = torch.tensor(c, dtype=torch.int64)
        valid[:len(c), p] = True
    return idx, valid


def _strided_window(kernel: int, stride: int, padding: int, dilation: int) -> Windows:
    return lambda o: [o * stride + k * dilation - padding for k in range(kernel)]


def _adaptive_window(n_in: int, n_out: int) -> Windows:
    return lambda o: range((o * n_in) // n_out, -((-(o + 1) * n_in) // n_out))


def _const(b: GraphBuilder, t: torch.Tensor, what: str) -> Node:
    return b.param(f"{what}.{len(b.params)}", t)


def _along(b: GraphBuilder, v: Node, axis: int, rank: int) -> Node:
    """A vector shaped to broadcast along ``axis`` of a rank-``rank`` tensor."""
    return b.reshape(v, tuple(v.shape[0] if d == axis else 1 for d in range(rank)))


def _spread(b: GraphBuilder, g: Node, axis: int, n_in: int, window: Windows, weight: Sequence[float]) -> Node:
    """Along ``axis``: input position p = Σ over windows o covering p of weight[o]·g[o] (one dim of an
    average pool's gradient). Windows that tile the input exactly are a broadcast, not a gather."""
    n_out = g.shape[axis]
    k = n_in // n_out if n_out else 0
    if k and n_in == k * n_out and all(list(window(o)) == list(range(o * k, o * k + k)) for o in range(n_out)) \
            and len(set(weight)) == 1:
        shape = g.shape[:axis] + (n_out, k) + g.shape[axis + 1:]
        y = b.reshape(b.expand(b.reshape(g, g.shape[:axis] + (n_out, 1) + g.shape[axis + 1:]), shape),
                      g.shape[:axis] + (n_in,) + g.shape[axis + 1:])
        return y if weight[0] == 1 else b.mul(y, float(weight[0]))
    idx, valid = _taps(n_in, n_out, window)
    w = torch.tensor(weight, dtype=torch.float64)[idx] * valid
    total = None
    for j in range(idx.shape[0]):
        term = b.mul(b.take(g, axis, _const(b, idx[j], "pool_grad.index")),
                     _along(b, _const(b, w[j].to(g.dtype.torch), "pool_grad.weight"), axis, g.type.rank))
        total = term if total is None else b.add(total, term)
    return total


@lower(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def _avg_pool_backward(ctx: LoweringContext, gy: Node, x: Node, kernel, stride, padding, ceil_mode: bool,
                       count_include_pad: bool, divisor_override=None) -> Node:
    b = ctx.b
    nsp = 2 if ctx.fx_node.target == aten.avg_pool2d_backward.default else 3
    kernel = _per_dim(kernel, nsp)
    stride, padding = (_per_dim(stride, nsp) if stride else kernel), _per_dim(padding, nsp)
    lead = x.type.rank - nsp
    g = b.cast(gy, opmath(gy.dtype))
    if divisor_override:
        g = b.div(g, float(divisor_override))
    for d in range(nsp):
        n_in, n_out = x.shape[lead + d], gy.shape[lead + d]
        weight = [1.0] * n_out if divisor_override else \
            [1.0 / c for c in avg_pool_counts(n_in, n_out, kernel[d], stride[d], padding[d], count_include_pad)]
        g = _spread(b, g, lead + d, n_in, _strided_window(kernel[d], stride[d], padding[d], 1), weight)
    return b.cast(g, ctx.out_dtype())


@lower(aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool_backward(ctx: LoweringContext, gy: Node, x: Node) -> Node:
    b = ctx.b
    nsp = 2 if ctx.fx_node.target == aten._adaptive_avg_pool2d_backward.default else 3
    lead = x.type.rank - nsp
    g = b.cast(gy, opmath(gy.dtype))
    for d in range(nsp):
        n_in, n_out = x.shape[lead + d], gy.shape[lead + d]
        window = _adaptive_window(n_in, n_out)
        g = _spread(b, g, lead + d, n_in, window, [1.0 / len(window(o)) for o in range(n_out)])
    return b.cast(g, ctx.out_dtype())


def _unpool_max(b: GraphBuilder, gy: Node, x: Node, indices: Node, windows: Sequence[Windows]) -> Node:
    """Input position p gets Σ gy[o] over the windows o covering p whose saved (flat, per plane) index is p."""
    nsp = len(windows)
    lead = x.type.rank - nsp
    in_sp = x.shape[lead:]
    taps = [_taps(in_sp[d], gy.shape[lead + d], windows[d]) for d in range(nsp)]
    flat = None  # each input position's own flat index in its plane
    for d in range(nsp):
        pos = b.iota(x.shape, lead + d)
        flat = pos if flat is None else b.add(b.mul(flat, in_sp[d]), pos)
    indices = b.cast(indices, DType.i64)
    total = None
    for js in itertools.product(*(range(t[0].shape[0]) for t in taps)):
        g, ix, ok = gy, indices, None
        for d, j in enumerate(js):
            idx, valid = taps[d]
            table = _const(b, idx[j], "pool_grad.index")
            g, ix = b.take(g, lead + d, table), b.take(ix, lead + d, table)
            if not bool(valid[j].all()):
                v = b.expand(_along(b, _const(b, valid[j], "pool_grad.valid"), lead + d, x.type.rank), x.shape)
                ok = v if ok is None else b.binary("bitwise_and", ok, v)
        hit = b.binary("eq", ix, flat)
        if ok is not None:
            hit = b.binary("bitwise_and", hit, ok)
        term = b.where(hit, g, 0.0)
        total = term if total is None else b.add(total, term)
    return total


@lower(aten.max_pool3d_with_indices_backward.default)
def _max_pool_backward(ctx: LoweringContext, gy: Node, x: Node, kernel, stride, padding, dilation,
                       ceil_mode: bool, indices: Node) -> Node:
    nsp = 3 if ctx.fx_node.target == aten.max_pool3d_with_indices_backward.default else 2
    kernel = _per_dim(kernel, nsp)
    stride = _per_dim(stride, nsp) if stride else kernel
    padding, dilation = _per_dim(padding, nsp), _per_dim(dilation, nsp)
    windows = [_strided_window(kernel[d], stride[d], padding[d], dilation[d]) for d in range(nsp)]
    return ctx.b.cast(_unpool_max(ctx.b, gy, x, indices, windows), ctx.out_dtype())


@lower(aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default)
def _adaptive_max_pool_backward(ctx: LoweringContext, gy: Node, x: Node, indices: Node) -> Node:
    nsp = 2 if ctx.fx_node.target == aten.adaptive_max_pool2d_backward.default else 3
    lead = x.type.rank - nsp
    windows = [_adaptive_window(x.shape[lead + d], gy.shape[lead + d]) for d in range(nsp)]
    return ctx.b.cast(_unpool_max(ctx.b, gy, x, indices, windows), ctx.out_dtype())


# -- replication padding ---------------------------------------------------------------------------
@lower(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
       aten.replication_pad3d_backward.default)
def _replication_pad_backward(ctx: LoweringContext, gy: Node, x: Node, padding) -> Node:
    """Each border element also collects the gradient of the copies of it in the padding."""
    b = ctx.b
    nsp = len(padding) // 2
    if any(p < 0 for p in padding):
        raise Unsupported("replication padding with a negative (cropping) amount")
    g = b.cast(gy, opmath(gy.dtype))
    for d in range(nsp):
        axis = x.type.rank - 1 - d
        lo, hi, n = padding[2 * d], padding[2 * d + 1], x.shape[axis]
        mid = b.slice(g, axis, lo, n)
        rank = g.type.rank
        if lo:
            edge = b.reduce("sum", b.slice(g, axis, 0, lo), [axis])
            mid = b.add(mid, b.pad(edge, [0] * rank, [n - 1 if a == axis else 0 for a in range(rank)]))
        if hi:
            edge = b.reduce("sum", b.slice(g, axis, lo + n, hi), [axis])
            mid = b.add(mid, b.pad(edge, [n - 1 if a == axis else 0 for a in range(rank)], [0] * rank))
        g = mid
    return b.cast(g, ctx.out_dtype())


# -- attention -------------------------------------------------------------------------------------
@lower(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_flash_cpu_backward(ctx: LoweringContext, gout: Node, q: Node, k: Node, v: Node, out: Node, lse: Node,
                             dropout_p: float, is_causal: bool, *, attn_mask: Node | None = None,
                             scale: float | None = None) -> tuple[Node, Node, Node]:
    """P = exp(scale·QKᵀ + mask − lse) recomputed; dV = PᵀdO, dP = dO·Vᵀ, dS = P∘(dP − rowsum(dO∘O)),
    dQ = scale·dS·K, dK = scale·dSᵀ·Q (K and V gradients summed over each group's query heads)."""
    if dropout_p:
        raise Unsupported(f"attention backward with dropout_p={dropout_p}: attention dropout is not lowered "
                          "yet (train with dropout_p=0.0, or dropout outside the attention)")
    b = ctx.b
    t = opmath(q.dtype)
    q, k, v, gout, out = (b.cast(a, t) for a in (q, k, v, gout, out))
    heads, hkv = q.shape[-3], k.shape[-3]
    if heads != hkv:
        k, v = repeat_heads(b, k, heads), repeat_heads(b, v, heads)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = b.matmul(q, b.transpose(k, -2, -1))
    if scale != 1.0:
        scores = b.mul(scores, scale)
    n_q, n_kv = scores.shape[-2:]
    if is_causal:
        keep = b.binary("le", b.iota((n_q, n_kv), 1), b.iota((n_q, n_kv), 0))
        scores = b.where(keep, scores, -math.inf)
    if attn_mask is not None:
        scores = b.where(attn_mask, scores, -math.inf) if attn_mask.dtype == DType.bool else \
            b.add(scores, b.cast(attn_mask, t))
    p = b.unary("exp", b.sub(scores, b.expand(b.reshape(b.cast(lse, t), lse.shape + (1,)), scores.shape)))
    if attn_mask is not None:  # a fully hidden row (its lse 0 in torch, not -inf) has no probabilities
        p = b.where(b.binary("eq", scores, -math.inf), 0.0, p)
    dv = b.matmul(b.transpose(p, -2, -1), gout)
    dp = b.matmul(gout, b.transpose(v, -2, -1))
    rowdot = b.reduce("sum", b.mul(gout, out), [-1])
    ds = b.mul(p, b.sub(dp, b.expand(rowdot, dp.shape)))
    if scale != 1.0:
        ds = b.mul(ds, scale)
    dq = b.matmul(ds, k)
    dk = b.matmul(b.transpose(ds, -2, -1), q)
    if heads != hkv:  # the repeated K/V heads: each kv head's gradient sums its group's
        dk, dv = (b.reshape(b.reduce("sum", b.reshape(a, a.shape[:-3] + (hkv, heads // hkv) + a.shape[-2:]),
                                     [a.type.rank - 2]), a.shape[:-3] + (hkv,) + a.shape[-2:]) for a in (dk, dv))
    return tuple(b.reshape(b.cast(a, ctx.out_dtype(i)), ctx.out_shape(i))  # type: ignore[return-value]
                 for i, a in enumerate((dq, dk, dv)))


# -- pairwise distances ----------------------------------------------------------------------------
@lower(aten._cdist_backward.default)
def _cdist_backward(ctx: LoweringContext, grad: Node, x1: Node, x2: Node, p: float, dist: Node) -> Node:
    """d/dx1 of cdist(x1 [.., P, M], x2 [.., R, M]): Σ_r grad·∂‖x1_p − x2_r‖_p/∂x1_p, over the [.., P, R, M]
    differences, with torch's choices where the norm is not differentiable (0 at a zero distance)."""
    b = ctx.b
    t = opmath(x1.dtype)
    a = b.reshape(b.cast(x1, t), x1.shape[:-1] + (1, x1.shape[-1]))
    c = b.reshape(b.cast(x2, t), x2.shape[:-2] + (1,) + x2.shape[-2:])
    diff = b.sub(*b.broadcast(a, c))  # [.., P, R, M]
    g = b.broadcast_to(b.reshape(b.cast(grad, t), grad.shape + (1,)), diff.shape)
    d = b.broadcast_to(b.reshape(b.cast(dist, t), dist.shape + (1,)), diff.shape)
    sign, mag = b.unary("sign", diff), b.unary("abs", diff)
    if p == 0:
        return b.full(0, ctx.out_shape(), ctx.out_dtype())
    if p == 1:
        term = b.mul(g, sign)
    elif math.isinf(p):  # only the coordinates that attain the max
        term = b.where(b.binary("eq", mag, d), b.mul(g, sign), 0.0)
    else:
        if p == 2:
            term = b.div(b.mul(g, diff), d)
        else:
            term = b.div(b.mul(b.mul(g, sign), b.binary("pow", mag, p - 1)), b.binary("pow", d, p - 1))
            if p < 1:  # |diff|^(p-1) is infinite at 0: torch takes 0
                term = b.where(b.binary("eq", diff, 0.0), 0.0, term)
        term = b.where(b.binary("eq", d, 0.0), 0.0, term)
    out = b.reduce("sum", term, [diff.type.rank - 2], keepdim=False)
    return b.reshape(b.cast(out, ctx.out_dtype()), ctx.out_shape())
