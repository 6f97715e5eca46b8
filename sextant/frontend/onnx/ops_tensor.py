"""ONNX tensor ops: constants, shapes, reshapes, slicing, gathers, scatters, concatenation, padding.

Shape-valued inputs (Reshape's shape, Slice's starts, Expand's shape) are evaluated at compile
time through ``ctx.ints`` — sextant compiles static shapes — so the Shape → Gather → Concat
chains exporters emit fold away before any kernel is generated. Index-valued inputs (Gather's
indices, OneHot's indices, ReverseSequence's lengths) stay runtime tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.ops import aten

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.onnx.dtypes import from_onnx, tensor_from_proto, unsupported_dtype
from sextant.frontend.onnx.registry import OnnxContext, axis, norm_axes, onnx_op
from sextant.graph.builder import GraphBuilder, broadcast_shapes
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

# -- helpers ---------------------------------------------------------------------------------------

def _proto_tensor(proto: object) -> torch.Tensor:
    """A TensorProto attribute as a tensor, or Unsupported when sextant lacks its element type."""
    if from_onnx(proto.data_type) is None:  # type: ignore[attr-defined]
        raise Unsupported(unsupported_dtype(proto.data_type))  # type: ignore[attr-defined]
    return tensor_from_proto(proto)


def _dtype_attr(ctx: OnnxContext, name: str, default: DType) -> DType:
    code = ctx.attr(name)
    if code is None:
        return default
    dt = from_onnx(int(code))
    if dt is None:
        raise Unsupported(unsupported_dtype(int(code)))
    return dt


def _wrap(b: GraphBuilder, idx: Node, n: int) -> Node:
    """Negative indices count from the end (ONNX allows them in every indexing op)."""
    idx = b.cast(idx, DType.i64)
    return b.where(b.binary("lt", idx, 0), b.add(idx, n), idx)


def _axes_operand(ctx: OnnxContext, axes: Node | None, since: int) -> list[int] | None:
    """An ``axes`` list: an attribute before opset ``since``, an optional input from then on."""
    if ctx.opset < since:
        a = ctx.attr("axes")
        return None if a is None else list(a)
    return None if axes is None else ctx.ints(axes, "axes")


def _scalar(ctx: OnnxContext, x: Node, what: str) -> float | int | bool:
    return ctx.const(x, what).reshape(-1)[0].item()


# -- constants and shapes --------------------------------------------------------------------------
@onnx_op("Constant")
def _constant(ctx: OnnxContext) -> Node:
    a = ctx.attrs
    if "value" in a:
        return ctx.tensor(_proto_tensor(a["value"]), "value")
    for key, dtype in (("value_float", torch.float32), ("value_int", torch.int64)):
        if key in a:
            return ctx.tensor(torch.tensor(a[key], dtype=dtype), key)
    for key, dtype in (("value_floats", torch.float32), ("value_ints", torch.int64)):
        if key in a:
            return ctx.tensor(torch.tensor(list(a[key]), dtype=dtype), key)
    if "sparse_value" in a:
        raise Unsupported("Constant with a sparse_value (sparse tensors)")
    if "value_string" in a or "value_strings" in a:
        raise Unsupported("Constant with a string value (sextant has no string type)")
    raise Unsupported(f"Constant with attribute(s) {sorted(a)}")


@onnx_op("ConstantOfShape")
def _constant_of_shape(ctx: OnnxContext, shape: Node) -> Node:
    dims = ctx.ints(shape, "shape")
    value = ctx.attr("value")
    t = _proto_tensor(value).reshape(-1) if value is not None else torch.zeros(1)
    return ctx.b.full(t[0].item(), dims, DType.from_torch(t.dtype))


@onnx_op("Identity")
def _identity(ctx: OnnxContext, x: Node) -> Node:
    return x


@onnx_op("Shape")
def _shape(ctx: OnnxContext, x: Node) -> Node:
    dims = list(x.shape)
    rank = len(dims)
    start = ctx.attr("start", 0)
    end = ctx.attr("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return ctx.tensor(torch.tensor(dims[start:end], dtype=torch.int64), "shape")


@onnx_op("Size")
def _size(ctx: OnnxContext, x: Node) -> Node:
    return ctx.b.full(x.type.numel, (), DType.i64)


@onnx_op("Range")
def _range(ctx: OnnxContext, start: Node, limit: Node, delta: Node) -> Node:
    s, lim, d = (_scalar(ctx, v, w) for v, w in ((start, "start"), (limit, "limit"), (delta, "delta")))
    if d == 0:
        raise Unsupported("Range with delta 0")
    if start.dtype.is_int:
        n = max(-((s - lim) // d), 0)  # ceil((limit - start) / delta) in exact integer arithmetic
    else:
        n = max(math.ceil((lim - s) / d), 0)
    step = torch.arange(n, dtype=torch.int64 if start.dtype.is_int else torch.float64)
    values = s + step * d
    return ctx.tensor(values.to(start.dtype.torch), "range")


# -- reshapes and permutations ---------------------------------------------------------------------
@onnx_op("Reshape")
def _reshape(ctx: OnnxContext, x: Node, shape: Node) -> Node:
    want = ctx.ints(shape, "shape")
    allowzero = ctx.attr("allowzero", 0)
    out = [x.shape[i] if d == 0 and not allowzero and i < x.type.rank else d for i, d in enumerate(want)]
    if out.count(-1) > 1:
        raise Unsupported(f"Reshape: more than one -1 in {want}")
    if -1 in out:
        known = 1
        for d in out:
            if d != -1:
                known *= d
        out[out.index(-1)] = x.type.numel // known if known else 0
    return ctx.b.reshape(x, out)


@onnx_op("Flatten")
def _flatten(ctx: OnnxContext, x: Node) -> Node:
    r = x.type.rank
    a = int(ctx.attr("axis", 1))
    if not -r <= a <= r:
        raise Unsupported(f"Flatten: axis={a} out of range for rank {r}")
    a = a + r if a < 0 else a
    return ctx.b.reshape(x, (math.prod(x.shape[:a]), math.prod(x.shape[a:])))


@onnx_op("Transpose")
def _transpose(ctx: OnnxContext, x: Node) -> Node:
    perm = ctx.attr("perm")
    perm = list(range(x.type.rank))[::-1] if perm is None else list(perm)
    return ctx.b.permute(x, norm_axes(perm, x.type.rank, "perm"))


@onnx_op("Squeeze")
def _squeeze(ctx: OnnxContext, x: Node, axes: Node | None = None) -> Node:
    ax = _axes_operand(ctx, axes, 13)
    if ax is None:
        keep = [d for d in x.shape if d != 1]
    else:
        drop = set(norm_axes(ax, x.type.rank))
        if any(x.shape[a] != 1 for a in drop):
            raise Unsupported(f"Squeeze: axes {ax} of shape {list(x.shape)} are not all 1")
        keep = [d for i, d in enumerate(x.shape) if i not in drop]
    return ctx.b.reshape(x, keep)


@onnx_op("Unsqueeze")
def _unsqueeze(ctx: OnnxContext, x: Node, axes: Node | None = None) -> Node:
    ax = _axes_operand(ctx, axes, 13)
    if ax is None:
        raise Unsupported("Unsqueeze without axes")
    rank = x.type.rank + len(ax)
    new = set(norm_axes(ax, rank))
    dims = iter(x.shape)
    return ctx.b.reshape(x, [1 if i in new else next(dims) for i in range(rank)])


@onnx_op("DepthToSpace")
def _depth_to_space(ctx: OnnxContext, x: Node) -> Node:
    k = int(ctx.attr("blocksize"))
    n, c, h, w = x.shape
    if ctx.attr("mode", "DCR") == "DCR":
        y = ctx.b.permute(ctx.b.reshape(x, (n, k, k, c // (k * k), h, w)), (0, 3, 4, 1, 5, 2))
    else:  # CRD
        y = ctx.b.permute(ctx.b.reshape(x, (n, c // (k * k), k, k, h, w)), (0, 1, 4, 2, 5, 3))
    return ctx.b.reshape(y, (n, c // (k * k), h * k, w * k))


@onnx_op("SpaceToDepth")
def _space_to_depth(ctx: OnnxContext, x: Node) -> Node:
    k = int(ctx.attr("blocksize"))
    n, c, h, w = x.shape
    y = ctx.b.permute(ctx.b.reshape(x, (n, c, h // k, k, w // k, k)), (0, 3, 5, 1, 2, 4))
    return ctx.b.reshape(y, (n, c * k * k, h // k, w // k))


# -- concatenation and splitting -------------------------------------------------------------------
@onnx_op("Concat")
def _concat(ctx: OnnxContext, *xs: Node) -> Node:
    return ctx.b.concat(list(xs), axis(ctx, xs[0]))


@onnx_op("Split")
def _split(ctx: OnnxContext, x: Node, split: Node | None = None) -> list[Node]:
    a = axis(ctx, x)
    n = x.shape[a]
    if ctx.opset < 13:
        sizes = ctx.attr("split")
    else:
        sizes = None if split is None else ctx.ints(split, "split")
    if sizes is None:
        parts = int(ctx.attr("num_outputs", ctx.num_outputs))
        chunk = -(-n // parts)  # the last chunk is smaller when n does not divide (opset 18)
        sizes = [max(min(chunk, n - i * chunk), 0) for i in range(parts)]
    sizes = list(sizes)
    if sum(sizes) != n:
        raise Unsupported(f"Split: sizes {sizes} do not add up to {n}")
    outs, start = [], 0
    for s in sizes:
        outs.append(ctx.b.slice(x, a, start if s else 0, s))
        start += s
    return outs


# -- slicing ---------------------------------------------------------------------------------------
@onnx_op("Slice")
def _slice(ctx: OnnxContext, x: Node, starts: Node | None = None, ends: Node | None = None,
           axes: Node | None = None, steps: Node | None = None) -> Node:
    if ctx.opset < 10:
        st, en, ax = list(ctx.attr("starts")), list(ctx.attr("ends")), ctx.attr("axes")
        sp = [1] * len(st)
    else:
        st, en = ctx.ints(starts, "starts"), ctx.ints(ends, "ends")
        ax = None if axes is None else ctx.ints(axes, "axes")
        sp = [1] * len(st) if steps is None else ctx.ints(steps, "steps")
    ax = list(range(len(st))) if ax is None else norm_axes(ax, x.type.rank)
    for a, s, e, step in zip(ax, st, en, sp):
        if step == 0:
            raise Unsupported("Slice with step 0")
        lo, hi, step = slice(s, e, step).indices(x.shape[a])  # numpy's clamping, as ONNX specifies
        x = ctx.b.slice(x, a, lo, len(range(lo, hi, step)), step)
    return x


@onnx_op("CenterCropPad")
def _center_crop_pad(ctx: OnnxContext, x: Node, shape: Node) -> Node:
    want = ctx.ints(shape, "shape")
    ax = ctx.attr("axes")
    ax = list(range(x.type.rank)) if ax is None else norm_axes(list(ax), x.type.rank)
    low, high = [0] * x.type.rank, [0] * x.type.rank
    for a, s in zip(ax, want):
        d = s - x.shape[a]  # a negative pad crops: the window starts at floor((dim - s) / 2)
        low[a] = d // 2 if d >= 0 else -((-d) // 2)
        high[a] = d - low[a]
    return ctx.b.pad(x, low, high, 0)


@onnx_op("Compress")
def _compress(ctx: OnnxContext, x: Node, condition: Node) -> Node:
    cond = ctx.const(condition, "condition").reshape(-1).bool()
    if ctx.attr("axis") is None:
        x = ctx.b.reshape(x, (x.type.numel,))
        a = 0
    else:
        a = axis(ctx, x)
    picked = torch.nonzero(cond[:x.shape[a]]).reshape(-1)
    if picked.numel() == 0:
        return ctx.b.full(0, x.shape[:a] + (0,) + x.shape[a + 1:], x.dtype)
    return ctx.b.take(x, a, ctx.tensor(picked, "condition"))


# -- padding, tiling, broadcasting -----------------------------------------------------------------
def _pad_index(mode: str, n: int, lo: int, hi: int) -> np.ndarray:
    """The source index of each output position along one dim for the edge/reflect/wrap modes."""
    p = np.arange(-lo, n + hi)
    if mode == "edge" or n == 1:
        return np.clip(p, 0, n - 1)
    if mode == "wrap":
        return np.mod(p, n)
    period = 2 * (n - 1)  # reflect: mirror about the first and last element, repeatedly
    m = np.mod(p, period)
    return np.where(m < n, m, period - m)


@onnx_op("Pad")
def _pad(ctx: OnnxContext, x: Node, pads: Node | None = None, value: Node | None = None,
         axes: Node | None = None) -> Node:
    b, r = ctx.b, x.type.rank
    mode = ctx.attr("mode", "constant")
    if ctx.opset < 11:
        p, fill = list(ctx.attr("pads")), ctx.attr("value", 0.0)
    else:
        p = ctx.ints(pads, "pads")
        fill = 0 if value is None or not ctx.is_const(value) else _scalar(ctx, value, "constant_value")
    ax = list(range(r)) if axes is None else norm_axes(ctx.ints(axes, "axes"), r)
    if len(p) != 2 * len(ax):
        raise Unsupported(f"Pad: {len(p)} pads for {len(ax)} axes")
    low, high = [0] * r, [0] * r
    for i, a in enumerate(ax):
        low[a], high[a] = p[i], p[i + len(ax)]
    if mode == "constant":
        out = b.pad(x, low, high, fill)
        if value is not None and not ctx.is_const(value):  # a runtime fill value: select it outside x
            inside = b.pad(b.full(True, x.shape, DType.bool), low, high, False)
            out = b.where(inside, out, b.reshape(value, ()))
        return out
    if mode not in ("edge", "reflect", "wrap"):
        raise Unsupported(f"Pad: mode {mode!r}")
    for a in range(r):
        if low[a] == 0 and high[a] == 0:
            continue
        if x.shape[a] == 0:
            raise Unsupported(f"Pad: {mode} padding of an empty dim")
        idx = _pad_index(mode, x.shape[a], low[a], high[a])
        x = b.take(x, a, ctx.tensor(torch.from_numpy(idx), "pad_index"))
    return x


@onnx_op("Expand")
def _expand(ctx: OnnxContext, x: Node, shape: Node) -> Node:
    return ctx.b.broadcast_to(x, broadcast_shapes(x.shape, ctx.ints(shape, "shape")))


@onnx_op("Tile")
def _tile(ctx: OnnxContext, x: Node, repeats: Node) -> Node:
    reps = ctx.ints(repeats, "repeats")
    if len(reps) != x.type.rank:
        raise Unsupported(f"Tile: {len(reps)} repeats for rank {x.type.rank}")
    return ctx.aten(aten.repeat.default, x, reps)


# -- gathers ---------------------------------------------------------------------------------------
@onnx_op("Gather")
def _gather(ctx: OnnxContext, x: Node, indices: Node) -> Node:
    a = axis(ctx, x)
    return ctx.b.take(x, a, _wrap(ctx.b, indices, x.shape[a]))


@onnx_op("GatherElements")
def _gather_elements(ctx: OnnxContext, x: Node, indices: Node) -> Node:
    return ctx.aten(aten.gather.default, x, axis(ctx, x), ctx.b.cast(indices, DType.i64))


def _linear_index(b: GraphBuilder, indices: Node, dims: Sequence[int]) -> Node:
    """Row-major linear index of the tuples in ``indices``' last dim (negatives wrapped) into ``dims``."""
    lead = indices.shape[:-1]
    lin: Node | None = None
    stride = 1
    for j in reversed(range(len(dims))):
        col = b.reshape(b.slice(indices, -1, j, 1), lead)
        term = b.mul(_wrap(b, col, dims[j]), stride)
        lin = term if lin is None else b.add(lin, term)
        stride *= dims[j]
    return lin if lin is not None else b.full(0, lead, DType.i64)


