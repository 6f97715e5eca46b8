"""ONNX compute ops: MatMul, Gemm, Einsum, convolutions, pooling, MaxUnpool, Col2Im.

Convolutions reuse the ATen ``convolution`` lowering; ONNX's extra freedom (asymmetric pads,
``auto_pad``) becomes an explicit ``pad`` (or a crop of the transposed result) around it.
Pooling windows are computed here at compile time — ONNX's output-size rules (``ceil_mode``,
``auto_pad``) differ from torch's in corner cases — and become strided slices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.ops import aten

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.lowerings.scatter import scatter_reduce
from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


def _float(x: Node, b: GraphBuilder) -> Node:
    return x if x.dtype.is_float else b.cast(x, DType.f32)


# -- matmul --------------------------------------------------------------------------------------
@onnx_op("MatMul")
def _matmul(ctx: OnnxContext, a: Node, b: Node) -> Node:
    return ctx.b.matmul(a, b)


@onnx_op("Gemm")
def _gemm(ctx: OnnxContext, a: Node, b: Node, c: Node | None = None) -> Node:
    g = ctx.b
    if ctx.attr("transA", 0):
        a = g.transpose(a, 0, 1)
    if ctx.attr("transB", 0):
        b = g.transpose(b, 0, 1)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))

    def scaled(x: Node, s: float) -> Node:  # integer Gemm scales in f32 and truncates back
        return x if s == 1.0 else g.cast(g.mul(_float(x, g), s), x.dtype)

    y = scaled(g.matmul(a, b), alpha)
    if c is not None and beta != 0.0:
        y = g.add(y, g.broadcast_to(scaled(g.cast(c, y.dtype), beta), y.shape))
    return y


# -- einsum --------------------------------------------------------------------------------------
def _einsum_parse(eq: str, ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Label lists per operand and for the output, '...' expanded into private labels."""
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise Unsupported(f"Einsum: equation {eq!r} names {len(terms)} operands, got {len(ranks)}")
    n_ell = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    ell = [chr(0x3B1 + i) for i in range(n_ell)]  # greek letters never clash with ASCII labels

    def expand(t: str, rank: int | None) -> list[str]:
        if "..." not in t:
            return list(t)
        pre, post = t.split("...")
        k = n_ell if rank is None else rank - len(pre) - len(post)
        return list(pre) + ell[n_ell - k:] + list(post)

    ops = [expand(t, r) for t, r in zip(terms, ranks)]
    for t, r in zip(ops, ranks):
        if len(t) != r:
            raise Unsupported(f"Einsum: term {''.join(t)!r} does not match an operand of rank {r}")
    if "->" in eq:
        out = expand(rhs, None)
    else:
        counts: dict[str, int] = {}
        for t in ops:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = ell + sorted(c for c, n in counts.items() if n == 1 and c not in ell)
    return ops, out


def _diagonal(b: GraphBuilder, x: Node, labels: list[str]) -> tuple[Node, list[str]]:
    """Collapse repeated labels of one operand onto their diagonal."""
    while len(set(labels)) < len(labels):
        c = next(c for c in labels if labels.count(c) > 1)
        i, j = [k for k, d in enumerate(labels) if d == c][:2]
        rest = [k for k in range(len(labels)) if k not in (i, j)]
        n = x.shape[i]
        x = b.permute(x, rest + [i, j])
        x = b.reshape(x, x.shape[:-2] + (n * n,))
        x = b.slice(x, -1, 0, n, n + 1)
        labels = [labels[k] for k in rest] + [c]
    return x, labels


@onnx_op("Einsum")
def _einsum(ctx: OnnxContext, *xs: Node) -> Node:
    b = ctx.b
    terms, out = _einsum_parse(ctx.attr("equation", ""), [x.type.rank for x in xs])
    sizes: dict[str, int] = {}
    for x, t in zip(xs, terms):
        for c, d in zip(t, x.shape):
            if d != 1 or c not in sizes:
                sizes[c] = d if sizes.get(c, 1) == 1 else sizes[c]
    ops: list[tuple[Node, list[str]]] = []
    for i, (x, t) in enumerate(zip(xs, terms)):
        x, t = _diagonal(b, x, t)
        x = b.broadcast_to(x, [sizes[c] for c in t])  # size-1 (broadcast) dims take their full size
        later = set(out).union(*(terms[j] for j in range(len(xs)) if j != i))
        drop = [k for k, c in enumerate(t) if c not in later]
        if drop:
            x = b.reduce("sum", x, drop, keepdim=False)
            t = [c for k, c in enumerate(t) if k not in drop]
        ops.append((x, t))
    x, t = ops[0]
    for i in range(1, len(ops)):
        y, u = ops[i]
        keep = set(out).union(*(ops[j][1] for j in range(i + 1, len(ops))))
        batch = [c for c in t if c in u and c in keep]
        contr = [c for c in t if c in u and c not in keep]
        left = [c for c in t if c not in u]
        right = [c for c in u if c not in t]
        xa = b.permute(x, [t.index(c) for c in batch + left + contr])
        ya = b.permute(y, [u.index(c) for c in batch + contr + right])
        nb, nl, nk, nr = (math.prod(sizes[c] for c in g) for g in (batch, left, contr, right))
        z = b.matmul(b.reshape(xa, (nb, nl, nk)), b.reshape(ya, (nb, nk, nr)))
        x, t = b.reshape(z, [sizes[c] for c in batch + left + right]), batch + left + right
    drop = [k for k, c in enumerate(t) if c not in out]
    if drop:
        x = b.reduce("sum", x, drop, keepdim=False)
        t = [c for k, c in enumerate(t) if k not in drop]
    return b.permute(x, [t.index(c) for c in out])


