"""ONNX tensor ops: constants, shapes, reshapes, slicing, gathers, concatenation, padding.

Shape-valued inputs (Reshape's shape, Slice's starts, Expand's shape) are evaluated at compile
time through ``ctx.ints`` — sextant compiles static shapes — so the Shape → Gather → Concat
chains exporters emit fold away before any kernel is generated.
"""

from __future__ import annotations

import torch

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.onnx.dtypes import tensor_from_proto
from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.ir import Node


@onnx_op("Constant")
def _constant(ctx: OnnxContext) -> Node:
    a = ctx.attrs
    if "value" in a:
        return ctx.tensor(tensor_from_proto(a["value"]), "value")
    for key, dtype in (("value_float", torch.float32), ("value_int", torch.int64)):
        if key in a:
            return ctx.tensor(torch.tensor(a[key], dtype=dtype), key)
    for key, dtype in (("value_floats", torch.float32), ("value_ints", torch.int64)):
        if key in a:
            return ctx.tensor(torch.tensor(list(a[key]), dtype=dtype), key)
    raise Unsupported(f"Constant with attribute(s) {sorted(a)}")


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
