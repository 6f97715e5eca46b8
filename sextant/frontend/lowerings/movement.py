"""Lowerings of view/movement ATen ops onto reshape, permute, expand, slice, pad, concat, gather."""

from __future__ import annotations

import math

from torch.ops import aten

from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


def _norm(d: int, rank: int) -> int:
    return d % rank if rank else 0


@lower(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def _view(ctx: LoweringContext, x: Node, shape) -> Node:
    return ctx.b.reshape(x, ctx.out_shape())


@lower(aten.permute.default, aten.permute_copy.default)
def _permute(ctx: LoweringContext, x: Node, perm) -> Node:
    return ctx.b.permute(x, perm)


@lower(aten.t.default)
def _t(ctx: LoweringContext, x: Node) -> Node:
    return ctx.b.permute(x, (1, 0)) if x.type.rank == 2 else x


@lower(aten.transpose.int)
def _transpose(ctx: LoweringContext, x: Node, a: int, b: int) -> Node:
    if x.type.rank == 0:
        return x
    return ctx.b.transpose(x, _norm(a, x.type.rank), _norm(b, x.type.rank))


@lower(aten.expand.default)
def _expand(ctx: LoweringContext, x: Node, sizes, implicit: bool = False) -> Node:
    return ctx.b.broadcast_to(x, ctx.out_shape())


@lower(aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default)
def _squeeze(ctx: LoweringContext, x: Node, *dims) -> Node:
    return ctx.b.reshape(x, ctx.out_shape())


@lower(aten.slice.Tensor)
def _slice(ctx: LoweringContext, x: Node, dim: int = 0, start=None, end=None, step: int = 1) -> Node:
    dim = _norm(dim, x.type.rank)
    n = x.shape[dim]
    if isinstance(n, int) and all(isinstance(v, int | None) for v in (start, end)):
        s, e, st = slice(start, end, step).indices(n)
        size = len(range(s, e, st))
    else:  # a symbolic size: the same clamping, decided from the declared ranges
        s, size, st = _symbolic_slice(n, start, end, step)
    return ctx.b.slice(x, dim, s, size, st)


def _symbolic_slice(n, start, end, step: int):
    """``slice(start, end, step).indices(n)`` and its length for a positive ``step`` where ``n``,
    ``start`` or ``end`` is symbolic; a clamp the ranges cannot decide raises SymbolicShapeError."""
    if step <= 0:
        raise Unsupported("a slice with a non-positive step of a symbolic size")

    def clamp(v, default):
        if v is None:
            return default
        if v < 0:
            v = v + n
            return v if v >= 0 else 0
        return v if v <= n else n  # (at v == n both are right: asked this way, seq >= 1 decides 1 <= seq)

    s, e = clamp(start, 0), clamp(end, n)
    return s, ((e - s + step - 1) // step if e >= s else 0), step


@lower(aten.select.int)
def _select(ctx: LoweringContext, x: Node, dim: int, index: int) -> Node:
    dim = _norm(dim, x.type.rank)
    index = index % x.shape[dim]
    return ctx.b.reshape(ctx.b.slice(x, dim, index, 1), ctx.out_shape())


@lower(aten.narrow.default, aten.narrow_copy.default)
def _narrow(ctx: LoweringContext, x: Node, dim: int, start: int, length: int) -> Node:
    dim = _norm(dim, x.type.rank)
    return ctx.b.slice(x, dim, start % x.shape[dim] if start < 0 else start, length)


@lower(aten.cat.default)
def _cat(ctx: LoweringContext, xs, dim: int = 0) -> Node:
    out = ctx.out_dtype()
    shape = ctx.out_shape()
    # torch skips legacy empty 1-D tensors of shape (0,) when the others have higher rank.
    parts = [ctx.b.cast(x, out) for x in xs if not (x.shape == (0,) and len(shape) != 1)]
    if not parts:
        return ctx.b.full(0, shape, out)
    return ctx.b.concat(parts, _norm(dim, len(shape)))


@lower(aten.stack.default)
def _stack(ctx: LoweringContext, xs, dim: int = 0) -> Node:
    out = ctx.out_dtype()
    shape = ctx.out_shape()
    dim = _norm(dim, len(shape))
    parts = [ctx.b.reshape(ctx.b.cast(x, out), x.shape[:dim] + (1,) + x.shape[dim:]) for x in xs]
    return ctx.b.concat(parts, dim)


@lower(aten.split_with_sizes.default, aten.split.Tensor)
def _split(ctx: LoweringContext, x: Node, sizes, dim: int = 0) -> list[Node]:
    dim = _norm(dim, x.type.rank)
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)] if sizes else [n]
    outs, start = [], 0
    for size in sizes:
        outs.append(ctx.b.slice(x, dim, start, size))
        start += size
    return outs


@lower(aten.unbind.int, aten.unbind_copy.int)
def _unbind(ctx: LoweringContext, x: Node, dim: int = 0) -> list[Node]:
    dim = _norm(dim, x.type.rank)
    shape = x.shape[:dim] + x.shape[dim + 1:]
    return [ctx.b.reshape(ctx.b.slice(x, dim, i, 1), shape) for i in range(x.shape[dim])]