# -- convolution ---------------------------------------------------------------------------------
def _spatial(ctx: OnnxContext, name: str, n: int, default: int = 1) -> list[int]:
    v = ctx.attr(name)
    return [int(d) for d in v] if v else [default] * n


def _pads(ctx: OnnxContext, in_sp: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
          dilations: Sequence[int]) -> tuple[list[int], list[int]]:
    """(begin, end) padding per spatial dim, from ``pads`` or ``auto_pad``."""
    n = len(in_sp)
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        lo, hi = [], []
        for i in range(n):
            out = -(-in_sp[i] // strides[i])
            total = max((out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_sp[i], 0)
            small = total // 2
            lo.append(small if auto == "SAME_UPPER" else total - small)
            hi.append(total - lo[-1])
        return lo, hi
    if auto == "VALID":
        return [0] * n, [0] * n
    if auto != "NOTSET":
        raise Unsupported(f"{ctx.op_type}: auto_pad={auto!r}")
    pads = _spatial(ctx, "pads", 2 * n, 0)
    return pads[:n], pads[n:]


@onnx_op("Conv")
def _conv(ctx: OnnxContext, x: Node, w: Node, bias: Node | None = None) -> Node:
    b = ctx.b
    n = x.type.rank - 2
    kernel = w.shape[2:]
    strides, dilations = _spatial(ctx, "strides", n), _spatial(ctx, "dilations", n)
    lo, hi = _pads(ctx, x.shape[2:], kernel, strides, dilations)
    if lo != hi:
        x, lo = b.pad(x, [0, 0] + lo, [0, 0] + hi), [0] * n
    return ctx.aten(aten.convolution.default, x, w, bias, strides, lo, dilations, False, [0] * n,
                    int(ctx.attr("group", 1)))


@onnx_op("CausalConvWithState")
def _causal_conv(ctx: OnnxContext, x: Node, w: Node, bias: Node | None = None, past: Node | None = None):
    """Depthwise 1-D conv over [past_state | input]; the last k-1 positions become the new state."""
    b = ctx.b
    ch, k = x.shape[1], w.shape[2]
    padded = b.pad(x, [0, 0, k - 1], [0, 0, 0]) if past is None else b.concat([b.cast(past, x.dtype), x], 2)
    y = ctx.aten(aten.convolution.default, padded, w, bias, [1], [0], [1], False, [0], ch)
    act = ctx.attr("activation", "none")
    if act in ("silu", "swish"):
        t = b.cast(y, DType.f32)
        y = b.cast(b.mul(t, b.unary("sigmoid", t)), y.dtype)
    elif act != "none":
        raise Unsupported(f"CausalConvWithState: activation={act!r}")
    state = b.slice(padded, 2, padded.shape[2] - (k - 1), k - 1)
    return [y, state]


@onnx_op("ConvTranspose")
def _conv_transpose(ctx: OnnxContext, x: Node, w: Node, bias: Node | None = None) -> Node:
    """The unpadded transposed convolution, then cropped (or zero-extended) to ONNX's output window."""
    b = ctx.b
    n = x.type.rank - 2
    kernel = w.shape[2:]
    strides, dilations = _spatial(ctx, "strides", n), _spatial(ctx, "dilations", n)
    out_pad = _spatial(ctx, "output_padding", n, 0)
    in_sp = x.shape[2:]
    full = [strides[i] * (in_sp[i] - 1) + (kernel[i] - 1) * dilations[i] + 1 for i in range(n)]
    auto = ctx.attr("auto_pad", "NOTSET")
    out_shape = ctx.attr("output_shape")
    if out_shape or auto in ("SAME_UPPER", "SAME_LOWER"):
        want = [int(d) for d in out_shape][-n:] if out_shape else [in_sp[i] * strides[i] for i in range(n)]
        total = [full[i] + out_pad[i] - want[i] for i in range(n)]
        lo = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
    else:
        lo, hi = _pads(ctx, in_sp, kernel, strides, dilations)
        want = [full[i] + out_pad[i] - lo[i] - hi[i] for i in range(n)]
    y = ctx.aten(aten.convolution.default, x, w, None, strides, [0] * n, dilations, True, [0] * n,
                 int(ctx.attr("group", 1)))
    y = b.pad(y, [0, 0] + [-v for v in lo], [0, 0] + [want[i] + lo[i] - full[i] for i in range(n)])
    if bias is not None:
        y = b.add(y, b.reshape(b.cast(bias, y.dtype), (1, bias.shape[0]) + (1,) * n))
    return y


# -- pooling -------------------------------------------------------------------------------------
def _pool_geometry(ctx: OnnxContext, x: Node, kernel: Sequence[int]):
    """strides, dilations, begin pads and output spatial sizes by ONNX's rules."""
    n = len(kernel)
    in_sp = x.shape[2:]
    strides, dilations = _spatial(ctx, "strides", n), _spatial(ctx, "dilations", n)
    lo, hi = _pads(ctx, in_sp, kernel, strides, dilations)
    auto = ctx.attr("auto_pad", "NOTSET")
    out = []
    for i in range(n):
        span = in_sp[i] + lo[i] + hi[i] - (kernel[i] - 1) * dilations[i] - 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-in_sp[i] // strides[i])
        elif ctx.attr("ceil_mode", 0):
            o = -(-span // strides[i]) + 1
            if (o - 1) * strides[i] >= in_sp[i] + lo[i]:  # the last window must start inside
                o -= 1
        else:
            o = span // strides[i] + 1
        if o < 1:
            raise Unsupported(f"{ctx.op_type}: output spatial dim {i} would be {o}")
        out.append(o)
    return strides, dilations, lo, hi, out


def _windows(b: GraphBuilder, x: Node, kernel, strides, dilations, lo, out, fill):
    """(kernel offset, strided slice) per kernel offset: output o reads input o*s + k*d - lo."""
    n = len(kernel)
    high = [max((out[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - x.shape[2 + i] - lo[i], 0)
            for i in range(n)]
    padded = b.pad(x, [0, 0] + list(lo), [0, 0] + high, fill)
    for offs in itertools.product(*(range(k) for k in kernel)):
        y = padded
        for i in range(n):
            y = b.slice(y, 2 + i, offs[i] * dilations[i], out[i], strides[i])
        yield offs, y


def _window_counts(in_sp, kernel, strides, dilations, lo, hi, out, include_pad: bool) -> np.ndarray:
    """Per output position, how many window taps fall inside the input (or its explicit padding)."""
    counts = np.ones(out, dtype=np.float64)
    for i in range(len(kernel)):
        o = np.arange(out[i])[:, None] * strides[i] - lo[i] + np.arange(kernel[i])[None, :] * dilations[i]
        lim = (-lo[i], in_sp[i] + hi[i]) if include_pad else (0, in_sp[i])
        c = ((o >= lim[0]) & (o < lim[1])).sum(1).astype(np.float64)
        counts = counts * c.reshape([out[i] if j == i else 1 for j in range(len(kernel))])
    return counts


def _kernel(ctx: OnnxContext, x: Node) -> list[int]:
    k = ctx.attr("kernel_shape")
    if not k:
        raise Unsupported(f"{ctx.op_type}: kernel_shape is required")
    if len(k) != x.type.rank - 2:
        raise Unsupported(f"{ctx.op_type}: kernel_shape {list(k)} for an input of rank {x.type.rank}")
    return [int(v) for v in k]


def _lowest(dtype: DType) -> float | int:
    return -math.inf if dtype.is_float else torch.iinfo(dtype.torch).min


@onnx_op("MaxPool")
def _max_pool(ctx: OnnxContext, x: Node):
    b = ctx.b
    kernel = _kernel(ctx, x)
    strides, dilations, lo, _, out = _pool_geometry(ctx, x, kernel)
    n, in_sp = len(kernel), x.shape[2:]
    want_idx = ctx.num_outputs > 1 and bool(ctx.node.output[1])
    col_major = bool(ctx.attr("storage_order", 0))
    best = best_idx = None
    for offs, v in _windows(b, x, kernel, strides, dilations, lo, out, _lowest(x.dtype)):
        if best is None:
            best = v
        take = None if best is v else b.binary("gt", v, best)
        if want_idx:
            flat = b.mul(b.add(b.mul(b.iota(v.shape, 0), x.shape[1]), b.iota(v.shape, 1)), math.prod(in_sp))
            step = 1
            for d in (range(n) if col_major else reversed(range(n))):
                pos = b.sub(b.mul(b.iota(v.shape, 2 + d), strides[d]), lo[d] - offs[d] * dilations[d])
                flat = b.add(flat, b.mul(pos, step))
                step *= in_sp[d]
            best_idx = flat if take is None else b.where(take, flat, best_idx)
        if take is not None:
            best = b.where(take, v, best)
    return [best, best_idx] if want_idx else best


@onnx_op("AveragePool", "LpPool")
def _avg_pool(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    kernel = _kernel(ctx, x)
    strides, dilations, lo, hi, out = _pool_geometry(ctx, x, kernel)
    p = float(ctx.attr("p", 2)) if ctx.op_type == "LpPool" else 1.0
    src = x
    if ctx.op_type == "LpPool":
        src = b.unary("abs", x)
        if p != 1.0:
            src = b.binary("pow", src, p)
    total = None
    for _, v in _windows(b, src, kernel, strides, dilations, lo, out, 0):
        total = v if total is None else b.add(total, v)
    if ctx.op_type == "LpPool":
        return total if p == 1.0 else b.binary("pow", total, 1.0 / p)
    counts = _window_counts(x.shape[2:], kernel, strides, dilations, lo, hi, out,
                            bool(ctx.attr("count_include_pad", 0)))
    counts = np.maximum(counts, 1)
    if (counts == counts.flat[0]).all():
        return b.div(total, float(counts.flat[0]))
    return b.div(total, b.broadcast_to(ctx.tensor(torch.from_numpy(counts).to(x.dtype.torch), "divisor"),
                                       total.shape))


@onnx_op("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    axes = list(range(2, x.type.rank))
    if ctx.op_type == "GlobalMaxPool":
        return b.reduce("max", x, axes)
    if ctx.op_type == "GlobalAveragePool":
        return b.mean(x, axes)
    p = float(ctx.attr("p", 2))
    return b.binary("pow", b.reduce("sum", b.binary("pow", b.unary("abs", x), p), axes), 1.0 / p)


@onnx_op("MaxUnpool")
def _max_unpool(ctx: OnnxContext, x: Node, idx: Node, output_shape: Node | None = None) -> Node:
    b = ctx.b
    kernel = _kernel(ctx, x)
    n = len(kernel)
    strides = _spatial(ctx, "strides", n)
    pads = _spatial(ctx, "pads", 2 * n, 0)
    shape = list(x.shape[:2]) + [(x.shape[2 + i] - 1) * strides[i] - pads[i] - pads[n + i] + kernel[i]
                                 for i in range(n)]
    flat = scatter_reduce(b, b.full(0, (math.prod(shape),), x.dtype), 0, b.reshape(idx, (idx.type.numel,)),
                          b.reshape(x, (x.type.numel,)), "assign")
    y = b.reshape(flat, shape)
    if output_shape is not None:
        want = ctx.ints(output_shape, "output_shape")
        y = b.pad(y, [0] * len(want), [w - s for w, s in zip(want, shape)])
    return y


@onnx_op("Col2Im")
def _col2im(ctx: OnnxContext, x: Node, image_shape: Node, block_shape: Node) -> Node:
    """A transposed convolution whose one-hot kernel drops each column entry at its block offset."""
    b = ctx.b
    image, block = ctx.ints(image_shape, "image_shape"), ctx.ints(block_shape, "block_shape")
    n, k = len(image), math.prod(block)
    strides, dilations = _spatial(ctx, "strides", n), _spatial(ctx, "dilations", n)
    pads = _spatial(ctx, "pads", 2 * n, 0)
    nb, ck, _ = x.shape
    c = ck // k
    blocks = [(image[i] + pads[i] + pads[n + i] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
              for i in range(n)]
    x = _float(x, b)
    cols = b.reshape(x, (nb, ck, *blocks))
    eye = torch.eye(k, dtype=x.dtype.torch).reshape(k, 1, *block).repeat(c, 1, *([1] * n))
    y = ctx.aten(aten.convolution.default, cols, ctx.tensor(eye, "kernel"), None, strides, [0] * n, dilations,
                 True, [0] * n, c)
    full = y.shape[2:]
    return b.pad(y, [0, 0] + [-p for p in pads[:n]], [0, 0] + [image[i] + pads[i] - full[i] for i in range(n)])
