"""Ops with no lowering become ``extern`` calls (``sextant/graph/extern.py``) instead of a refusal.

``sextant.compile(..., strict=True)`` keeps the refusal for users who want generated code only.
What cannot be an extern call is still refused, with the reason: ops that are not plain op
overloads (higher-order control flow), ops that write their arguments, ops whose output size
depends on the data (``nonzero``, ``unique``, ``masked_select``: a buffer's size must be known
before the call — see docs/frontend.md, "Extern calls"), results that are not tensors of a
supported dtype, and arguments that cannot be written down (a symbolic size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from sextant.frontend.lowerings import LoweringContext
from sextant.graph.dtypes import DType
from sextant.graph.extern import ExternEncodingError, encode, flatten, op_name
from sextant.graph.ir import Node
from sextant.graph.symbolic import SymbolicShapeError

COMMUNICATION = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})


class NotExtern(Exception):
    """The op cannot be called as an extern op; the message says why."""


def extern_refusal(node: torch.fx.Node) -> str | None:
    """Why ``node``'s op cannot run as an extern call, or None when it can."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return "not an op overload (a higher-order op or a Python function): it cannot be called as an extern op"
    if op.namespace in COMMUNICATION:
        return ("a torch.distributed op with no lowering: its result arrives asynchronously, so it cannot be "
                "called as an extern op (see docs/distributed.md for the collectives sextant compiles)")
    if op._schema.is_mutable:
        return "it writes its arguments in place; an extern call must be pure"
    results = flatten(node.meta.get("val"))
    if not any(isinstance(v, torch.Tensor) for v in results):
        return "it returns no tensor"
    for v in results:
        if isinstance(v, torch.Tensor):
            if free_unbacked_symbols(v.shape):
                return ("its output size depends on the values of its inputs (a data-dependent shape): "
                        "sextant plans every buffer before the call")
            try:
                DType.from_torch(v.dtype)
            except TypeError as e:
                return str(e)
        elif v is not None and not isinstance(v, (int, float, bool)):
            return f"it returns a {type(v).__name__}"
        elif isinstance(v, (int, float, bool)):
            return "it returns a Python scalar besides tensors"
    return None


def lower_extern(ctx: LoweringContext, args: tuple, kwargs: dict[str, Any]) -> Node | tuple:
    """Emit the ``extern`` nodes of one call: one per tensor result, shaped like the op's output
    (a tuple mirroring it, ``None`` where the op returns no tensor)."""
    node = ctx.fx_node
    why = extern_refusal(node)
    if why is not None:
        raise NotExtern(why)
    operands: list[Node] = []

    def operand(v: Any) -> int | None:
        if not isinstance(v, Node):
            return None
        for k, o in enumerate(operands):
            if o is v:
                return k
        operands.append(v)
        return len(operands) - 1

    try:
        a, k = encode(args, kwargs, operand)
    except ExternEncodingError as e:
        raise NotExtern(f"an argument cannot be passed to an extern call: {e}") from None
    op = node.target
    attrs: dict[str, Any] = {"fn": op_name(op), "args": a, "kwargs": k}
    if torch.Tag.nondeterministic_seeded in op.tags:  # two calls of a random op are two values: never merged
        attrs["site"] = node.name
    val = node.meta.get("val")
    index = 0

    def emit(v: Any) -> Any:
        nonlocal index
        if isinstance(v, (tuple, list)):
            return tuple(emit(x) for x in v)
        if not isinstance(v, torch.Tensor):
            return None
        try:
            shape = tuple(ctx.dim(d) for d in v.shape)
        except SymbolicShapeError as e:
            raise NotExtern(f"its output size cannot be stated: {e}") from None
        out = ctx.b.emit("extern", operands, **attrs, result=index, shape=shape, dtype=DType.from_torch(v.dtype))
        index += 1
        return out

    return emit(val)
