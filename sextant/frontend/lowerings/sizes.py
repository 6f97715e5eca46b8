"""Size arithmetic of graphs exported with dynamic shapes: ``aten.sym_size.int`` and the Python
operators torch.export records on sizes (``s0 * s1``, ``s1 - 1``). They compute no tensor: each
gives a dimension (an ``int`` or a ``SymDim``) that later lowerings take as a shape argument."""

from __future__ import annotations

import operator
from typing import Any

import torch

from sextant.frontend.lowerings.registry import LOWERINGS, LoweringContext, Unsupported, lower
from sextant.graph.ir import Node
from sextant.graph.symbolic import is_dim

aten = torch.ops.aten


@lower(aten.sym_size.int)
def _sym_size(ctx: LoweringContext, x: Node, dim: int) -> Any:
    return x.shape[dim]


@lower(aten.sym_numel.default)
def _sym_numel(ctx: LoweringContext, x: Node) -> Any:
    return x.type.numel


def _size_op(fn: Any, name: str) -> Any:
    def lowering(ctx: LoweringContext, *args: Any) -> Any:
        if not all(is_dim(a) for a in args):
            raise Unsupported(f"{name} on {', '.join(type(a).__name__ for a in args)} (sizes only)")
        return fn(*args)

    return lowering


for _fn, _name in ((operator.add, "+"), (operator.sub, "-"), (operator.mul, "*"), (operator.floordiv, "//"),
                   (operator.mod, "%"), (operator.neg, "unary -")):
    LOWERINGS[_fn] = _size_op(_fn, _name)  # type: ignore[index]  # Python operators, not ATen overloads
