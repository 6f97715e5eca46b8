"""ONNX compute ops: MatMul, Gemm, Einsum, convolutions, pooling, resampling, attention, sampling grids.

Convolutions reuse the ATen ``convolution`` lowering; ONNX's extra freedom (asymmetric pads,
``auto_pad``) becomes an explicit ``pad`` (or a crop of the transposed result) around it.
Pooling and resampling windows are computed here at compile time — ONNX's output-size rules
(``ceil_mode``, ``auto_pad``, Resize's coordinate modes) differ from torch's in corner cases —
and become strided slices, or constant index/weight tensors applied per spatial axis.
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
from sextant.frontend.onnx.dtypes import from_onnx
from sextant.frontend.onnx.registry import OnnxContext, norm_axes, onnx_op
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


def _str(ctx: OnnxContext, name: str, default: str) -> str:
    v = ctx.attr(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


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
    terms, out = _einsum_parse(_str(ctx, "equation", ""), [x.type.rank for x in xs])
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
    auto = _str(ctx, "auto_pad", "NOTSET")
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
    act = _str(ctx, "activation", "none")
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
    auto = _str(ctx, "auto_pad", "NOTSET")
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
    auto = _str(ctx, "auto_pad", "NOTSET")
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


# -- resampling ----------------------------------------------------------------------------------
def _cubic(a: float, antialias: bool):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            t = np.array([ratio + 1, ratio, 1 - ratio, 2 - ratio])
        else:
            s = min(scale, 1.0)
            start = int(np.floor(-2 / s) + 1)
            t = s * (np.arange(start, 2 - start) - ratio)
        t = np.abs(t)
        w = np.where(t <= 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                     np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0))
        return w / w.sum() if antialias else w
    return coeffs


def _linear(antialias: bool):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([1 - ratio, ratio])
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        w = np.clip(1 - np.abs((np.arange(start, 2 - start) - ratio) * s), 0, 1)
        return w / w.sum()
    return coeffs


def _source_coords(mode: str, n_in: int, n_out: int, scale: float, roi: tuple[float, float]):
    """Input coordinate of each output position, and which fall outside (tf_crop_and_resize)."""
    y = np.arange(n_out, dtype=np.float64)
    out_w = scale * n_in  # the real-valued output length the modes are defined on
    outside = None
    if mode == "align_corners":
        x = np.zeros(n_out) if out_w == 1 else y * (n_in - 1) / (out_w - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        r0, r1 = roi
        x = np.full(n_out, (r1 - r0) * (n_in - 1) / 2) if out_w == 1 else y * (r1 - r0) * (n_in - 1) / (out_w - 1)
        x = x + r0 * (n_in - 1)
        outside = (x < 0) | (x > n_in - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(n_out, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        x = n_in / 2 * (1 - n_out / out_w) + (y + 0.5) / scale - 0.5
    else:
        raise Unsupported(f"Resize: coordinate_transformation_mode={mode!r}")
    return x, outside


def _taps(x: np.ndarray, n_in: int, scale: float, coeffs, exclude_outside: bool):
    """[n_out, taps] input indices (edge-clamped) and weights: the taps nearest each coordinate."""
    base = np.floor(x)
    ratio = np.where(x == base, 1.0, x - base)
    w = np.stack([coeffs(float(r), scale) for r in ratio])
    n = w.shape[1]
    pad = -(-n // 2)
    xp = x + pad
    p = np.floor(xp)
    frac = xp - p
    if n % 2 == 0:
        off = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        off = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    idx = (p + off).astype(np.int64)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        w = np.where((idx < 0) | (idx >= n_in), 0.0, w)
        s = w.sum(1, keepdims=True)
        w = w / np.where(s == 0, 1.0, s)
    return np.clip(idx, 0, n_in - 1), w


def _nearest(x: np.ndarray, n_in: int, mode: str) -> np.ndarray:
    f = np.floor(x)
    r = x - f
    if mode == "round_prefer_floor":
        i = np.where(r <= 0.5, f, f + 1)
    elif mode == "round_prefer_ceil":
        i = np.where(r < 0.5, f, f + 1)
    elif mode == "floor":
        i = f
    elif mode == "ceil":
        i = np.ceil(x)
    else:
        raise Unsupported(f"Resize: nearest_mode={mode!r}")
    return np.clip(i, 0, n_in - 1).astype(np.int64)


def _index(ctx: OnnxContext, v: np.ndarray) -> Node:
    return ctx.tensor(torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)), "index")


def _resample(ctx: OnnxContext, x: Node, scales: list[float], sizes: list[int], roi: list[float] | None, *,
              mode: str, coord: str, nearest: str, cubic_a: float = -0.75, exclude_outside: bool = False,
              extrapolation: float = 0.0, antialias: bool = False) -> Node:
    """Separable resampling: along each resized axis, a gather (nearest) or a weighted sum of gathers."""
    b = ctx.b
    rank = x.type.rank
    if mode not in ("nearest", "linear", "cubic"):
        raise Unsupported(f"{ctx.op_type}: mode={mode!r}")
    if antialias and mode == "nearest":
        raise Unsupported("Resize: antialias with mode='nearest'")
    coeffs = _linear(antialias) if mode == "linear" else _cubic(cubic_a, antialias)
    out_dtype = x.dtype
    if mode != "nearest":
        x = _float(x, b)
    for axis in range(rank):
        n_in, n_out, s = x.shape[axis], sizes[axis], scales[axis]
        r = (0.0, 1.0) if roi is None else (roi[axis], roi[rank + axis])
        if n_out == n_in and math.isclose(s, 1.0) and (coord != "tf_crop_and_resize" or
                                                     (math.isclose(r[0], 0.0) and math.isclose(r[1], 1.0))):
            continue
        if n_out == 0 or n_in == 0:
            raise Unsupported(f"{ctx.op_type}: an empty axis")
        src, outside = _source_coords(coord, n_in, n_out, s, r)
        if mode == "nearest":
            y = b.take(x, axis, _index(ctx, _nearest(src, n_in, nearest)))
        else:
            idx, w = _taps(src, n_in, s, coeffs, exclude_outside)
            y = None
            for j in range(idx.shape[1]):
                wj = torch.from_numpy(w[:, j].copy()).to(x.dtype.torch)
                if not bool(wj.any()):
                    continue
                shape = [n_out if d == axis else 1 for d in range(rank)]
                term = b.mul(b.take(x, axis, _index(ctx, idx[:, j])), ctx.tensor(wj.reshape(shape), "weight"))
                y = term if y is None else b.add(y, term)
            if y is None:
                y = b.full(0, x.shape[:axis] + (n_out,) + x.shape[axis + 1:], x.dtype)
        if outside is not None and outside.any():
            shape = [n_out if d == axis else 1 for d in range(rank)]
            mask = b.broadcast_to(ctx.tensor(torch.from_numpy(outside.reshape(shape)), "outside"), y.shape)
            y = b.where(mask, extrapolation, y)
        x = y
    return b.cast(x, out_dtype)


def _float_list(ctx: OnnxContext, v: Node | None, what: str) -> list[float] | None:
    if v is None:
        return None
    t = ctx.const(v, what)
    return [float(f) for f in t.double().reshape(-1).tolist()] if t.numel() else None


@onnx_op("Resize")
def _resize(ctx: OnnxContext, x: Node, *ins: Node | None) -> Node:
    rank = x.type.rank
    if ctx.opset < 11:
        roi_in, scales_in, sizes_in = None, ins[0] if ins else None, None
        coord_default, nearest_default = "asymmetric", "floor"
    else:
        roi_in, scales_in, sizes_in = tuple(ins) + (None,) * (3 - len(ins))
        coord_default, nearest_default = "half_pixel", "round_prefer_floor"
    coord = _str(ctx, "coordinate_transformation_mode", coord_default)
    axes = norm_axes(ctx.attr("axes") or list(range(rank)), rank)
    sizes = ctx.ints(sizes_in, "sizes") if sizes_in is not None else None
    scales = _float_list(ctx, scales_in, "scales") if not sizes else None
    roi = _float_list(ctx, roi_in, "roi") if coord == "tf_crop_and_resize" else None
    if roi is not None:  # [starts..., ends...] over ``axes`` → over every dim
        full = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            full[a], full[rank + a] = roi[i], roi[len(axes) + i]
        roi = full
    if sizes:
        out = list(x.shape)
        for a, s in zip(axes, sizes):
            out[a] = s
        sc = [out[d] / x.shape[d] if x.shape[d] else 1.0 for d in range(rank)]
        policy = _str(ctx, "keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            s = pick(sc[a] for a in axes)
            sc = [s if d in axes else 1.0 for d in range(rank)]
            out = [int(s * x.shape[d] + 0.5) if d in axes else x.shape[d] for d in range(rank)]
    elif scales is not None:
        sc = [1.0] * rank
        for a, s in zip(axes, scales):
            sc[a] = s
        out = [int(np.float64(sc[d]) * x.shape[d]) for d in range(rank)]
    else:
        raise Unsupported("Resize: neither scales nor sizes is given")
    return _resample(ctx, x, sc, out, roi, mode=_str(ctx, "mode", "nearest"), coord=coord,
                     nearest=_str(ctx, "nearest_mode", nearest_default),
                     cubic_a=float(ctx.attr("cubic_coeff_a", -0.75)),
                     exclude_outside=bool(ctx.attr("exclude_outside", 0)),
                     extrapolation=float(ctx.attr("extrapolation_value", 0.0)),
                     antialias=bool(ctx.attr("antialias", 0)))


@onnx_op("Upsample")
def _upsample(ctx: OnnxContext, x: Node, scales: Node | None = None) -> Node:
    sc = _float_list(ctx, scales, "scales") if scales is not None else [float(s) for s in ctx.attr("scales", [])]
    if not sc or len(sc) != x.type.rank:
        raise Unsupported(f"Upsample: scales {sc} for an input of rank {x.type.rank}")
    mode = _str(ctx, "mode", "nearest")
    mode = "linear" if mode in ("bilinear", "trilinear") else mode
    out = [int(s * d) for s, d in zip(sc, x.shape)]
    return _resample(ctx, x, sc, out, None, mode=mode, coord="asymmetric", nearest="floor")


# -- attention -----------------------------------------------------------------------------------
def _heads(b: GraphBuilder, x: Node, heads: int) -> Node:
    """[B, S, H*E] → [B, H, S, E]."""
    bs, s, hidden = x.shape
    if not heads or hidden % heads:
        raise Unsupported(f"Attention: hidden size {hidden} is not a multiple of {heads} heads")
    return b.permute(b.reshape(x, (bs, s, heads, hidden // heads)), (0, 2, 1, 3))


def _repeat_kv(b: GraphBuilder, x: Node, heads: int) -> Node:
    """[B, Hkv, S, E] → [B, heads, S, E], query head h reading kv head h // (heads / Hkv)."""
    bs, hkv, s, e = x.shape
    if hkv == heads:
        return x
    if heads % hkv:
        raise Unsupported(f"Attention: {heads} query heads and {hkv} key/value heads (not a multiple)")
    x = b.expand(b.reshape(x, (bs, hkv, 1, s, e)), (bs, hkv, heads // hkv, s, e))
    return b.reshape(x, (bs, heads, s, e))


def _softmax(b: GraphBuilder, x: Node) -> Node:
    e = b.unary("exp", b.sub(x, b.expand(b.reduce("max", x, [-1]), x.shape)))
    return b.div(e, b.expand(b.reduce("sum", e, [-1]), e.shape))


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
    k, v = _repeat_kv(b, k, heads), _repeat_kv(b, v, heads)
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


# -- sampling grids ------------------------------------------------------------------------------
@onnx_op("AffineGrid")
def _affine_grid(ctx: OnnxContext, theta: Node, size: Node) -> Node:
    b = ctx.b
    dims = ctx.ints(size, "size")[2:]
    align = bool(ctx.attr("align_corners", 0))

    def coords(n: int) -> torch.Tensor:
        if align:
            return torch.linspace(-1.0, 1.0, n, dtype=torch.float64) if n > 1 else torch.full((1,), -1.0,
                                                                                              dtype=torch.float64)
        return (2 * torch.arange(n, dtype=torch.float64) + 1) / n - 1

    mesh = torch.meshgrid(*(coords(n) for n in dims), indexing="ij")
    base = torch.stack([m.reshape(-1) for m in reversed(mesh)] + [torch.ones(math.prod(dims), dtype=torch.float64)],
                       1)  # [P, nd+1], x (the last dim) first
    base = ctx.tensor(base.to(theta.dtype.torch), "base")
    grid = b.matmul(b.broadcast_to(base, (theta.shape[0],) + base.shape), b.transpose(theta, 1, 2))
    return b.reshape(grid, (theta.shape[0], *dims, len(dims)))


def _reflect(b: GraphBuilder, x: Node, lo: float, hi: float) -> Node:
    """Fold ``x`` back into [lo, hi] by mirror reflection at the borders, as GridSample's reference."""
    rng = hi - lo
    if rng <= 0:
        return b.full(lo, x.shape, x.dtype)

    def fold(dx: Node, near: float, far: float) -> Node:
        n = b.unary("floor", b.div(dx, rng))
        r = b.sub(dx, b.mul(n, rng))
        even = b.binary("eq", b.sub(n, b.mul(b.unary("floor", b.div(n, 2.0)), 2.0)), 0.0)
        toward = b.add(r, near) if near == lo else b.sub(near, r)
        back = b.sub(far, r) if far == hi else b.add(r, far)
        return b.where(even, toward, back)

    below = fold(b.sub(lo, x), lo, hi)
    above = fold(b.sub(x, hi), hi, lo)
    return b.where(b.binary("lt", x, lo), below, b.where(b.binary("gt", x, hi), above, x))


def _cubic_weights(b: GraphBuilder, t: Node, a: float = -0.75) -> list[Node]:
    """Keys' cubic weights of the taps at offsets -1, 0, 1, 2 from floor(x), t = x - floor(x)."""
    def near(u: Node) -> Node:  # |u| <= 1
        return b.add(b.mul(b.mul(b.sub(b.mul(u, a + 2), a + 3), u), u), 1.0)

    def far(u: Node) -> Node:  # 1 < |u| < 2
        return b.sub(b.mul(b.add(b.mul(b.sub(b.mul(u, a), 5 * a), u), 8 * a), u), 4 * a)

    one_minus = b.sub(1.0, t)
    return [far(b.add(t, 1.0)), near(t), near(one_minus), far(b.add(one_minus, 1.0))]


def _dim_taps(b: GraphBuilder, c: Node, d: int, mode: str, padding: str, align: bool) -> list[tuple[Node, Node | None]]:
    """(clamped index, weight or None) of each tap reading pixel coordinate ``c`` along a dim of size d."""
    lo, hi = (0.0, d - 1.0) if align else (-0.5, d - 0.5)
    if mode == "nearest":
        c = b.unary("round", c)
    if padding == "border":
        out = b.binary("bitwise_or", b.binary("lt", c, lo), b.binary("gt", c, hi))
        c = b.where(out, b.minimum(b.maximum(c, 0.0), d - 1.0), c)
    elif padding == "reflection":
        c = _reflect(b, c, lo, hi)
    if mode == "nearest":
        base, offsets, weights = b.unary("trunc", c), [0], None
    else:
        base = b.unary("floor", c)
        t = b.sub(c, base)
        offsets = [0, 1] if mode == "linear" else [-1, 0, 1, 2]
        weights = [b.sub(1.0, t), t] if mode == "linear" else _cubic_weights(b, t)
    taps = []
    for k, off in enumerate(offsets):
        pos = b.add(base, float(off)) if off else base
        if padding == "reflection":
            pos = b.unary("trunc", _reflect(b, pos, lo, hi))
        w = None if weights is None else weights[k]
        if padding == "zeros":  # taps outside the input read 0
            valid = b.binary("bitwise_and", b.binary("ge", pos, 0.0), b.binary("le", pos, d - 1.0))
            w = b.where(valid, 1.0 if w is None else w, b.full(0, valid.shape, c.dtype))
        taps.append((b.cast(b.minimum(b.maximum(pos, 0.0), d - 1.0), DType.i64), w))
    return taps


def _sample(b: GraphBuilder, x: Node, coords: Sequence[Node], mode: str, padding: str, align: bool) -> Node:
    """x [N, C, *S] read at pixel coordinates ``coords`` (one [N, P] per spatial dim) → [N, C, P]."""
    nb, ch, *in_sp = x.shape
    npts = coords[0].shape[1]
    src = b.reshape(x, (nb, ch, math.prod(in_sp)))
    total = None
    for combo in itertools.product(*(_dim_taps(b, c, d, mode, padding, align) for c, d in zip(coords, in_sp))):
        flat, w = None, None
        for i, (idx, wi) in enumerate(combo):
            stride = math.prod(in_sp[i + 1:])
            term = b.mul(idx, stride) if stride != 1 else idx
            flat = term if flat is None else b.add(flat, term)
            if wi is not None:
                w = wi if w is None else b.mul(w, wi)
        v = b.gather(src, 2, b.expand(b.reshape(flat, (nb, 1, npts)), (nb, ch, npts)))
        if w is not None:
            v = b.mul(v, b.expand(b.reshape(b.cast(w, x.dtype), (nb, 1, npts)), v.shape))
        total = v if total is None else b.add(total, v)
    return total


@onnx_op("GridSample")
def _grid_sample(ctx: OnnxContext, x: Node, grid: Node) -> Node:
    b = ctx.b
    mode = _str(ctx, "mode", "linear" if ctx.opset >= 20 else "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = _str(ctx, "padding_mode", "zeros")
    align = bool(ctx.attr("align_corners", 0))
    if mode not in ("nearest", "linear", "cubic") or padding not in ("zeros", "border", "reflection"):
        raise Unsupported(f"GridSample: mode={mode!r}, padding_mode={padding!r}")
    nd, nb = x.type.rank - 2, x.shape[0]
    out_sp = grid.shape[1:-1]
    g = _float(grid, b)
    coords = []
    for i in range(nd):  # the grid's last axis lists coordinates innermost dim first (x, y[, z])
        d = x.shape[2 + i]
        c = b.reshape(b.slice(g, -1, nd - 1 - i, 1), (nb, math.prod(out_sp)))
        coords.append(b.mul(b.add(c, 1.0), (d - 1) / 2) if align else
                      b.div(b.sub(b.mul(b.add(c, 1.0), float(d)), 1.0), 2.0))
    return b.reshape(_sample(b, x, coords, mode, padding, align), (nb, x.shape[1], *out_sp))


@onnx_op("DeformConv")
def _deform_conv(ctx: OnnxContext, x: Node, w: Node, offset: Node, bias: Node | None = None,
                 mask: Node | None = None) -> Node:
    """Bilinear samples (zero outside) at each tap's offset position, masked, then a grouped matmul."""
    b = ctx.b
    nb, ch, *in_sp = x.shape
    n = len(in_sp)
    kernel = w.shape[2:]
    k = math.prod(kernel)
    strides, dilations = _spatial(ctx, "strides", n), _spatial(ctx, "dilations", n)
    pads = _spatial(ctx, "pads", 2 * n, 0)
    group, og = int(ctx.attr("group", 1)), int(ctx.attr("offset_group", 1))
    out_sp = offset.shape[2:]
    npts = k * math.prod(out_sp)
    off = b.reshape(_float(offset, b), (nb, og, k, n, *out_sp))
    grid_shape = (k, *out_sp)
    cols = []
    for o in range(og):
        coords = []
        for i in range(n):  # tap position: o*stride - pad + kernel offset*dilation, plus the learned offset
            kpos = np.array(list(itertools.product(*(range(v) for v in kernel))))[:, i] * dilations[i]
            base = (kpos.reshape((k,) + (1,) * n) - pads[i] +
                    np.arange(out_sp[i]).reshape([out_sp[i] if j == i else 1 for j in range(n)]) * strides[i])
            base_t = ctx.tensor(torch.from_numpy(np.broadcast_to(base, grid_shape).astype(np.float32)), "taps")
            d = b.reshape(b.slice(b.slice(off, 1, o, 1), 3, i, 1), (nb, *grid_shape))
            coords.append(b.reshape(b.add(d, b.broadcast_to(b.cast(base_t, d.dtype), d.shape)), (nb, npts)))
        xs = b.slice(x, 1, o * (ch // og), ch // og)
        v = _sample(b, xs, coords, "linear", "zeros", True)  # [N, C/og, K*P]
        if mask is not None:
            m = b.reshape(b.slice(b.reshape(b.cast(mask, x.dtype), (nb, og, npts)), 1, o, 1), (nb, 1, npts))
            v = b.mul(v, b.expand(m, v.shape))
        cols.append(v)
    p = math.prod(out_sp)
    cols_n = b.reshape(b.concat(cols, 1), (nb, group, (ch // group) * k, p))
    oc = w.shape[0]
    wg = b.reshape(w, (1, group, oc // group, (ch // group) * k))
    y = b.reshape(b.matmul(wg, cols_n), (nb, oc, *out_sp))
    if bias is not None:
        y = b.add(y, b.reshape(b.cast(bias, y.dtype), (1, oc) + (1,) * n))
    return y
