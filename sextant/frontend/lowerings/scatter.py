"""Lowerings of scatters (scatter, scatter_reduce, index_put, index_copy, put, index_reduce).

Whole slices written at positions along one dim — ``x[:, :, pos] = v``, ``x.index_copy_(d, pos, v)``,
a KV-cache update — become the graph's ``scatter`` primitive: linear in what is written, and
written in place where ``graph/passes/in_place_updates.py`` proves it safe.

Sums — ``x[idx] += v`` (``index_put(accumulate=True)``: ``index_add`` and the embedding backward
decompose to it), ``scatter_add``, ``scatter_reduce(sum)``, ``put(accumulate=True)`` — become an
adding ``scatter`` (``reduce="add"``): slices at positions along one dim where the indices
allow (one indexed dim, or several linearised into one), else a scatter of single elements of the
flattened tensor (per-element indices: each element's linear position computed from its index and
its own coordinates). Either way the work is the source's size.

Every other scatter (per-element indices with prod/amax/amin/mean or overwriting) is a one-hot
reduction: along the scattered dim, output position p combines every source element k whose
index is p — the lowering compares the index with every position (a [P, K] match mask per
row), masks the source values with ``where`` and reduces over K. That costs P·K per row, so past
``DENSE_LIMIT`` comparisons the lowering refuses (the op then runs as an extern call).
"""

from __future__ import annotations

import math

import torch
from torch.ops import aten

from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

_REDUCE_FN = {"sum": "sum", "mean": "sum", "prod": "prod", "amax": "max", "amin": "min"}
_COMBINE = {"sum": "add", "prod": "mul", "amax": "maximum", "amin": "minimum"}


def _identity(reduce: str, dtype: DType) -> int | float:
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if dtype.is_float:
        return -math.inf if reduce == "amax" else math.inf
    info = torch.iinfo(dtype.torch)
    return info.min if reduce == "amax" else info.max


def _crop(b: GraphBuilder, x: Node, shape: tuple[int, ...], skip: int | None = None) -> Node:
    """The leading ``shape`` corner of ``x`` (dim ``skip`` kept whole)."""
    for d, n in enumerate(shape):
        if d != skip:
            x = b.slice(x, d, 0, n)
    return x


def _paste(b: GraphBuilder, x: Node, corner: Node) -> Node:
    """``x`` with its leading corner replaced by ``corner``."""
    if corner.shape == x.shape:
        return corner
    padded = b.pad(corner, [0] * x.type.rank, [n - c for n, c in zip(x.shape, corner.shape)], 0)
    inside = None
    for d, c in enumerate(corner.shape):
        if c != x.shape[d]:
            lt = b.binary("lt", b.iota(x.shape, d), c)
            inside = lt if inside is None else b.binary("bitwise_and", inside, lt)
    return b.where(inside, padded, x)


DENSE_LIMIT = 1 << 28  # comparisons a one-hot scatter may cost (positions × source elements)