@onnx_op("GatherND")
def _gather_nd(ctx: OnnxContext, x: Node, indices: Node) -> Node:
    b = ctx.b
    nb = int(ctx.attr("batch_dims", 0))
    k = indices.shape[-1]
    batch, picked, rest = x.shape[:nb], x.shape[nb:nb + k], x.shape[nb + k:]
    lin = _linear_index(b, indices, picked)
    group = math.prod(picked)
    for i in range(nb):  # each batch entry indexes its own block of the flattened data
        lin = b.add(lin, b.mul(b.iota(indices.shape[:-1], i), group * math.prod(batch[i + 1:])))
    flat = b.reshape(x, (math.prod(batch) * group,) + rest)
    return b.take(flat, 0, lin)


# -- scatters --------------------------------------------------------------------------------------
_REDUCTION = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter(ctx: OnnxContext, x: Node, dim: int, index: Node, src: Node) -> Node:
    red = ctx.attr("reduction", "none")
    if red == "none":
        return ctx.aten(aten.scatter.src, x, dim, index, src)
    if red not in _REDUCTION:
        raise Unsupported(f"{ctx.op_type}: reduction {red!r}")
    return ctx.aten(aten.scatter_reduce.two, x, dim, index, src, _REDUCTION[red], include_self=True)


