"""The table from ATen op overloads to lowering functions.

A lowering receives a :class:`LoweringContext` and the FX node's arguments with tensors
already translated to graph-IR nodes; it returns a node, a tuple/list of nodes (for
multi-result ops), or None (for ops with no result, like asserts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch._prims_common as prims_common

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

Lowering = Callable[..., Any]
LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


class Unsupported(Exception):
    """Raised by a lowering for an argument combination it does not handle."""


class NoNativeForm(Unsupported):
    """Raised by a lowering whose native form does not suit these arguments (a sort too long for
    the rank-count form, say): the op is then called as itself, an extern call (unless ``strict``)."""


NAMED_LOWERINGS: dict[str, Lowering] = {}  # "namespace.op.overload" -> lowering, for ops a library registers


def lower_named(*names: str) -> Callable[[Lowering], Lowering]:
    """Register ``fn`` for custom ops named ``namespace.op.overload`` (``torch.library`` ops that exist
    only once their library is imported, e.g. transformers' ``grouped_mm_fallback``)."""

    def deco(fn: Lowering) -> Lowering:
        for name in names:
            NAMED_LOWERINGS[name] = fn
        return fn

    return deco


def lowering_for(target: object) -> Lowering | None:
    """The lowering of an FX node's target, or None."""
    fn = LOWERINGS.get(target)  # type: ignore[call-overload]
    if fn is None and isinstance(target, torch._ops.OpOverload) and NAMED_LOWERINGS:
        from sextant.graph.extern import op_name

        fn = NAMED_LOWERINGS.get(op_name(target))
    return fn


def lower(*ops: torch._ops.OpOverload) -> Callable[[Lowering], Lowering]:
    """Register ``fn`` as the lowering of each of ``ops`` (explicit overloads only)."""

    def deco(fn: Lowering) -> Lowering:
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"register an overload such as aten.add.Tensor, not {op}")
            LOWERINGS[op] = fn
        return fn

    return deco


def _dummy(v: Any) -> Any:
    if isinstance(v, Node):
        return torch.empty((1,) * v.type.rank, dtype=v.dtype.torch) if v.type.rank else \
            torch.empty((), dtype=v.dtype.torch)
    return v


@dataclass
class LoweringContext:
    """What a lowering may look at besides its arguments: the builder and the result's metadata."""

    b: GraphBuilder
    fx_node: torch.fx.Node
    dim: Callable[[Any], Any] = int  # a recorded size (int or torch.SymInt) as a graph-IR dimension

    @property
    def meta(self) -> Any:
        return self.fx_node.meta.get("val")

    def out_dtype(self, index: int | None = None) -> DType:
        val = self.meta if index is None else self.meta[index]
        return DType.from_torch(val.dtype)

    def out_shape(self, index: int | None = None) -> tuple[Any, ...]:
        val = self.meta if index is None else self.meta[index]
        return tuple(self.dim(d) for d in val.shape)

    def promote(self, *values: Any) -> DType:
        """torch's type promotion over tensors (nodes) and Python scalars."""
        args = [_dummy(v) for v in values if v is not None]
        _, result = prims_common.elementwise_dtypes(
            *args, type_promotion_kind=prims_common.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
        )
        return DType.from_torch(result)


def opmath(dtype: DType) -> DType:
    """The type torch computes half-precision composite ops in."""
    return DType.f32 if dtype in (DType.f16, DType.bf16) else dtype
