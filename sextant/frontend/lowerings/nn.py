"""Lowerings of matmul, convolution, pooling, and tensor-creation ATen ops."""

from __future__ import annotations

import itertools
import math

import torch
from torch.ops import aten

from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


# -- matmul --------------------------------------------------------------------------------------
@lower(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(ctx: LoweringContext, a: Node, b: Node) -> Node:
    return ctx.b.matmul(a, b)


@lower(aten.dot.default, aten.vdot.default)
def _dot(ctx: LoweringContext, a: Node, b: Node) -> Node:
    return ctx.b.matmul(a, b)


@lower(aten.mv.default)
def _mv(ctx: LoweringContext, a: Node, v: Node) -> Node:
    return ctx.b.matmul(a, v)


def _scaled(b: GraphBuilder, x: Node, s) -> Node:
    return x if s == 1 else b.mul(x, s)


@lower(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def _addmm(ctx: LoweringContext, bias: Node, a: Node, m: Node, *, beta=1, alpha=1) -> Node:
    b = ctx.b
    prod = _scaled(b, b.matmul(a, m), alpha)
    if beta == 0:
        return b.broadcast_to(prod, ctx.out_shape())
    return b.add(prod, _scaled(b, b.cast(bias, prod.dtype), beta))


@lower(aten.addbmm.default)
def _addbmm(ctx: LoweringContext, bias: Node, b1: Node, b2: Node, *, beta=1, alpha=1) -> Node:
    """beta * bias + alpha * sum_i b1[i] @ b2[i], as one matmul over the concatenated batches."""
    b = ctx.b
    nb, n, m = b1.shape
    a = b.reshape(b.permute(b1, (1, 0, 2)), (n, nb * m))
    prod = _scaled(b, b.matmul(a, b.reshape(b2, (nb * m, b2.shape[2]))), alpha)
    if beta == 0:
        return b.broadcast_to(prod, ctx.out_shape())
    return b.add(prod, _scaled(b, b.cast(bias, prod.dtype), beta))


@lower(aten._trilinear.default)
def _trilinear(ctx: LoweringContext, i1: Node, i2: Node, i3: Node, expand1, expand2, expand3, sumdim,
               unroll_dim: int = 1) -> Node:
    """sum over ``sumdim`` of i1 * i2 * i3, each first unsqueezed at its ``expand`` dims."""
    b = ctx.b
    rank = i1.type.rank + len(expand1)

    def unsqueeze(x: Node, dims) -> Node:
        shape = list(x.shape)
        for d in sorted(dims):
            shape.insert(d, 1)
        return b.reshape(x, shape)

    prod = b.mul(b.mul(unsqueeze(i1, expand1), unsqueeze(i2, expand2)), unsqueeze(i3, expand3))
    if sumdim:
        prod = b.reduce("sum", prod, [d % rank for d in sumdim])
    return b.reshape(prod, ctx.out_shape())


# -- convolution ---------------------------------------------------------------------------------
def _per_dim(v, n: int) -> tuple[int, ...]:
    v = [v] if isinstance(v, int) else list(v)
    return tuple(v * n if len(v) == 1 else v)


@lower(aten.convolution.default)
def _convolution(ctx: LoweringContext, x: Node, w: Node, bias, stride, padding, dilation, transposed: bool,
                 output_padding, groups: int) -> Node:
    b = ctx.b
    batched = x.type.rank == w.type.rank
    if not batched:
        x = b.reshape(x, (1,) + x.shape)
    n = x.type.rank - 2
    stride, padding, dilation = _per_dim(stride, n), _per_dim(padding, n), _per_dim(dilation, n)
    if transposed:
        out = _conv_transpose(b, x, w, stride, padding, dilation, _per_dim(output_padding, n), groups)
    else:
        out = b.emit("conv", [x, w], stride=stride, padding=padding, dilation=dilation, groups=groups)
    if bias is not None:
        out = b.add(out, b.reshape(b.cast(bias, out.dtype), (1, bias.shape[0]) + (1,) * n))
    return b.reshape(out, ctx.out_shape())


def _conv_transpose(b: GraphBuilder, x: Node, w: Node, stride, padding, dilation, output_padding,
                    groups: int) -> Node:
    """Transposed conv = stride-1 conv of the zero-interleaved, padded input with the flipped kernel."""
    n = x.type.rank - 2
    for d in range(n):  # put stride-1 zeros between input elements
        axis, size, s = 2 + d, x.shape[2 + d], stride[d]
        if s > 1 and size > 0:
            high = [0] * (x.type.rank + 1)
            high[axis + 1] = s - 1
            y = b.pad(b.reshape(x, x.shape[:axis + 1] + (1,) + x.shape[axis + 1:]), [0] * len(high), high)
            y = b.reshape(y, x.shape[:axis] + (size * s,) + x.shape[axis + 1:])
            x = b.slice(y, axis, 0, (size - 1) * s + 1)
    k = w.shape[2:]
    low = [0, 0] + [dilation[d] * (k[d] - 1) - padding[d] for d in range(n)]
    high = [0, 0] + [low[2 + d] + output_padding[d] for d in range(n)]
    x = b.pad(x, low, high, 0)
    # weight [Cin, Cout/g, *k] -> [Cout, Cin/g, *k], spatially flipped
    cin, cout_g = w.shape[:2]
    wg = b.reshape(w, (groups, cin // groups, cout_g) + k)
    wg = b.permute(wg, [0, 2, 1] + list(range(3, 3 + n)))
    w = b.reshape(wg, (groups * cout_g, cin // groups) + k)
    for d in range(n):
        if k[d] > 1:
            w = b.slice(w, 2 + d, k[d] - 1, k[d], -1)
    return b.emit("conv", [x, w], stride=(1,) * n, padding=(0,) * n, dilation=tuple(dilation), groups=groups)


# -- pooling: windows become strided slices of a padded input ------------------------------------
def _windows(ctx: LoweringContext, x: Node, kernel, stride, padding, dilation, ceil_mode: bool, fill):
    """Yield (window offset, strided-slice node) for each kernel offset, plus output spatial shape.

    Output position o of spatial dim d reads padded index o*stride + k*dilation.
    """
    b = ctx.b
    nsp = len(kernel)
    lead = x.type.rank - nsp
    out_sp = ctx.out_shape(0 if isinstance(ctx.meta, (tuple, list)) else None)[lead:]
    low = [0] * lead + list(padding)
    high = [0] * lead
    for d in range(nsp):
        need = (out_sp[d] - 1) * stride[d] + (kernel[d] - 1) * dilation[d] + 1
        high.append(max(need - x.shape[lead + d] - padding[d], 0))
    padded = b.pad(x, low, high, fill)
    # offsets that read only padding at every output position add nothing (0 to a sum, -inf to a
    # max): skipped, so a window far larger than its input (EfficientNet's AvgPool2d(320) over a
    # 2×2 map, ceil_mode) is as many slices as taps that touch the input, not 102,400
    live = [[k for k in range(kernel[d]) if not (isinstance(x.shape[lead + d], int) and isinstance(out_sp[d], int))
             or any(0 <= o * stride[d] + k * dilation[d] - padding[d] < x.shape[lead + d] for o in range(out_sp[d]))]
            for d in range(nsp)]
    for offs in itertools.product(*live):
        y = padded
        for d in range(nsp):
            y = b.slice(y, lead + d, offs[d] * dilation[d], out_sp[d], stride[d])
        yield offs, y, out_sp


def _pool_args(x: Node, kernel, stride, padding, dilation, nsp: int):
    kernel = _per_dim(kernel, nsp)
    stride = _per_dim(stride, nsp) if stride else kernel
    return kernel, stride, _per_dim(padding, nsp), _per_dim(dilation, nsp)


def lowest(dtype: DType) -> float | int:
    """The smallest value of ``dtype`` (-inf for floats): a max-pool's padding, a top-k's mask."""
    if dtype.is_float:
        return -math.inf
    return torch.iinfo(dtype.torch).min


@lower(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def _max_pool(ctx: LoweringContext, x: Node, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    b = ctx.b
    nsp = 2 if ctx.fx_node.target == aten.max_pool2d_with_indices.default else 3
    kernel, stride, padding, dilation = _pool_args(x, kernel, stride, padding, dilation, nsp)
    lead = x.type.rank - nsp
    in_sp = x.shape[lead:]
    best = best_idx = None
    for offs, v, _ in _windows(ctx, x, kernel, stride, padding, dilation, ceil_mode, lowest(x.dtype)):
        # flat index into the unpadded spatial plane of the element each output reads
        flat = None
        for d in range(nsp):
            pos = b.sub(b.mul(b.iota(v.shape, lead + d), stride[d]), padding[d] - offs[d] * dilation[d])
            flat = pos if flat is None else b.add(b.mul(flat, in_sp[d]), pos)
        if best is None:
            best, best_idx = v, flat
            continue
        take = b.binary("gt", v, best)
        if v.dtype.is_float:
            take = b.binary("bitwise_or", take, b.unary("isnan", v))
        best = b.where(take, v, best)
        best_idx = b.where(take, flat, best_idx)
    return best, best_idx


def avg_pool_counts(n: int, n_out: int, kernel: int, stride: int, padding: int, count_include_pad: bool) -> list[int]:
    """torch's divisor along one dim for each output position: the window clipped to the padded input
    (or, without ``count_include_pad``, to the input); an average pool's divisor is their product."""
    c = []
    for o in range(n_out):
        start = o * stride - padding
        end = min(start + kernel, n + padding)
        if not count_include_pad:
            start, end = max(start, 0), min(end, n)
        c.append(max(end - start, 1))
    return c


@lower(aten.avg_pool2d.default, aten.avg_pool3d.default, aten.avg_pool1d.default)
def _avg_pool(ctx: LoweringContext, x: Node, kernel, stride=(), padding=0, ceil_mode=False,
              count_include_pad=True, divisor_override=None) -> Node:
    b = ctx.b
    nsp = {aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2}.get(ctx.fx_node.target, 3)
    kernel, stride, padding, dilation = _pool_args(x, kernel, stride, padding, 1, nsp)
    lead = x.type.rank - nsp
    total = None
    for _, v, _ in _windows(ctx, x, kernel, stride, padding, dilation, ceil_mode, 0):
        total = v if total is None else b.add(total, v)
    out_sp = total.shape[lead:]
    if divisor_override:
        return b.div(total, float(divisor_override))
    # Divisor per output position: window size clipped to the (padded or real) input.
    counts = torch.ones(out_sp, dtype=torch.float64)
    for d in range(nsp):
        c = avg_pool_counts(x.shape[lead + d], out_sp[d], kernel[d], stride[d], padding[d], count_include_pad)
        view = [1] * nsp
        view[d] = out_sp[d]
        counts = counts * torch.tensor(c, dtype=torch.float64).reshape(view)
    if bool((counts == counts.flatten()[0]).all()):
        return b.div(total, float(counts.flatten()[0]))
    name = f"avg_pool.divisor.{len(b.params)}"
    div = b.param(name, counts.to(x.dtype.torch))
    return b.div(total, b.broadcast_to(div, total.shape))


def _adaptive_matrix(b: GraphBuilder, n_in: int, n_out: int, dtype: DType) -> Node:
    """A [n_out, n_in] matrix averaging torch's adaptive windows [floor(i*n/o), ceil((i+1)*n/o))."""
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        s, e = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
        m[i, s:e] = 1.0 / (e - s)
    return b.param(f"adaptive_pool.{n_in}to{n_out}.{len(b.params)}", m.to(dtype.torch))


@lower(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool1d.default)
def _adaptive_avg_pool(ctx: LoweringContext, x: Node, output_size) -> Node:
    b = ctx.b
    output_size = _per_dim(output_size, 1)
    nsp = len(output_size)
    lead = x.type.rank - nsp
    y = x
    for d in range(nsp):
        n_in, n_out = x.shape[lead + d], output_size[d]
        if n_in == n_out:
            continue
        if n_in % n_out == 0:  # uniform windows: a reshape and a mean
            k = n_in // n_out
            axis = lead + d
            shape = y.shape[:axis] + (n_out, k) + y.shape[axis + 1:]
            y = b.reshape(b.mean(b.reshape(y, shape), [axis + 1]), shape[:axis] + (n_out,) + shape[axis + 2:])
            continue
        mat = _adaptive_matrix(b, n_in, n_out, y.dtype)
        axis = lead + d
        perm = [i for i in range(y.type.rank) if i != axis] + [axis]
        yt = b.permute(y, perm)  # [..., n_in]
        yt = b.matmul(yt, b.permute(mat, (1, 0)))  # [..., n_out]
        inv = [perm.index(i) for i in range(y.type.rank)]
        y = b.permute(yt, inv)
    return b.reshape(y, ctx.out_shape())


def _adaptive_windows(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, k] input positions of each adaptive window, short windows padded with their last position."""
    bounds = [((i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)) for i in range(n_out)]
    k = max(e - s for s, e in bounds)
    return torch.tensor([[min(s + t, e - 1) for t in range(k)] for s, e in bounds], dtype=torch.int64)


@lower(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def _adaptive_max_pool(ctx: LoweringContext, x: Node, output_size):
    """Gather every window into a trailing axis, then max and (first max, or last NaN) argmax over it.

    Repeating a short window's last element changes neither the max nor the flat index found.
    """
    b = ctx.b
    nsp = len(output_size)
    lead = x.type.rank - nsp
    in_sp = x.shape[lead:]
    flat = torch.zeros((), dtype=torch.int64)
    y = x
    for d in range(nsp):
        win = _adaptive_windows(in_sp[d], output_size[d])  # [o_d, k_d]
        y = b.take(y, lead + 2 * d, b.param(f"adaptive_pool.window.{len(b.params)}", win))
        flat = flat.unsqueeze(-1).unsqueeze(-1) * in_sp[d] + win.reshape((1,) * (2 * d) + tuple(win.shape))
    perm = list(range(lead)) + [lead + 2 * d for d in range(nsp)] + [lead + 2 * d + 1 for d in range(nsp)]
    y = b.permute(y, perm)  # [..., o1, o2, (o3,) k1, k2, (k3)]
    flat = flat.permute([2 * d for d in range(nsp)] + [2 * d + 1 for d in range(nsp)])
    osz = tuple(output_size)
    v = b.reshape(y, y.shape[:lead] + osz + (math.prod(y.shape[lead + nsp:]),))
    k = v.shape[-1]
    best = b.reduce("max", v, [-1])
    pos = b.iota(v.shape, v.type.rank - 1)
    first = b.reduce("min", b.where(b.binary("eq", v, b.expand(best, v.shape)), pos, k), [-1])
    if v.dtype.is_float:
        last_nan = b.reduce("max", b.where(b.unary("isnan", v), pos, -1), [-1])
        first = b.where(b.binary("ge", last_nan, 0), last_nan, first)
    table = b.param(f"adaptive_pool.index.{len(b.params)}", flat.reshape(osz + (k,)).contiguous())
    index = b.gather(b.broadcast_to(table, v.shape), v.type.rank - 1, first)
    return b.reshape(best, ctx.out_shape(0)), b.reshape(index, ctx.out_shape(1))


# -- creation --------------------------------------------------------------------------------------
@lower(aten.full.default, aten.full_like.default, aten.new_full.default)
def _full(ctx: LoweringContext, *args, **kwargs) -> Node:
    value = args[1]
    if isinstance(value, Node):
        raise Unsupported("full with a tensor fill value")
    return ctx.b.full(value, ctx.out_shape(), ctx.out_dtype())


@lower(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.empty.memory_format,
       aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
       aten.new_empty_strided.default, aten.empty_permuted.default)
def _zeros(ctx: LoweringContext, *args, **kwargs) -> Node:
    return ctx.b.full(0, ctx.out_shape(), ctx.out_dtype())


@lower(aten.ones.default, aten.ones_like.default, aten.new_ones.default)
def _ones(ctx: LoweringContext, *args, **kwargs) -> Node:
    return ctx.b.full(1, ctx.out_shape(), ctx.out_dtype())


@lower(aten.scalar_tensor.default)
def _scalar_tensor(ctx: LoweringContext, value, **kwargs) -> Node:
    return ctx.b.full(value, (), ctx.out_dtype())


@lower(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(ctx: LoweringContext, *args, **kwargs) -> Node:
    if ctx.fx_node.target == aten.arange.default:
        start, step = 0, 1
    else:
        start = args[0]
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
    out = ctx.out_dtype()
    n = ctx.out_shape()[0]
    b = ctx.b
    i = b.iota((n,), 0, out if out != DType.bool else DType.i64)
    if step != 1:
        i = b.mul(i, step)
    return b.add(i, start) if start != 0 else i