@onnx_op("ScatterElements", "Scatter")
def _scatter_elements(ctx: OnnxContext, x: Node, indices: Node, updates: Node) -> Node:
    a = axis(ctx, x)
    return _scatter(ctx, x, a, _wrap(ctx.b, indices, x.shape[a]), updates)


@onnx_op("ScatterND")
def _scatter_nd(ctx: OnnxContext, x: Node, indices: Node, updates: Node) -> Node:
    """Linearise the indexed leading dims, then scatter whole rows along that one dim."""
    b = ctx.b
    k = indices.shape[-1]
    picked, rest = x.shape[:k], x.shape[k:]
    m = math.prod(indices.shape[:-1])
    lin = b.reshape(_linear_index(b, indices, picked), (m,) + (1,) * len(rest))
    flat = b.reshape(x, (math.prod(picked),) + rest)
    upd = b.reshape(updates, (m,) + rest)
    out = _scatter(ctx, flat, 0, b.expand(lin, (m,) + rest), upd)
    return b.reshape(out, x.shape)


@onnx_op("TensorScatter")
def _tensor_scatter(ctx: OnnxContext, past: Node, update: Node, write_indices: Node | None = None) -> Node:
    """A KV-cache write as a gather: cache position j takes update[j - w[batch]] where that exists."""
    b = ctx.b
    a = axis(ctx, past, default=-2)
    m, s = past.shape[a], update.shape[a]
    j = b.iota(past.shape, a)
    if write_indices is not None:
        w = b.reshape(b.cast(write_indices, DType.i64), (past.shape[0],) + (1,) * (past.type.rank - 1))
        j = b.sub(j, b.broadcast_to(w, past.shape))
    if ctx.attr("mode", "linear") == "circular":
        j = b.binary("remainder", j, m)
    valid = b.binary("bitwise_and", b.binary("ge", j, 0), b.binary("lt", j, s))
    src = b.gather(update, a, b.minimum(b.maximum(j, 0), s - 1))
    return b.where(valid, src, past)