def scatter_elements(b: GraphBuilder, x: Node, dim: int, index: Node, src: Node, reduce: str | None = "add") -> Node:
    """``x`` with ``src[e]`` added (``reduce=None``: written) at ``x[e with its dim-th coordinate
    replaced by index[e]]`` for every element ``e`` of ``index`` (torch.scatter_add): a scatter of
    single elements of the flattened ``x``, each element's linear position computed from its index
    and its own coordinates. A position outside ``[0, n)`` along ``dim`` becomes -1, which the
    scatter drops, rather than landing in a neighbouring row."""
    ishape, n = index.shape, x.shape[dim]
    k = math.prod(ishape)
    if k == 0 or x.type.numel == 0:
        return x
    pos = b.cast(index, DType.i64)
    lin = b.mul(pos, math.prod(x.shape[dim + 1:]))
    for d, (size, stride) in enumerate(zip(ishape, _strides(x.shape))):
        if d != dim and size > 1:
            lin = b.add(lin, b.mul(b.iota(ishape, d, DType.i64), stride))
    inside = b.binary("bitwise_and", b.binary("ge", pos, 0), b.binary("lt", pos, n))
    lin = b.where(inside, lin, b.full(-1, ishape, DType.i64))
    vals = b.reshape(b.cast(_crop(b, src, ishape), x.dtype), (k,))
    out = b.scatter(b.reshape(x, (x.type.numel,)), 0, b.reshape(lin, (k,)), vals, reduce=reduce)
    return b.reshape(out, x.shape)


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def scatter_reduce(b: GraphBuilder, x: Node, dim: int, index: Node, src: Node, reduce: str,
                   include_self: bool = True) -> Node:
    """torch.scatter_reduce: ``x`` with ``src[k]`` combined into position ``index[k]`` along ``dim``.

    ``reduce`` is "assign" (plain scatter: the last write wins), "sum", "prod", "amax", "amin" or "mean".
    Only the leading ``index.shape`` corner of ``src`` takes part, as in torch. A sum is an adding
    scatter (``scatter_elements``); ``include_self=False`` first zeroes the positions it hits.
    """
    if x.type.rank == 0:
        one = (1,)
        out = scatter_reduce(b, b.reshape(x, one), 0, b.reshape(index, one), b.reshape(src, one), reduce, include_self)
        return b.reshape(out, ())
    if index.type.numel == 0:
        return x
    if x.dtype == DType.bool and reduce != "assign":
        raise Unsupported(f"scatter with reduce={reduce!r} on a bool tensor")
    dim %= x.type.rank
    ishape, n = index.shape, x.shape[dim]
    if reduce == "sum":
        if not include_self:
            x = scatter_elements(b, x, dim, index, b.full(0, ishape, x.dtype), reduce=None)
        return scatter_elements(b, x, dim, index, src)
    if n * math.prod(ishape) > DENSE_LIMIT:
        raise Unsupported(f"scatter with reduce={reduce!r} of {math.prod(ishape)} elements into {n} positions "
                          f"(a one-hot match of {n} x {math.prod(ishape)} is past DENSE_LIMIT)")
    region = _crop(b, x, ishape, skip=dim)  # [.., P, ..]
    vals = b.cast(_crop(b, src, ishape), x.dtype)  # [.., K, ..]
    k_axis = dim + 1
    full = ishape[:dim] + (n,) + ishape[dim:]  # [.., P, K, ..]
    lift = ishape[:dim] + (1,) + ishape[dim:]
    match = b.binary("eq", b.expand(b.reshape(b.cast(index, DType.i64), lift), full), b.iota(full, dim))
    v = b.expand(b.reshape(vals, lift), full)
    hit = b.reshape(b.reduce("max", match, [k_axis]), region.shape)
    if reduce == "assign":
        last = b.reduce("max", b.where(match, b.iota(full, k_axis), -1), [k_axis])
        new = b.reshape(b.gather(v, k_axis, b.maximum(last, 0)), region.shape)
    else:
        agg = b.reshape(b.reduce(_REDUCE_FN[reduce], b.where(match, v, _identity(reduce, x.dtype)), [k_axis]),
                        region.shape)
        if reduce == "mean":
            count = b.reshape(b.reduce("sum", b.cast(match, x.dtype), [k_axis]), region.shape)
            if include_self:
                agg, count = b.add(agg, region), b.add(count, 1)
            new = b.binary("div" if x.dtype.is_float else "floordiv", agg, b.maximum(count, 1))
        else:
            new = b.binary(_COMBINE[reduce], region, agg) if include_self else agg
    return _paste(b, x, b.where(hit, new, region))


def _wrap(b: GraphBuilder, idx: Node, n: int) -> Node:
    idx = b.cast(idx, DType.i64)
    return b.where(b.binary("lt", idx, 0), b.add(idx, n), idx)


def _source(ctx: LoweringContext, src, index: Node, x: Node) -> Node:
    return src if isinstance(src, Node) else ctx.b.full(src, index.shape, x.dtype)


@lower(aten.scatter.src, aten.scatter.value)
def _scatter(ctx: LoweringContext, x: Node, dim: int, index: Node, src) -> Node:
    return scatter_reduce(ctx.b, x, dim, index, _source(ctx, src, index, x), "assign")


