"""Lowerings of strided views (diagonal, unfold, as_strided), the scatters that write them back,
and mask-driven ops whose result shape is static (masked_scatter, nonzero_static).

The element each output reads is a static function of its position, so a view is a ``slice``
or a ``gather`` with a computed index, and a scatter is a ``gather`` from the source plus a
``where`` that keeps the untouched elements. For the mask-driven ops the index is a prefix
count of the mask.
"""

from __future__ import annotations

import math

import torch
from torch.ops import aten

from sextant.frontend.lowerings.reductions import prefix
from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


def _to_last(b: GraphBuilder, x: Node, d1: int, d2: int) -> tuple[Node, list[int]]:
    """``x`` with dims ``d1, d2`` moved to the end, and the permutation that undoes it."""
    perm = [d for d in range(x.type.rank) if d not in (d1, d2)] + [d1, d2]
    return b.permute(x, perm), [perm.index(d) for d in range(x.type.rank)]


@lower(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(ctx: LoweringContext, x: Node, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Node:
    """Element (i, i + offset) of an [n, m] plane is flat index i * (m + 1) + offset: one strided slice."""
    b = ctx.b
    y, _ = _to_last(b, x, dim1 % x.type.rank, dim2 % x.type.rank)
    n, m = y.shape[-2:]
    size = ctx.out_shape()[-1]
    if size == 0:
        return b.full(0, ctx.out_shape(), x.dtype)
    flat = b.reshape(y, y.shape[:-2] + (n * m,))
    return b.slice(flat, -1, offset if offset >= 0 else -offset * m, size, m + 1)


@lower(aten.diagonal_scatter.default)
def _diagonal_scatter(ctx: LoweringContext, x: Node, src: Node, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """Where j - i == offset, (i, j) takes src[min(i, j) shifted by the offset]; elsewhere x."""
    b = ctx.b
    y, inv = _to_last(b, x, dim1 % x.type.rank, dim2 % x.type.rank)
    n, m = y.shape[-2:]
    size = src.shape[-1]
    if size == 0:
        return x
    i, j = b.iota((n, m), 0), b.iota((n, m), 1)
    on_diag = b.binary("eq", b.sub(j, i), offset)
    k = b.minimum(i if offset >= 0 else j, size - 1)  # which diagonal element lands at (i, j)
    vals = b.take(b.cast(src, x.dtype), src.type.rank - 1, k)  # [..., n, m]
    return b.permute(b.where(b.broadcast_to(on_diag, y.shape), vals, y), inv)


def _embed(b: GraphBuilder, x: Node, src: Node, dim: int, start: int, step: int) -> Node:
    """``x`` with ``x[start::step][:len(src)]`` along ``dim`` replaced by ``src``."""
    size = src.shape[dim]
    if size == 0 or x.type.numel == 0:
        return x
    rel = b.sub(b.iota(x.shape, dim), start)
    k = b.binary("floordiv", rel, step)
    hit = b.binary("bitwise_and", b.binary("eq", b.mul(k, step), rel),
                   b.binary("bitwise_and", b.binary("ge", k, 0), b.binary("lt", k, size)))
    k = b.minimum(b.maximum(k, 0), size - 1)
    return b.where(hit, b.gather(b.cast(src, x.dtype), dim, k), x)


@lower(aten.slice_scatter.default)
def _slice_scatter(ctx: LoweringContext, x: Node, src: Node, dim: int = 0, start=None, end=None, step: int = 1):
    dim %= x.type.rank
    s, _, _ = slice(start, end, step).indices(x.shape[dim])
    return _embed(ctx.b, x, src, dim, s, step)


@lower(aten.unfold.default)
def _unfold(ctx: LoweringContext, x: Node, dim: int, size: int, step: int) -> Node:
    """Windows ``x[w*step : w*step+size]`` along ``dim``, the window index in place of ``dim``, offsets last."""
    b = ctx.b
    if x.type.rank == 0:
        return b.reshape(x, ctx.out_shape())
    dim %= x.type.rank
    windows = ctx.out_shape()[dim]
    if windows * size == 0:
        return b.full(0, ctx.out_shape(), x.dtype)
    idx = b.add(b.mul(b.iota((windows, size), 0), step), b.iota((windows, size), 1))
    y = b.take(x, dim, idx)  # [..., windows, size, ...]
    perm = [d for d in range(y.type.rank) if d != dim + 1] + [dim + 1]
    return b.permute(y, perm)


# -- as_strided: positions in the input's (contiguous) storage ---------------------------------------
def _storage_index(ctx: LoweringContext, size, stride, storage_offset) -> torch.Tensor:
    """The storage position each element of ``as_strided(size, stride, offset)`` reads."""
    inp = ctx.fx_node.args[0].meta.get("val")
    if inp is None or not inp.is_contiguous() or inp.storage_offset() != 0:
        raise Unsupported("as_strided of a tensor that is not contiguous from the start of its storage")
    idx = torch.full(tuple(size), int(storage_offset or 0), dtype=torch.int64)
    for d, (n, st) in enumerate(zip(size, stride)):
        view = [1] * len(size)
        view[d] = n
        idx = idx + (torch.arange(n) * st).reshape(view)
    if idx.numel() and int(idx.max()) >= inp.numel():
        raise Unsupported("as_strided reading past the end of the input tensor")
    return idx


def _index_param(b: GraphBuilder, idx: torch.Tensor, what: str) -> Node:
    return b.param(f"{what}.{len(b.params)}", idx)


@lower(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(ctx: LoweringContext, x: Node, size, stride, storage_offset=None) -> Node:
    b = ctx.b
    idx = _storage_index(ctx, size, stride, storage_offset)
    if idx.numel() == 0:
        return b.full(0, ctx.out_shape(), x.dtype)
    flat = b.reshape(x, (x.type.numel,))
    return b.take(flat, 0, _index_param(b, idx, "as_strided.index"))


@lower(aten.as_strided_scatter.default)
def _as_strided_scatter(ctx: LoweringContext, x: Node, src: Node, size, stride, storage_offset=None) -> Node:
    b = ctx.b
    idx = _storage_index(ctx, size, stride, storage_offset).flatten()
    if idx.numel() == 0:
        return x
    source = torch.full((x.type.numel,), -1, dtype=torch.int64)  # which src element lands where
    source[idx] = torch.arange(idx.numel())
    n = x.type.numel
    flat = b.reshape(x, (n,))
    src_index = _index_param(b, source.clamp(min=0), "as_strided_scatter.index")
    vals = b.take(b.reshape(b.cast(src, x.dtype), (math.prod(src.shape),)), 0, src_index)
    hit = b.binary("ge", _index_param(b, source, "as_strided_scatter.source"), 0)
    return b.reshape(b.where(hit, vals, flat), x.shape)


# -- mask-driven ops with a static result shape: positions come from a prefix count -------------------
@lower(aten.masked_scatter.default)
def _masked_scatter(ctx: LoweringContext, x: Node, mask: Node, src: Node) -> Node:
    """The k-th True of ``mask`` (row-major) takes ``src.flatten()[k]``."""
    b = ctx.b
    shape = ctx.out_shape()
    n = math.prod(shape)
    if n == 0 or src.type.numel == 0:
        return b.broadcast_to(x, shape)
    m = b.reshape(b.broadcast_to(mask, shape), (n,))
    k = b.sub(prefix(b, b.cast(m, DType.i64), 0), 1)
    k = b.minimum(b.maximum(k, 0), src.type.numel - 1)
    vals = b.take(b.reshape(b.cast(src, x.dtype), (src.type.numel,)), 0, k)
    return b.reshape(b.where(m, vals, b.reshape(b.broadcast_to(x, shape), (n,))), shape)


@lower(aten.nonzero_static.default)
def _nonzero_static(ctx: LoweringContext, x: Node, *, size: int, fill_value: int = -1) -> Node:
    """Row r holds the coordinates of the (r+1)-th nonzero element, or ``fill_value`` past the last."""
    b = ctx.b
    n, rank = x.type.numel, x.type.rank
    if n == 0 or size == 0:
        return b.full(fill_value, ctx.out_shape(), DType.i64)
    nz = b.reshape(b.binary("ne", x, False if x.dtype == DType.bool else 0), (n,))
    count = prefix(b, b.cast(nz, DType.i64), 0)  # [n]: nonzeros up to and including p
    rows = b.add(b.iota((size, n), 0), 1)
    is_row = b.binary("bitwise_and", b.binary("eq", b.broadcast_to(count, (size, n)), rows),
                      b.broadcast_to(nz, (size, n)))
    p = b.reduce("min", b.where(is_row, b.iota((size, n), 1), n), [1])  # [size, 1] flat position
    coords = []
    stride = n
    for d in range(rank):
        stride //= x.shape[d]
        coords.append(b.binary("remainder", b.binary("floordiv", p, stride), x.shape[d]))
    out = b.concat(coords, 1) if coords else b.full(0, (size, 0), DType.i64)
    return b.where(b.broadcast_to(b.binary("lt", p, n), out.shape), out, fill_value)
