"""Random ops: ``rand``, ``randn``, ``bernoulli`` and ``native_dropout`` onto the graph IR's ``random``.

Each becomes a ``random`` node — Philox numbers keyed by a seed each call draws from torch's
generator (``graph/philox.py``) — plus the elementwise math of the op, so a dropout mask is
computed inside the kernel that applies it. The numbers are not eager torch's (its CPU generator
is a Mersenne twister): the same seed gives the same numbers on every sextant target, and
``torch.manual_seed`` makes a run reproducible. Ops with an explicit ``generator`` keep no lowering
(they run as extern calls).
"""

from __future__ import annotations

from typing import Any

import torch

from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower, opmath
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

aten = torch.ops.aten


def _float_type(ctx: LoweringContext, what: str) -> DType:
    dtype = ctx.out_dtype()
    if not dtype.is_float:
        raise Unsupported(f"{what} of dtype {dtype.value}: random numbers are generated as floats")
    return dtype


@lower(aten.rand.default, aten.rand_like.default)
def _rand(ctx: LoweringContext, *_: Any, **__: Any) -> Node:
    return ctx.b.random(ctx.out_shape(), _float_type(ctx, "rand"), "uniform")


@lower(aten.randn.default, aten.randn_like.default)
def _randn(ctx: LoweringContext, *_: Any, **__: Any) -> Node:
    return ctx.b.random(ctx.out_shape(), _float_type(ctx, "randn"), "normal")


@lower(aten.bernoulli.p, aten.bernoulli.default)
def _bernoulli(ctx: LoweringContext, x: Node, p: float | None = None, **__: Any) -> Node:
    """1 where a uniform number is below the probability (``p``, or each element of ``x``)."""
    b, dtype = ctx.b, _float_type(ctx, "bernoulli")
    u = b.random(x.shape, opmath(dtype), "uniform")
    prob = b.cast(x, u.dtype) if p is None else p
    return b.cast(b.binary("lt", u, prob), dtype)


@lower(aten.native_dropout.default)
def _native_dropout(ctx: LoweringContext, x: Node, p: float, train: bool | None) -> tuple[Node, Node]:
    """(output, keep mask) as torch's decomposition computes them: keep where ``rand > p``, and
    scale what is kept by ``1 / (1 - p)``."""
    b = ctx.b
    if not train or p == 0:
        return x, b.full(True, x.shape, DType.bool)
    if not x.dtype.is_float:
        raise Unsupported(f"dropout of dtype {x.dtype.value}: only floating-point tensors")
    if p >= 1:
        return b.full(0, x.shape, x.dtype), b.full(False, x.shape, DType.bool)
    keep = b.binary("gt", b.random(x.shape, x.dtype, "uniform"), p)
    scaled = b.cast(b.mul(b.cast(x, opmath(x.dtype)), 1.0 / (1.0 - p)), x.dtype)
    return b.where(keep, scaled, 0), keep
