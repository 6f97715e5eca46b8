"""ONNX resampling ops: Resize, Upsample, AffineGrid, GridSample, and DeformConv (a GridSample-style sampler).

Resize's output sizes and source coordinates (its coordinate modes, antialias, tf_crop_and_resize)
are computed at compile time with numpy, so each resized axis becomes constant index/weight tensors
applied as gathers. GridSample's coordinates are data, so its taps are built in the graph.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.onnx.ops_nn import _float, _spatial
from sextant.frontend.onnx.registry import OnnxContext, norm_axes, onnx_op
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node


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
    coord = ctx.attr("coordinate_transformation_mode", coord_default)
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
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
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
    return _resample(ctx, x, sc, out, roi, mode=ctx.attr("mode", "nearest"), coord=coord,
                     nearest=ctx.attr("nearest_mode", nearest_default),
                     cubic_a=float(ctx.attr("cubic_coeff_a", -0.75)),
                     exclude_outside=bool(ctx.attr("exclude_outside", 0)),
                     extrapolation=float(ctx.attr("extrapolation_value", 0.0)),
                     antialias=bool(ctx.attr("antialias", 0)))


@onnx_op("Upsample")
def _upsample(ctx: OnnxContext, x: Node, scales: Node | None = None) -> Node:
    sc = _float_list(ctx, scales, "scales") if scales is not None else [float(s) for s in ctx.attr("scales", [])]
    if not sc or len(sc) != x.type.rank:
        raise Unsupported(f"Upsample: scales {sc} for an input of rank {x.type.rank}")
    mode = ctx.attr("mode", "nearest")
    mode = "linear" if mode in ("bilinear", "trilinear") else mode
    out = [int(s * d) for s, d in zip(sc, x.shape)]
    return _resample(ctx, x, sc, out, None, mode=mode, coord="asymmetric", nearest="floor")


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
    mode = ctx.attr("mode", "linear" if ctx.opset >= 20 else "bilinear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = ctx.attr("padding_mode", "zeros")
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