@lower(aten.constant_pad_nd.default)
def _pad(ctx: LoweringContext, x: Node, pad, value=0) -> Node:
    low = [0] * x.type.rank
    high = [0] * x.type.rank
    for i in range(len(pad) // 2):
        d = x.type.rank - 1 - i
        low[d], high[d] = pad[2 * i], pad[2 * i + 1]
    return ctx.b.pad(x, low, high, value)


@lower(aten.flip.default)
def _flip(ctx: LoweringContext, x: Node, dims) -> Node:
    for d in dims:
        d = _norm(d, x.type.rank)
        if x.shape[d] > 1:
            x = ctx.b.slice(x, d, x.shape[d] - 1, x.shape[d], -1)
    return x


@lower(aten.roll.default)
def _roll(ctx: LoweringContext, x: Node, shifts, dims=()) -> Node:
    b = ctx.b
    if not dims:
        flat = b.reshape(x, (x.type.numel,))
        return b.reshape(_roll(ctx, flat, shifts, [0]), x.shape)
    for shift, d in zip(shifts, dims):
        d = _norm(d, x.type.rank)
        n = x.shape[d]
        if n == 0 or shift % n == 0:
            continue
        k = shift % n
        x = b.concat([b.slice(x, d, n - k, k), b.slice(x, d, 0, n - k)], d)
    return x


@lower(aten.repeat.default)
def _repeat(ctx: LoweringContext, x: Node, repeats) -> Node:
    b = ctx.b
    lead = len(repeats) - x.type.rank
    x = b.reshape(x, (1,) * lead + x.shape)
    inter = []
    for d in x.shape:
        inter += [1, d]
    y = b.reshape(x, tuple(inter))
    y = b.expand(y, tuple(v for r, d in zip(repeats, x.shape) for v in (r, d)))
    return b.reshape(y, ctx.out_shape())


@lower(aten.tril.default, aten.triu.default)
def _tri(ctx: LoweringContext, x: Node, diagonal: int = 0) -> Node:
    b = ctx.b
    rows, cols = x.shape[-2], x.shape[-1]
    i = b.iota((rows, cols), 0)
    j = b.iota((rows, cols), 1)
    col_minus_row = b.sub(j, i)
    if ctx.fx_node.target == aten.tril.default:
        keep = b.binary("le", col_minus_row, diagonal)
    else:
        keep = b.binary("ge", col_minus_row, diagonal)
    zero = False if x.dtype == DType.bool else 0
    return b.where(b.broadcast_to(keep, x.shape), x, zero)


# -- indexing ----------------------------------------------------------------------------------
def _wrap_negative(ctx: LoweringContext, idx: Node, n: int) -> Node:
    b = ctx.b
    return b.where(b.binary("lt", idx, 0), b.add(idx, n), idx)


@lower(aten.index_select.default)
def _index_select(ctx: LoweringContext, x: Node, dim: int, index: Node) -> Node:
    if x.type.rank == 0:
        return ctx.b.reshape(x, ctx.out_shape())
    dim = _norm(dim, x.type.rank)
    return ctx.b.take(x, dim, _wrap_negative(ctx, index, x.shape[dim]))


@lower(aten.embedding.default)
def _embedding(ctx: LoweringContext, weight: Node, indices: Node, padding_idx: int = -1, *args) -> Node:
    return ctx.b.take(weight, 0, indices)


@lower(aten.gather.default)
def _gather(ctx: LoweringContext, x: Node, dim: int, index: Node, sparse_grad: bool = False) -> Node:
    if x.type.rank == 0:
        return ctx.b.reshape(x, ctx.out_shape())
    dim = _norm(dim, x.type.rank)
    if index.type.rank == 0:
        index = ctx.b.reshape(index, (1,) * x.type.rank)
    return ctx.b.reshape(ctx.b.gather(x, dim, _wrap_negative(ctx, index, x.shape[dim])), ctx.out_shape())


@lower(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index(ctx: LoweringContext, x: Node, indices) -> Node:
    """Advanced indexing ``x[i0, None, i2]``: linearise the indexed dims, then one ``take``."""
    b = ctx.b
    rank = x.type.rank
    pos = [d for d, ix in enumerate(indices) if ix is not None]
    if any(indices[d].dtype == DType.bool for d in pos):
        raise Unsupported("boolean-mask indexing (its result shape depends on the data)")
    idx = b.broadcast(*(indices[d] for d in pos))
    bshape = idx[0].shape
    rest = [d for d in range(rank) if d not in pos]
    xt = b.permute(x, pos + rest)
    sizes = [x.shape[d] for d in pos]
    flat = b.reshape(xt, (math.prod(sizes),) + tuple(x.shape[d] for d in rest))
    linear = None
    stride = 1
    for d, ix in reversed(list(zip(pos, idx))):
        term = b.mul(_wrap_negative(ctx, b.cast(ix, DType.i64), x.shape[d]), stride)
        linear = term if linear is None else b.add(linear, term)
        stride *= x.shape[d]
    out = b.take(flat, 0, linear)  # [*bshape, *rest]
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    if adjacent and pos[0] > 0:
        nb = len(bshape)
        before = list(range(nb, nb + pos[0]))
        out = b.permute(out, before + list(range(nb)) + list(range(nb + pos[0], nb + len(rest))))
    return b.reshape(out, ctx.out_shape())