# -- index-generated tensors -----------------------------------------------------------------------
@onnx_op("EyeLike")
def _eye_like(ctx: OnnxContext, x: Node) -> Node:
    if x.type.rank != 2:
        raise Unsupported(f"EyeLike of rank {x.type.rank}")
    b = ctx.b
    diag = b.binary("eq", b.sub(b.iota(x.shape, 1), b.iota(x.shape, 0)), int(ctx.attr("k", 0)))
    return b.cast(diag, _dtype_attr(ctx, "dtype", x.dtype))


@onnx_op("OneHot")
def _one_hot(ctx: OnnxContext, indices: Node, depth: Node, values: Node) -> Node:
    b = ctx.b
    n = int(_scalar(ctx, depth, "depth"))
    r = indices.type.rank
    a = int(ctx.attr("axis", -1))
    if not -r - 1 <= a <= r:
        raise Unsupported(f"OneHot: axis={a} out of range for rank {r}")
    a %= r + 1
    shape = indices.shape[:a] + (n,) + indices.shape[a:]
    idx = _wrap(b, indices, n)  # float indices truncate, like the cast ONNX describes
    idx = b.expand(b.reshape(idx, indices.shape[:a] + (1,) + indices.shape[a:]), shape)
    hot = b.binary("eq", idx, b.iota(shape, a))
    off, on = (b.reshape(b.slice(values, 0, i, 1), ()) for i in (0, 1))
    return b.where(hot, on, off)


