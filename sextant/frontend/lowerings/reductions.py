"""Lowerings of reductions and the normalisations built on them (softmax, LayerNorm, ...)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.ops import aten

from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower, opmath
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


def _axes(x: Node, dims: Sequence[int] | int | None) -> list[int]:
    if dims is None:
        return list(range(x.type.rank))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(x.type.rank))
    return [d % max(x.type.rank, 1) for d in dims] if x.type.rank else []


def _finish(ctx: LoweringContext, y: Node) -> Node:
    """Reshape a keepdim reduction result to the exact shape torch produced."""
    return ctx.b.reshape(y, ctx.out_shape())


@lower(aten.sum.dim_IntList, aten.sum.default)
def _sum(ctx: LoweringContext, x: Node, dims=None, keepdim: bool = False, *, dtype=None) -> Node:
    out = ctx.out_dtype()
    return _finish(ctx, ctx.b.reduce("sum", ctx.b.cast(x, out), _axes(x, dims)))


@lower(aten.prod.dim_int, aten.prod.default)
def _prod(ctx: LoweringContext, x: Node, dim=None, keepdim: bool = False, *, dtype=None) -> Node:
    return _finish(ctx, ctx.b.reduce("prod", ctx.b.cast(x, ctx.out_dtype()), _axes(x, dim)))


@lower(aten.mean.dim, aten.mean.default)
def _mean(ctx: LoweringContext, x: Node, dims=None, keepdim: bool = False, *, dtype=None) -> Node:
    out = ctx.out_dtype()
    y = ctx.b.mean(ctx.b.cast(x, opmath(out)), _axes(x, dims))
    return _finish(ctx, ctx.b.cast(y, out))


@lower(aten.amax.default, aten.max.default)
def _amax(ctx: LoweringContext, x: Node, dims=None, keepdim: bool = False) -> Node:
    return _finish(ctx, ctx.b.reduce("max", x, _axes(x, dims)))


@lower(aten.amin.default, aten.min.default)
def _amin(ctx: LoweringContext, x: Node, dims=None, keepdim: bool = False) -> Node:
    return _finish(ctx, ctx.b.reduce("min", x, _axes(x, dims)))


def arg_extreme(b: GraphBuilder, x: Node, axis: int, fn: str) -> tuple[Node, Node]:
    """(value, index) of the max/min along ``axis`` (keepdim), first occurrence, NaN wins — as torch."""
    m = b.reduce(fn, x, [axis])
    hit = b.binary("eq", x, b.expand(m, x.shape))
    if x.dtype.is_float:
        hit = b.binary("bitwise_or", hit, b.unary("isnan", x))
    n = x.shape[axis]
    idx = b.where(hit, b.iota(x.shape, axis, DType.i64), b.full(n, x.shape, DType.i64))
    return m, b.reduce("min", idx, [axis])


@lower(aten.max.dim, aten.min.dim)
def _max_dim(ctx: LoweringContext, x: Node, dim: int, keepdim: bool = False) -> tuple[Node, Node]:
    fn = "max" if ctx.fx_node.target == aten.max.dim else "min"
    if x.type.rank == 0:
        return x, ctx.b.full(0, (), DType.i64)
    v, i = arg_extreme(ctx.b, x, dim % x.type.rank, fn)
    return ctx.b.reshape(v, ctx.out_shape(0)), ctx.b.reshape(i, ctx.out_shape(1))


@lower(aten.argmax.default, aten.argmin.default)
def _argmax(ctx: LoweringContext, x: Node, dim=None, keepdim: bool = False) -> Node:
    fn = "max" if ctx.fx_node.target == aten.argmax.default else "min"
    if x.type.rank == 0:
        return ctx.b.full(0, (), DType.i64)
    if dim is None:
        x = ctx.b.reshape(x, (x.type.numel,))
        dim = 0
    _, i = arg_extreme(ctx.b, x, dim % x.type.rank, fn)
    return ctx.b.reshape(i, ctx.out_shape())


@lower(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def _any_all(ctx: LoweringContext, x: Node, dims=None, keepdim: bool = False) -> Node:
    fn = "max" if ctx.fx_node.target.overloadpacket == aten.any else "min"
    truth = x if x.dtype == DType.bool else ctx.b.binary("ne", x, 0)
    return _finish(ctx, ctx.b.reduce(fn, truth, _axes(x, dims)))


def _variance(b: GraphBuilder, x: Node, axes: list[int], correction: float) -> tuple[Node, Node]:
    """(var, mean) over ``axes`` (keepdim), two-pass for accuracy."""
    n = math.prod(x.shape[a] for a in axes)
    mean = b.mean(x, axes)
    d = b.sub(x, b.expand(mean, x.shape))
    ss = b.reduce("sum", b.mul(d, d), axes)
    if isinstance(n, int):
        return b.div(ss, float(max(n - correction, 0))), mean
    if not float(correction).is_integer():  # a symbolic count: Bessel's correction is 0 or 1
        raise Unsupported(f"a fractional correction {correction} over the symbolic count {n}")
    dof = n - int(correction)
    return b.div(ss, dof if dof >= 0 else 0), mean


@lower(aten.var.correction)
def _var(ctx: LoweringContext, x: Node, dims=None, *, correction=None, keepdim: bool = False) -> Node:
    out = ctx.out_dtype()
    y = ctx.b.cast(x, opmath(out))
    var, _ = _variance(ctx.b, y, _axes(x, dims), 1 if correction is None else correction)
    return _finish(ctx, ctx.b.cast(var, out))


@lower(aten.var_mean.correction)
def _var_mean(ctx: LoweringContext, x: Node, dims=None, *, correction=None, keepdim: bool = False):
    out = ctx.out_dtype(0)
    y = ctx.b.cast(x, opmath(out))
    var, mean = _variance(ctx.b, y, _axes(x, dims), 1 if correction is None else correction)
    return (ctx.b.reshape(ctx.b.cast(var, out), ctx.out_shape(0)),
            ctx.b.reshape(ctx.b.cast(mean, out), ctx.out_shape(1)))


def _scan(ctx: LoweringContext, x: Node, dim: int, fn: str) -> Node:
    return prefix(ctx.b, ctx.b.cast(x, ctx.out_dtype()), dim, fn)


def prefix(b: GraphBuilder, x: Node, dim: int, fn: str = "sum") -> Node:
    """Inclusive prefix sum/prod along ``dim`` as a masked reduction: y[i] = ⊕_{j<=i} x[j]."""
    if x.type.rank == 0:
        return x
    dim %= x.type.rank
    n = x.shape[dim]
    perm = [d for d in range(x.type.rank) if d != dim] + [dim]
    xt = b.permute(x, perm)  # [..., n]
    lead = xt.shape[:-1]
    xe = b.expand(b.reshape(xt, (*lead, 1, n)), (*lead, n, n))  # [..., i, j]
    mask = b.binary("le", b.iota((n, n), 1), b.iota((n, n), 0))  # j <= i
    masked = b.where(b.broadcast_to(mask, xe.shape), xe, 0 if fn == "sum" else 1)
    y = b.reshape(b.reduce(fn, masked, [len(lead) + 1]), (*lead, n))
    inv = [perm.index(d) for d in range(x.type.rank)]
    return b.permute(y, inv)


@lower(aten.cumsum.default)
def _cumsum(ctx: LoweringContext, x: Node, dim: int, *, dtype=None) -> Node:
    return _scan(ctx, x, dim, "sum")


@lower(aten.cumprod.default)
def _cumprod(ctx: LoweringContext, x: Node, dim: int, *, dtype=None) -> Node:
    return _scan(ctx, x, dim, "prod")


def softmax_terms(b: GraphBuilder, y: Node, dim: int) -> tuple[Node, Node, Node, Node]:
    """(max, y - max, exp(y - max), sum) along ``dim`` (keepdim): the one softmax form every lowering emits.

    Shared so that softmax, log_softmax and attention reach the scheduler (and its pattern
    matchers) as the same max → sub → exp → sum chain.
    """
    m = b.reduce("max", y, [dim])
    shifted = b.sub(y, b.expand(m, y.shape))
    e = b.unary("exp", shifted)
    return m, shifted, e, b.reduce("sum", e, [dim])


@lower(aten._softmax.default, aten._log_softmax.default)
def _softmax(ctx: LoweringContext, x: Node, dim: int, half_to_float: bool) -> Node:
    b = ctx.b
    out = ctx.out_dtype()
    if x.type.rank == 0:
        return b.full(0.0 if ctx.fx_node.target == aten._log_softmax.default else 1.0, (), out)
    y = b.cast(x, opmath(x.dtype))
    _, shifted, e, s = softmax_terms(b, y, dim % x.type.rank)
    if ctx.fx_node.target == aten._log_softmax.default:
        r = b.sub(shifted, b.expand(b.unary("log", s), y.shape))
    else:
        r = b.div(e, b.expand(s, y.shape))
    return b.cast(r, out)


@lower(aten.logsumexp.default)
def _logsumexp(ctx: LoweringContext, x: Node, dims, keepdim: bool = False) -> Node:
    b = ctx.b
    out = ctx.out_dtype()
    y = b.cast(x, opmath(out))
    axes = _axes(x, dims)
    m = b.reduce("max", y, axes)
    # A row of -inf (or +inf) would give inf - inf; shift by 0 there, as torch does.
    m = b.where(b.unary("isinf", m), 0.0, m)
    s = b.reduce("sum", b.unary("exp", b.sub(y, b.expand(m, y.shape))), axes)
    return _finish(ctx, b.cast(b.add(b.unary("log", s), m), out))


@lower(aten.native_layer_norm.default)
def _layer_norm(ctx: LoweringContext, x: Node, normalized_shape, weight, bias, eps: float):
    b = ctx.b
    y = b.cast(x, opmath(x.dtype))
    k = len(normalized_shape)
    axes = list(range(x.type.rank - k, x.type.rank))
    var, mean = _variance(b, y, axes, 0)
    rstd = b.unary("rsqrt", b.add(var, float(eps)))
    out = b.mul(b.sub(y, b.expand(mean, y.shape)), b.expand(rstd, y.shape))
    if weight is not None:
        out = b.mul(out, b.cast(weight, out.dtype))
    if bias is not None:
        out = b.add(out, b.cast(bias, out.dtype))
    return (b.cast(out, x.dtype), b.reshape(b.cast(mean, ctx.out_dtype(1)), ctx.out_shape(1)),
            b.reshape(b.cast(rstd, ctx.out_dtype(2)), ctx.out_shape(2)))


def _channel(b: GraphBuilder, v: Node, rank: int, dtype: DType) -> Node:
    """A per-channel vector [C] shaped to broadcast against [N, C, *spatial]."""
    return b.reshape(b.cast(v, dtype), (1, v.shape[0]) + (1,) * (rank - 2))


@lower(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(ctx: LoweringContext, x: Node, weight, bias, running_mean, running_var,
                     momentum: float, eps: float):
    b = ctx.b
    t = opmath(x.dtype)
    y = b.cast(x, t)
    scale = b.unary("rsqrt", b.add(b.cast(running_var, t), float(eps)))
    if weight is not None:
        scale = b.mul(scale, b.cast(weight, t))
    shift = b.unary("neg", b.mul(b.cast(running_mean, t), scale))
    if bias is not None:
        shift = b.add(shift, b.cast(bias, t))
    out = b.add(b.mul(y, _channel(b, scale, y.type.rank, t)), _channel(b, shift, y.type.rank, t))
    # The saved mean/invstd are unused in eval mode; torch records them as [0] on the CPU and as
    # [C] (never computed) on CUDA, so take the shape torch recorded rather than assume one.
    saved = b.full(0, ctx.out_shape(1), ctx.out_dtype(1))
    return b.cast(out, x.dtype), saved, saved


@lower(aten._native_batch_norm_legit_functional.default)
def _batch_norm_functional(ctx: LoweringContext, x: Node, weight, bias, running_mean: Node, running_var: Node,
                           training: bool, momentum: float, eps: float):
    """Batch norm as functionalisation leaves it: (out, saved mean, saved 1/std, new running mean,
    new running var). In training the statistics are the batch's, over every axis but the channel,
    and the running ones move towards them by ``momentum`` (the variance unbiased, as torch's)."""
    if not training:
        out, saved, _ = _batch_norm_eval(ctx, x, weight, bias, running_mean, running_var, momentum, eps)
        return out, saved, saved, running_mean, running_var
    b = ctx.b
    out, mean, rstd, var = _batch_stats_norm(ctx, x, weight, bias, eps)
    n = math.prod(x.shape[a] for a in range(x.type.rank) if a != 1)
    if not isinstance(n, int):
        raise Unsupported("batch norm in training mode over a symbolic batch size (the unbiased running variance)")

    def moved(old: Node, new: Node) -> Node:
        t = opmath(old.dtype)
        return b.cast(b.add(b.mul(b.cast(old, t), 1.0 - momentum), b.mul(new, float(momentum))), old.dtype)

    unbiased = b.mul(var, n / max(n - 1, 1))
    return (out, b.cast(mean, ctx.out_dtype(1)), b.cast(rstd, ctx.out_dtype(2)),
            moved(running_mean, mean), moved(running_var, unbiased))


@lower(aten._native_batch_norm_legit.no_stats)
def _batch_norm_no_stats(ctx: LoweringContext, x: Node, weight, bias, training: bool, momentum: float, eps: float):
    """Batch norm with no running statistics (``track_running_stats=False``): always the batch's."""
    out, mean, rstd, _ = _batch_stats_norm(ctx, x, weight, bias, eps)
    return out, ctx.b.cast(mean, ctx.out_dtype(1)), ctx.b.cast(rstd, ctx.out_dtype(2))


def _batch_stats_norm(ctx: LoweringContext, x: Node, weight, bias, eps: float) -> tuple[Node, Node, Node, Node]:
    """(normalised output, mean [C], 1/std [C], biased variance [C]) with the batch's statistics."""
    b = ctx.b
    t = opmath(x.dtype)
    y = b.cast(x, t)
    axes = [a for a in range(x.type.rank) if a != 1]
    var, mean = _variance(b, y, axes, 0)
    rstd = b.unary("rsqrt", b.add(var, float(eps)))
    out = b.mul(b.sub(y, b.expand(mean, y.shape)), b.expand(rstd, y.shape))
    if weight is not None:
        out = b.mul(out, _channel(b, weight, x.type.rank, t))
    if bias is not None:
        out = b.add(out, _channel(b, bias, x.type.rank, t))
    c = (x.shape[1],)
    return b.cast(out, x.dtype), b.reshape(mean, c), b.reshape(rstd, c), b.reshape(var, c)


@lower(aten._native_batch_norm_legit.default, aten.native_batch_norm.default)
def _batch_norm_train(ctx: LoweringContext, *args, **kwargs):
    raise Unsupported("batch norm updating its running statistics in place (expected the functional form "
                      "torch.export and AOTAutograd produce)")


@lower(aten.native_group_norm.default)
def _group_norm(ctx: LoweringContext, x: Node, weight, bias, n: int, c: int, hw: int, groups: int, eps: float):
    b = ctx.b
    t = opmath(x.dtype)
    y = b.reshape(b.cast(x, t), (n, groups, (c // groups) * hw))
    var, mean = _variance(b, y, [2], 0)
    rstd = b.unary("rsqrt", b.add(var, float(eps)))
    out = b.reshape(b.mul(b.sub(y, b.expand(mean, y.shape)), b.expand(rstd, y.shape)), x.shape)
    if weight is not None:
        out = b.mul(out, _channel(b, weight, x.type.rank, t))
    if bias is not None:
        out = b.add(out, _channel(b, bias, x.type.rank, t))
    return (b.cast(out, x.dtype), b.reshape(b.cast(mean, ctx.out_dtype(1)), ctx.out_shape(1)),
            b.reshape(b.cast(rstd, ctx.out_dtype(2)), ctx.out_shape(2)))


# -- norms ---------------------------------------------------------------------------------------
def p_norm(b: GraphBuilder, x: Node, axes: Sequence[int], p: float) -> Node:
    """The vector p-norm of ``x`` over ``axes`` (keepdim), as torch.linalg.vector_norm defines it."""
    a = b.unary("abs", x)
    if p == math.inf:
        return b.reduce("max", a, axes)
    if p == -math.inf:
        return b.reduce("min", a, axes)
    if p == 0:
        return b.reduce("sum", b.cast(b.binary("ne", a, 0), a.dtype), axes)
    if p == 1:
        return b.reduce("sum", a, axes)
    if p == 2:
        return b.unary("sqrt", b.reduce("sum", b.mul(a, a), axes))
    return b.binary("pow", b.reduce("sum", b.binary("pow", a, p), axes), 1.0 / p)


@lower(aten.linalg_vector_norm.default)
def _vector_norm(ctx: LoweringContext, x: Node, ord=2, dim=None, keepdim: bool = False, *, dtype=None) -> Node:
    return _finish(ctx, p_norm(ctx.b, ctx.b.cast(x, ctx.out_dtype()), _axes(x, dim), float(ord)))


@lower(aten.dist.default)
def _dist(ctx: LoweringContext, a: Node, other: Node, p=2) -> Node:
    d = ctx.b.sub(ctx.b.cast(a, ctx.out_dtype()), ctx.b.cast(other, ctx.out_dtype()))
    return _finish(ctx, p_norm(ctx.b, d, range(d.type.rank), float(p)))


@lower(aten._cdist_forward.default)
def _cdist(ctx: LoweringContext, x1: Node, x2: Node, p: float, compute_mode=None) -> Node:
    """Pairwise p-norm distances of the rows of ``x1`` [..., P, M] and ``x2`` [..., R, M]."""
    b = ctx.b
    a = b.reshape(x1, x1.shape[:-1] + (1, x1.shape[-1]))  # [..., P, 1, M]
    c = b.reshape(x2, x2.shape[:-2] + (1,) + x2.shape[-2:])  # [..., 1, R, M]
    d = b.sub(*b.broadcast(a, c))
    return _finish(ctx, p_norm(b, d, [d.type.rank - 1], float(p)))


@lower(aten._pdist_forward.default)
def _pdist(ctx: LoweringContext, x: Node, p: float = 2.0) -> Node:
    """Distances between rows i < j of ``x`` [N, M], in row-major pair order."""
    b = ctx.b
    n = x.shape[0]
    if n < 2:
        return b.full(0, ctx.out_shape(), ctx.out_dtype())
    i, j = torch.triu_indices(n, n, 1)
    rows = [b.take(x, 0, b.param(f"pdist.{k}.{len(b.params)}", t.contiguous())) for k, t in (("i", i), ("j", j))]
    return _finish(ctx, p_norm(b, b.sub(*rows), [1], float(p)))


# -- searching sorted sequences: the insertion point is a count ------------------------------------
def _insertion_point(ctx: LoweringContext, seq: Node, values: Node, right: bool, sorter=None) -> Node:
    """Count of ``seq`` elements before each value, as torch's binary search finds it (NaN sorts last)."""
    b = ctx.b
    if sorter is not None:
        seq = b.gather(seq, seq.type.rank - 1, sorter)
    dtype = ctx.promote(seq, values)
    seq, values = b.cast(seq, dtype), b.cast(values, dtype)
    if seq.type.rank == 1:  # one boundary list for every value
        s = b.reshape(seq, (1,) * values.type.rank + seq.shape)
        v = b.reshape(values, values.shape + (1,))
    else:  # one sorted row per leading index: values [..., M] against seq [..., N]
        s = b.reshape(seq, seq.shape[:-1] + (1, seq.shape[-1]))
        v = b.reshape(values, values.shape + (1,))
    s, v = b.broadcast(s, v)
    before = b.unary("logical_not", b.binary("gt" if right else "ge", s, v))
    count = b.reduce("sum", b.cast(before, DType.i64), [s.type.rank - 1], keepdim=False)
    return b.cast(count, ctx.out_dtype())


@lower(aten.searchsorted.Tensor)
def _searchsorted(ctx: LoweringContext, seq: Node, values: Node, *, out_int32: bool = False, right: bool = False,
                  side=None, sorter=None) -> Node:
    return _insertion_point(ctx, seq, values, right or side == "right", sorter)


@lower(aten.bucketize.Tensor)
def _bucketize(ctx: LoweringContext, values: Node, boundaries: Node, *, out_int32: bool = False,
               right: bool = False) -> Node:
    return _insertion_point(ctx, boundaries, values, right)
