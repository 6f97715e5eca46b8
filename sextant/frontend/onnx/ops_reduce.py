"""ONNX reductions and normalisations: Reduce*, ArgMax/ArgMin, Softmax family, *Normalization, losses, TopK.

Where an ATen lowering already implements the math (softmax, layer/group/batch norm, cumsum,
argmax, logsumexp, vector norms) the translation calls it through ``ctx.aten``, so both frontends
share one lowering; the rest is composed from builder ops. Half-precision inputs are computed in
f32 and cast back, as torch does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.ops import aten

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.lowerings.registry import opmath
from sextant.frontend.onnx.dtypes import from_onnx
from sextant.frontend.onnx.registry import OnnxContext, axis, norm_axes, onnx_op
from sextant.graph.builder import GraphBuilder, broadcast_shapes
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


# -- Reduce* -----------------------------------------------------------------------------------
def _reduce_axes(ctx: OnnxContext, x: Node, axes_in: Node | None) -> list[int]:
    """The axes to reduce: an input (ReduceSum ≥ 13, the others ≥ 18) or an attribute before.

    Empty axes mean all axes, unless ``noop_with_empty_axes`` asks for no reduction at all.
    """
    axes = ctx.ints(axes_in, "axes") if axes_in is not None else list(ctx.attr("axes", []) or [])
    if not axes:
        return [] if ctx.attr("noop_with_empty_axes", 0) else list(range(x.type.rank))
    axes = norm_axes(axes, x.type.rank)
    if len(set(axes)) != len(axes):
        raise Unsupported(f"{ctx.op_type}: repeated axes {axes}")
    return sorted(axes)


def _empty_value(dtype: DType, value: float) -> int | float | bool:
    """What an empty-set reduction yields: ``value``, with ±inf as the integer extremes (NaN as 0)."""
    if dtype == DType.bool:
        return value > 0
    if dtype.is_float:
        return value
    info = torch.iinfo(dtype.torch)
    return info.min if value == -math.inf else info.max if value == math.inf else 0 if math.isnan(value) else value


Elementwise = Callable[[GraphBuilder, Node], Node]
_SQUARE: Elementwise = lambda b, v: b.mul(v, v)
# op → (elementwise before, reduction, elementwise after, empty-set value)
_REDUCE: dict[str, tuple[Elementwise | None, str, Elementwise | None, float]] = {
    "ReduceSum": (None, "sum", None, 0.0),
    "ReduceMean": (None, "mean", None, math.nan),
    "ReduceMax": (None, "max", None, -math.inf),
    "ReduceMin": (None, "min", None, math.inf),
    "ReduceProd": (None, "prod", None, 1.0),
    "ReduceL1": (lambda b, v: b.unary("abs", v), "sum", None, 0.0),
    "ReduceL2": (_SQUARE, "sum", lambda b, v: b.unary("sqrt", v), 0.0),
    "ReduceSumSquare": (_SQUARE, "sum", None, 0.0),
    "ReduceLogSum": (None, "sum", lambda b, v: b.unary("log", v), -math.inf),
    "ReduceLogSumExp": (None, "logsumexp", None, -math.inf),
}
_NEEDS_FLOAT = {"ReduceL2", "ReduceLogSum", "ReduceLogSumExp"}


@onnx_op(*_REDUCE)
def _reduce(ctx: OnnxContext, x: Node, axes_in: Node | None = None) -> Node:
    b = ctx.b
    pre, fn, post, empty = _REDUCE[ctx.op_type]
    axes = _reduce_axes(ctx, x, axes_in)
    keep = bool(ctx.attr("keepdims", 1))
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    out_shape = shape if keep else tuple(d for i, d in enumerate(x.shape) if i not in axes)
    if x.type.numel == 0:  # an empty set of values reduces to the reduction's identity
        return b.full(_empty_value(x.dtype, empty), out_shape, x.dtype)
    if x.dtype == DType.bool and fn not in ("max", "min"):
        raise Unsupported(f"{ctx.op_type} of a bool tensor")
    work = x.dtype if fn in ("max", "min") else opmath(x.dtype)
    if not work.is_float and ctx.op_type in _NEEDS_FLOAT:
        work = DType.f32  # sqrt/log of an integer sum: computed in f32, truncated back as onnx does
    y = b.cast(x, work)
    if pre is not None:
        y = pre(b, y)
    if axes:
        if fn == "logsumexp":
            y = ctx.aten(aten.logsumexp.default, y, axes, True)
        elif fn == "mean":
            y = b.mean(y, axes)
        else:
            y = b.reduce(fn, y, axes)
    if post is not None:
        y = post(b, y)
    return b.reshape(b.cast(y, x.dtype), out_shape)


# -- ArgMax / ArgMin ---------------------------------------------------------------------------
def _flip(b: GraphBuilder, x: Node, dim: int) -> Node:
    n = x.shape[dim]
    return b.slice(x, dim, n - 1, n, -1) if n > 1 else x


@onnx_op("ArgMax", "ArgMin")
def _arg(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    op = aten.argmax.default if ctx.op_type == "ArgMax" else aten.argmin.default
    a = axis(ctx, x)
    last = bool(ctx.attr("select_last_index", 0))
    if last:  # the last occurrence is the first one of the reversed axis
        i = ctx.aten(op, _flip(b, x, a), a, True)
        i = b.sub(b.full(x.shape[a] - 1, i.shape, DType.i64), i)
    else:
        i = ctx.aten(op, x, a, True)
    if not ctx.attr("keepdims", 1):
        i = b.reshape(i, x.shape[:a] + x.shape[a + 1:])
    return i


# -- Softmax / LogSoftmax / Hardmax --------------------------------------------------------------
def _along_axis(ctx: OnnxContext, x: Node, fn: Callable[[Node, int], Node]) -> Node:
    """Apply ``fn(x, dim)``; before opset 13 the input is first coerced to 2-D at ``axis`` (default 1)."""
    if ctx.opset >= 13:
        return fn(x, axis(ctx, x, default=-1))
    rank = x.type.rank
    a = int(ctx.attr("axis", 1))
    a += rank if a < 0 else 0
    if not 0 <= a <= rank:
        raise Unsupported(f"{ctx.op_type}: axis={ctx.attr('axis', 1)} out of range for rank {rank}")
    two_d = (math.prod(x.shape[:a]), math.prod(x.shape[a:]))
    return ctx.b.reshape(fn(ctx.b.reshape(x, two_d), 1), x.shape)


@onnx_op("Softmax", "LogSoftmax")
def _softmax(ctx: OnnxContext, x: Node) -> Node:
    op = aten._softmax.default if ctx.op_type == "Softmax" else aten._log_softmax.default
    return _along_axis(ctx, x, lambda v, d: ctx.aten(op, v, d, False))


@onnx_op("Hardmax")
def _hardmax(ctx: OnnxContext, x: Node) -> Node:
    def one_hot(v: Node, d: int) -> Node:
        i = ctx.aten(aten.argmax.default, v, d, True)
        hit = ctx.b.binary("eq", ctx.b.iota(v.shape, d), ctx.b.expand(i, v.shape))
        return ctx.b.cast(hit, v.dtype)

    return _along_axis(ctx, x, one_hot)


# -- CumSum ------------------------------------------------------------------------------------
@onnx_op("CumSum")
def _cumsum(ctx: OnnxContext, x: Node, axis_in: Node) -> Node:
    b = ctx.b
    (a,) = norm_axes(ctx.ints(axis_in, "axis")[:1], x.type.rank, "CumSum axis")
    rev, excl = bool(ctx.attr("reverse", 0)), bool(ctx.attr("exclusive", 0))
    work = opmath(x.dtype)
    y = _flip(b, b.cast(x, work), a) if rev else b.cast(x, work)
    y = ctx.aten(aten.cumsum.default, y, a, dtype=work.torch)
    if excl:  # shift by one: y[i] = sum of x[j] for j < i
        n = x.shape[a]
        low = [0] * x.type.rank
        low[a] = 1
        y = b.slice(b.pad(y, low, [0] * x.type.rank), a, 0, n)
    return b.cast(_flip(b, y, a) if rev else y, x.dtype)


# -- normalisations ------------------------------------------------------------------------------
def _stash(ctx: OnnxContext, x: Node) -> DType:
    """The precision of a normalisation's first stage: ``stash_type`` (f32 by default), at least f32's."""
    t = from_onnx(int(ctx.attr("stash_type", 1)))
    if t is None or not t.is_float:
        raise Unsupported(f"{ctx.op_type}: stash_type {ctx.attr('stash_type')} (only f32/f16/bf16)")
    return DType.f32 if t == DType.f32 or x.dtype in (DType.f16, DType.bf16) else t


@onnx_op("LayerNormalization")
def _layer_norm(ctx: OnnxContext, x: Node, scale: Node, bias: Node | None = None) -> list[Node]:
    b = ctx.b
    a = axis(ctx, x, default=-1)
    norm_shape = x.shape[a:]
    _stash(ctx, x)
    stash = from_onnx(int(ctx.attr("stash_type", 1)))  # the declared type of Mean and InvStdDev
    eps = float(ctx.attr("epsilon", 1e-5))
    k = len(norm_shape)
    affine = [v for v in (scale, bias) if v is not None]
    if all(v.type.rank <= k and broadcast_shapes(v.shape, norm_shape) == norm_shape for v in affine):
        w, bb = (None if v is None else b.broadcast_to(v, norm_shape) for v in (scale, bias))
        y, mean, rstd = ctx.aten(aten.native_layer_norm.default, x, list(norm_shape), w, bb, eps)
    else:  # Scale/B broadcast over more than the normalised dims: apply them after, in f32 for halves
        y, mean, rstd = ctx.aten(aten.native_layer_norm.default, b.cast(x, opmath(x.dtype)), list(norm_shape),
                                 None, None, eps)
        y = b.mul(y, scale) if bias is None else b.add(b.mul(y, scale), bias)
        y = b.cast(y, x.dtype)
    return [y, b.cast(mean, stash), b.cast(rstd, stash)]


@onnx_op("RMSNormalization")
def _rms_norm(ctx: OnnxContext, x: Node, scale: Node) -> Node:
    b = ctx.b
    a = axis(ctx, x, default=-1)
    y = b.cast(x, _stash(ctx, x))
    ms = b.mean(b.mul(y, y), list(range(a, x.type.rank)))
    r = b.unary("rsqrt", b.add(ms, float(ctx.attr("epsilon", 1e-5))))
    normed = b.cast(b.mul(y, b.expand(r, y.shape)), x.dtype)
    return b.mul(normed, b.cast(scale, x.dtype))


def _group_norm(ctx: OnnxContext, x: Node, scale: Node | None, bias: Node | None, groups: int) -> Node:
    if x.type.rank < 2 or x.shape[1] % groups:
        raise Unsupported(f"{ctx.op_type}: {x.shape[1] if x.type.rank > 1 else '?'} channels in {groups} groups")
    n, c = x.shape[:2]
    y, _, _ = ctx.aten(aten.native_group_norm.default, x, scale, bias, n, c, math.prod(x.shape[2:]), groups,
                       float(ctx.attr("epsilon", 1e-5)))
    return y


@onnx_op("GroupNormalization")
def _group_normalization(ctx: OnnxContext, x: Node, scale: Node, bias: Node) -> Node:
    b = ctx.b
    g = int(ctx.attr("num_groups"))
    c = x.shape[1]
    if ctx.opset < 21 and scale.shape == (g,) and c != g:  # opset 18: one scale/bias per group
        per = c // g
        scale, bias = (b.reshape(b.expand(b.reshape(v, (g, 1)), (g, per)), (c,)) for v in (scale, bias))
    return _group_norm(ctx, x, scale, bias, g)


@onnx_op("InstanceNormalization")
def _instance_norm(ctx: OnnxContext, x: Node, scale: Node, bias: Node) -> Node:
    return _group_norm(ctx, x, scale, bias, x.shape[1])


@onnx_op("BatchNormalization")
def _batch_norm(ctx: OnnxContext, x: Node, scale: Node, bias: Node, mean: Node, var: Node) -> Node:
    b = ctx.b
    if ctx.attr("training_mode", 0) or any(ctx.node.output[1:]):
        raise Unsupported("BatchNormalization in training mode (training_mode=1 or running-statistics outputs "
                          "requested): sextant compiles inference graphs; export the model in eval mode")
    eps = float(ctx.attr("epsilon", 1e-5))
    if ctx.attr("spatial", 1) or scale.type.rank == 1:
        return ctx.aten(aten._native_batch_norm_legit_no_training.default, x, scale, bias, mean, var, 0.0, eps)[0]
    t = opmath(x.dtype)  # opset < 9, spatial=0: statistics per (channel, spatial position)

    def stat(v: Node) -> Node:
        return b.reshape(b.cast(v, t), (1,) + v.shape)

    y = b.mul(b.sub(b.cast(x, t), stat(mean)), b.unary("rsqrt", b.add(stat(var), eps)))
    return b.cast(b.add(b.mul(y, stat(scale)), stat(bias)), x.dtype)


@onnx_op("LpNormalization")
def _lp_norm(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    p = int(ctx.attr("p", 2))
    if p not in (1, 2):
        raise Unsupported(f"LpNormalization with p={p} (onnx allows 1 or 2)")
    a = axis(ctx, x, default=-1)
    y = b.cast(x, opmath(x.dtype))
    norm = ctx.aten(aten.linalg_vector_norm.default, y, float(p), [a], True)
    norm = b.expand(norm, y.shape)
    out = b.where(b.binary("eq", norm, 0.0), 0.0, b.div(y, norm))  # a zero norm gives zeros, not NaN
    return b.cast(out, x.dtype)


@onnx_op("MeanVarianceNormalization")
def _mvn(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    axes = norm_axes(list(ctx.attr("axes", [0, 2, 3])), x.type.rank)
    y = b.cast(x, opmath(x.dtype))
    d = b.sub(y, b.expand(b.mean(y, axes), y.shape))
    std = b.unary("sqrt", b.mean(b.mul(d, d), axes))
    return b.cast(b.div(d, b.expand(b.add(std, 1e-9), y.shape)), x.dtype)


@onnx_op("LRN")
def _lrn(ctx: OnnxContext, x: Node) -> Node:
    """Sum of squares over a window of ``size`` channels: ``size`` shifted slices of a padded tensor."""
    b = ctx.b
    size = int(ctx.attr("size"))
    alpha, beta, bias = (float(ctx.attr(k, d)) for k, d in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    y = b.cast(x, opmath(x.dtype))
    c = x.shape[1]
    lo = (size - 1) // 2
    low, high = [0] * x.type.rank, [0] * x.type.rank
    low[1], high[1] = lo, size - 1 - lo
    sq = b.pad(b.mul(y, y), low, high)
    s = b.slice(sq, 1, 0, c)
    for k in range(1, size):
        s = b.add(s, b.slice(sq, 1, k, c))
    den = b.binary("pow", b.add(b.mul(s, alpha / size), bias), beta)
    return b.cast(b.div(y, den), x.dtype)


# -- losses ------------------------------------------------------------------------------------
def _nll(ctx: OnnxContext, logp: Node, target: Node, weight: Node | None) -> Node:
    """loss[n, d...] = -logp[n, target, d...] · weight[target], ignored targets 0, then reduced."""
    b = ctx.b
    reduction = ctx.attr("reduction", "mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction not in ("none", "sum", "mean"):
        raise Unsupported(f"{ctx.op_type}: reduction={reduction!r}")
    t = opmath(logp.dtype)
    lp = b.cast(logp, t)
    ii = ctx.attr("ignore_index")
    valid = None if ii is None else b.binary("ne", target, int(ii))
    safe = target if valid is None else b.where(valid, target, 0)  # an ignored target may be out of range
    idx = b.reshape(safe, (target.shape[0], 1) + target.shape[1:])
    loss = b.unary("neg", b.reshape(b.gather(lp, 1, idx), target.shape))
    w = None if weight is None else b.take(b.cast(weight, t), 0, safe)
    if valid is not None:
        w = b.cast(valid, t) if w is None else b.where(valid, w, 0.0)
    if w is not None:
        loss = b.mul(loss, w)
    if reduction != "none":
        every = list(range(loss.type.rank))
        loss = b.reshape(b.reduce("sum", loss, every), ())
        if reduction == "mean":
            den = b.reshape(b.reduce("sum", w, every), ()) if w is not None else float(target.type.numel)
            loss = b.div(loss, den)
    return b.cast(loss, logp.dtype)


@onnx_op("NegativeLogLikelihoodLoss")
def _nll_loss(ctx: OnnxContext, x: Node, target: Node, weight: Node | None = None) -> Node:
    return _nll(ctx, x, target, weight)


@onnx_op("SoftmaxCrossEntropyLoss")
def _sce_loss(ctx: OnnxContext, scores: Node, labels: Node, weights: Node | None = None) -> list[Node]:
    logp = ctx.aten(aten._log_softmax.default, scores, 1, False)
    return [_nll(ctx, logp, labels, weights), logp]


# -- TopK --------------------------------------------------------------------------------------
def _ahead(b: GraphBuilder, u: Node, v: Node) -> tuple[Node, Node]:
    """(u > v, u == v) in an order where NaN is the greatest value (as torch.topk ranks it)."""
    gt, eq = b.binary("gt", u, v), b.binary("eq", u, v)
    if u.dtype.is_float:
        nu, nv = b.unary("isnan", u), b.unary("isnan", v)
        gt = b.binary("bitwise_or", gt, b.binary("bitwise_and", nu, b.unary("logical_not", nv)))
        eq = b.binary("bitwise_or", eq, b.binary("bitwise_and", nu, nv))
    return gt, eq


@onnx_op("TopK")
def _topk(ctx: OnnxContext, x: Node, k_in: Node | None = None) -> list[Node]:
    """Sorted top-k with a static k, by ranking: rank[i] = #elements ahead of x[i] (ties: lower index first).

    O(n²) comparisons along the axis, which is fine for the sizes sextant targets; the indices of
    ranks 0..k-1 are then picked exactly (an integer sum) and the values gathered.
    """
    b = ctx.b
    k = ctx.ints(k_in, "K")[0] if k_in is not None else int(ctx.attr("k"))
    a = axis(ctx, x, default=-1)
    n = x.shape[a]
    if not 0 <= k <= n:
        raise Unsupported(f"TopK: k={k} for an axis of size {n}")
    perm = [d for d in range(x.type.rank) if d != a] + [a]
    xt = b.permute(x, perm)
    lead = xt.shape[:-1]
    xi, xj = b.broadcast(b.reshape(xt, lead + (n, 1)), b.reshape(xt, lead + (1, n)))  # [..., i, j]
    gt, eq = _ahead(b, xj, xi) if ctx.attr("largest", 1) else _ahead(b, xi, xj)
    earlier = b.binary("lt", b.iota((n, n), 1), b.iota((n, n), 0))  # j < i
    ahead = b.binary("bitwise_or", gt, b.binary("bitwise_and", eq, b.broadcast_to(earlier, eq.shape)))
    rank = b.reduce("sum", b.cast(ahead, DType.i64), [len(lead) + 1], keepdim=False)  # [..., n]
    hit = b.binary("eq", *b.broadcast(b.reshape(rank, lead + (1, n)), b.iota((k, n), 0)))  # [..., r, i]
    idx = b.reduce("sum", b.where(hit, b.broadcast_to(b.iota((k, n), 1), hit.shape), 0), [len(lead) + 1],
                   keepdim=False)  # [..., k]
    vals = b.gather(xt, len(lead), idx) if k else b.full(0, lead + (0,), x.dtype)
    inv = [perm.index(d) for d in range(x.type.rank)]
    return [b.permute(vals, inv), b.permute(idx, inv)]