@onnx_op("Trilu")
def _trilu(ctx: OnnxContext, x: Node, k: Node | None = None) -> Node:
    upper = bool(ctx.attr("upper", 1))
    if k is None or ctx.is_const(k):
        diag = 0 if k is None else int(_scalar(ctx, k, "k"))
        return ctx.aten(aten.triu.default if upper else aten.tril.default, x, diag)
    b = ctx.b  # a runtime diagonal offset: compare against it elementwise
    rows, cols = x.shape[-2:]
    delta = b.sub(b.iota((rows, cols), 1), b.iota((rows, cols), 0))
    keep = b.binary("ge" if upper else "le", delta, b.broadcast_to(b.cast(b.reshape(k, ()), DType.i64), (rows, cols)))
    return b.where(b.broadcast_to(keep, x.shape), x, False if x.dtype == DType.bool else 0)


@onnx_op("ReverseSequence")
def _reverse_sequence(ctx: OnnxContext, x: Node, lens: Node) -> Node:
    b = ctx.b
    t_ax, b_ax = axis(ctx, x, "time_axis", 0), axis(ctx, x, "batch_axis", 1)
    t = b.iota(x.shape, t_ax)
    shape = [1] * x.type.rank
    shape[b_ax] = x.shape[b_ax]
    n = b.broadcast_to(b.reshape(b.cast(lens, DType.i64), shape), x.shape)
    src = b.where(b.binary("lt", t, n), b.sub(b.sub(n, 1), t), t)
    return b.gather(x, t_ax, src)


def _window(ctx: OnnxContext, size: Node, fn: str) -> Node:
    n = int(_scalar(ctx, size, "size"))
    denom = n if ctx.attr("periodic", 1) else n - 1
    x = 2 * np.pi * np.arange(n) / max(denom, 1)
    if fn == "hann":
        w = 0.5 - 0.5 * np.cos(x)
    elif fn == "hamming":
        w = 25 / 46 - (21 / 46) * np.cos(x)
    else:
        w = 0.42 - 0.5 * np.cos(x) + 0.08 * np.cos(2 * x)
    return ctx.tensor(torch.from_numpy(w).to(_dtype_attr(ctx, "output_datatype", DType.f32).torch), fn)


@onnx_op("HannWindow")
def _hann(ctx: OnnxContext, size: Node) -> Node:
    return _window(ctx, size, "hann")


@onnx_op("HammingWindow")
def _hamming(ctx: OnnxContext, size: Node) -> Node:
    return _window(ctx, size, "hamming")


@onnx_op("BlackmanWindow")
def _blackman(ctx: OnnxContext, size: Node) -> Node:
    return _window(ctx, size, "blackman")