@lower(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_legacy(ctx: LoweringContext, x: Node, dim: int, index: Node, src, *, reduce: str) -> Node:
    op = {"add": "sum", "multiply": "prod"}[reduce]
    return scatter_reduce(ctx.b, x, dim, index, _source(ctx, src, index, x), op)


@lower(aten.scatter_add.default)
def _scatter_add(ctx: LoweringContext, x: Node, dim: int, index: Node, src: Node) -> Node:
    return scatter_reduce(ctx.b, x, dim, index, src, "sum")


@lower(aten.scatter_reduce.two)
def _scatter_reduce(ctx: LoweringContext, x: Node, dim: int, index: Node, src: Node, reduce: str, *,
                    include_self: bool = True) -> Node:
    return scatter_reduce(ctx.b, x, dim, index, src, reduce, include_self)


@lower(aten.index_reduce.default)
def _index_reduce(ctx: LoweringContext, x: Node, dim: int, index: Node, source: Node, reduce: str, *,
                  include_self: bool = True) -> Node:
    b = ctx.b
    if x.type.rank == 0:
        return scatter_reduce(b, x, 0, index, source, reduce, include_self)
    dim %= x.type.rank
    shape = tuple(index.type.numel if d == dim else 1 for d in range(x.type.rank))
    lifted = b.reshape(_wrap(b, index, x.shape[dim]), shape)
    return scatter_reduce(b, x, dim, b.expand(lifted, source.shape), source, reduce, include_self)


@lower(aten.put.default)
def _put(ctx: LoweringContext, x: Node, index: Node, source: Node, accumulate: bool = False) -> Node:
    b = ctx.b
    n, k = x.type.numel, index.type.numel
    lin = _wrap(b, b.reshape(index, (k,)), n)
    out = scatter_reduce(b, b.reshape(x, (n,)), 0, lin, b.reshape(source, (k,)), "sum" if accumulate else "assign")
    return b.reshape(out, x.shape)


def slices_put(b: GraphBuilder, x: Node, dim: int, index: Node, values: Node, negative: bool = True) -> Node:
    """``x`` with slice ``values[.., k, ..]`` written at position ``index[k]`` along ``dim`` (``index``
    0-D or 1-D, ``negative`` positions counted from the end as index_put does — index_copy refuses
    them; ``values`` broadcast to the slices)."""
    dim %= x.type.rank
    k = index.type.numel
    pos = b.reshape(_wrap(b, index, x.shape[dim]) if negative else b.cast(index, DType.i64), (k,))
    shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
    if index.type.rank == 0 and values.type.rank < x.type.rank:  # x[.., i, ..] = v: v's slice lacks the dim
        values = b.reshape(b.broadcast_to(values, x.shape[:dim] + x.shape[dim + 1:]), shape)
    return b.scatter(x, dim, pos, b.cast(b.broadcast_to(values, shape), x.dtype))


@lower(aten.index_copy.default)
def _index_copy(ctx: LoweringContext, x: Node, dim: int, index: Node, source: Node) -> Node:
    if x.type.rank == 0:
        return ctx.b.reshape(slices_put(ctx.b, ctx.b.reshape(x, (1,)), 0, index, source, False), ())
    return slices_put(ctx.b, x, dim, index, source, negative=False)


@lower(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(ctx: LoweringContext, x: Node, indices, values: Node, accumulate: bool = False) -> Node:
    """``x[indices] = values`` (or ``+=``): whole slices at positions along one dim are a ``scatter``,
    as is every ``+=`` (an adding one, the indexed dims linearised into one where there are several);
    an overwrite through several indexed dims is a one-hot reduction along the linearised dims."""
    b = ctx.b
    rank = x.type.rank
    pos = [d for d, ix in enumerate(indices) if ix is not None]
    if any(indices[d].dtype == DType.bool for d in pos):
        return _mask_put(ctx, x, pos, indices, values, accumulate)
    if len(pos) == 1 and not accumulate and indices[pos[0]].type.rank <= 1 and rank > 0:
        return slices_put(b, x, pos[0], indices[pos[0]], values)
    if len(pos) == 1 and accumulate and x.dtype != DType.bool:  # x[idx] += v: slices added along one dim
        d, ix = pos[0], indices[pos[0]]
        k = ix.type.numel
        if k == 0 or x.type.numel == 0:
            return x
        v = b.broadcast_to(b.cast(values, x.dtype), x.shape[:d] + ix.shape + x.shape[d + 1:])
        v = b.reshape(v, x.shape[:d] + (k,) + x.shape[d + 1:])
        return b.scatter(x, d, b.reshape(_wrap(b, ix, x.shape[d]), (k,)), v, reduce="add")
    idx = b.broadcast(*(indices[d] for d in pos))
    bshape, nb = idx[0].shape, idx[0].type.rank
    rest = [d for d in range(rank) if d not in pos]
    rest_shape = tuple(x.shape[d] for d in rest)
    sizes = [x.shape[d] for d in pos]
    k = math.prod(bshape)
    if k == 0 or x.type.numel == 0:
        return x
    linear, stride = None, 1
    for d, ix in reversed(list(zip(pos, idx))):
        term = b.mul(_wrap(b, ix, x.shape[d]), stride)
        linear = term if linear is None else b.add(linear, term)
        stride *= x.shape[d]
    # values as laid out by x[indices]: the index dims replace the indexed dims if those are adjacent
    if pos == list(range(pos[0], pos[-1] + 1)) and pos[0] > 0:
        res = x.shape[:pos[0]] + bshape + x.shape[pos[-1] + 1:]
        v = b.permute(b.broadcast_to(values, res), list(range(pos[0], pos[0] + nb)) + list(range(pos[0]))
                      + list(range(pos[0] + nb, len(res))))
    else:
        v = b.broadcast_to(values, bshape + rest_shape)
    v = b.reshape(b.cast(v, x.dtype), (k,) + rest_shape)
    flat = b.reshape(b.permute(x, pos + rest), (math.prod(sizes),) + rest_shape)
    if accumulate and x.dtype != DType.bool:  # the indexed dims linearised: slices added along one
        out = b.scatter(flat, 0, b.reshape(linear, (k,)), v, reduce="add")
    else:
        ind = b.expand(b.reshape(linear, (k,) + (1,) * len(rest)), (k,) + rest_shape)
        out = scatter_reduce(b, flat, 0, ind, v, "sum" if accumulate else "assign")
    out = b.reshape(out, tuple(sizes) + rest_shape)
    perm = pos + rest
    return b.permute(out, [perm.index(d) for d in range(rank)])


def _mask_put(ctx: LoweringContext, x: Node, pos: list[int], indices, values: Node, accumulate: bool) -> Node:
    """``x[mask] = values`` where one value (row) is broadcast to every selected element: a ``where``."""
    b = ctx.b
    if len(pos) != 1:
        raise Unsupported("index_put with a boolean mask combined with other indices")
    d0, mask = pos[0], indices[pos[0]]
    mr, rank = mask.type.rank, x.type.rank
    vshape = (1,) * (rank - mr + 1 - values.type.rank) + values.shape  # as x[mask]: [before, N_true, after]
    if vshape[d0] != 1:
        raise Unsupported("index_put with a boolean mask and one value per selected element (data-dependent)")
    v = b.broadcast_to(b.reshape(b.cast(values, x.dtype), vshape[:d0] + (1,) * mr + vshape[d0 + 1:]), x.shape)
    m = b.broadcast_to(b.reshape(mask, (1,) * d0 + mask.shape + (1,) * (rank - d0 - mr)), x.shape)
    return b.where(m, b.add(x, v) if accumulate else v, x)


@lower(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(ctx: LoweringContext, grad: Node, x: Node, kernel, stride, padding, dilation,
                         ceil_mode: bool, indices: Node) -> Node:
    """Each output's gradient goes to the input element its max came from (a scatter-add per plane)."""
    b = ctx.b
    lead, plane = x.shape[:-2], x.shape[-2] * x.shape[-1]
    k = grad.shape[-2] * grad.shape[-1]
    zeros = b.full(0, lead + (plane,), grad.dtype)
    out = scatter_reduce(b, zeros, len(lead), b.reshape(indices, lead + (k,)), b.reshape(grad, lead + (k,)), "sum")
    return b.reshape(out, x.shape)
