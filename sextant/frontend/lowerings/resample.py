"""Lowerings of upsampling (nearest, linear/bilinear/trilinear) onto per-dim ``gather``.

Resampling is separable: along each spatial dim every output position reads one (nearest)
or two (linear) input positions with fixed weights. Those are computed here, in float32 the
way torch's CPU kernels compute them, and become constant index and weight tensors.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.ops import aten

from sextant.frontend.lowerings.registry import LoweringContext, lower
from sextant.graph.builder import GraphBuilder
from sextant.graph.ir import Node

f32 = np.float32


def _scale(n_in: int, n_out: int, scale: float | None, align_corners: bool = False) -> np.float32:
    """torch's area_pixel_compute_scale: output step measured in input pixels."""
    if align_corners:
        return f32(n_in - 1) / f32(n_out - 1) if n_out > 1 else f32(0)
    return f32(1.0 / scale) if scale is not None and scale > 0 else f32(n_in) / f32(n_out)


def _nearest_index(n_in: int, n_out: int, scale: float | None) -> np.ndarray:
    o = np.arange(n_out)
    if n_out == n_in:
        return o
    if n_out == 2 * n_in:
        return o >> 1
    return np.minimum(np.floor(o.astype(f32) * _scale(n_in, n_out, scale)).astype(np.int64), n_in - 1)


def _linear_taps(n_in: int, n_out: int, scale: float | None, align_corners: bool):
    """(i0, i1, w0, w1) per output position: out = w0 * x[i0] + w1 * x[i1]."""
    s = _scale(n_in, n_out, scale, align_corners)
    o = np.arange(n_out).astype(f32)
    real = s * o if align_corners else np.maximum(s * (o + f32(0.5)) - f32(0.5), f32(0))
    i0 = np.minimum(np.floor(real).astype(np.int64), n_in - 1)
    w1 = np.clip(real - i0.astype(f32), f32(0), f32(1)).astype(f32)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, f32(1) - w1, w1


def _const(b: GraphBuilder, values: np.ndarray, what: str, dtype: torch.dtype | None = None) -> Node:
    t = torch.from_numpy(np.ascontiguousarray(values))
    return b.param(f"{what}.{len(b.params)}", t if dtype is None else t.to(dtype))


def _along(b: GraphBuilder, w: Node, axis: int, rank: int) -> Node:
    """A weight vector shaped to broadcast along ``axis`` of a rank-``rank`` tensor."""
    return b.reshape(w, tuple(w.shape[0] if d == axis else 1 for d in range(rank)))


def _scales(scale_factors, nsp: int) -> list[float | None]:
    return list(scale_factors) if scale_factors else [None] * nsp


@lower(aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec)
def _upsample_nearest(ctx: LoweringContext, x: Node, output_size, scale_factors) -> Node:
    b = ctx.b
    out = ctx.out_shape()
    nsp = len(out) - 2
    for d, scale in enumerate(_scales(scale_factors, nsp)):
        axis = 2 + d
        idx = _nearest_index(x.shape[axis], out[axis], scale)
        x = b.take(x, axis, _const(b, idx, "upsample.index"))
    return x


@lower(aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec)
def _upsample_linear(ctx: LoweringContext, x: Node, output_size, align_corners: bool, scale_factors) -> Node:
    b = ctx.b
    out = ctx.out_shape()
    nsp = len(out) - 2
    for d, scale in reversed(list(enumerate(_scales(scale_factors, nsp)))):
        axis = 2 + d
        i0, i1, w0, w1 = _linear_taps(x.shape[axis], out[axis], scale, align_corners)
        lo = b.take(x, axis, _const(b, i0, "upsample.index"))
        hi = b.take(x, axis, _const(b, i1, "upsample.index"))
        w0n = _along(b, _const(b, w0, "upsample.weight", x.dtype.torch), axis, x.type.rank)
        w1n = _along(b, _const(b, w1, "upsample.weight", x.dtype.torch), axis, x.type.rank)
        x = b.add(b.mul(lo, w0n), b.mul(hi, w1n))
    return x
