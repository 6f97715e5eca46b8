"""Extern calls: an ATen (or ``torch.library`` custom) op the graph runs as the op itself.

An op with no lowering is not a reason to refuse a whole model: the frontend emits an ``extern``
node that names the op and its call, and every target calls that op on the host between its
own kernels, on buffers it planned like any other (a fusion barrier). This module is the one
place that says how such a call is written down and how it runs; the reference executor and
every runtime call :func:`call_extern`.

A node is one result of a call (the graph IR's nodes have one value each): ``topk`` is two
``extern`` nodes with the same ``fn``, ``args``, ``kwargs`` and operands, ``result=0`` and
``result=1`` — the schedule makes them one call. The arguments are JSON text, so the node
prints, parses and hashes like any other:

    %7 = extern(%6) {args="[\"$0\", 2, -1, true, true]", dtype=f32, fn="aten.topk.default",
                     kwargs="{}", result=0, shape=[4,2]} : f32[4,2]

``"$k"`` is the call's k-th tensor operand (a literal string starting with ``$`` is written
``"$$..."``); a torch dtype is ``{"dtype": "float32"}``; a device is ``{"device": null}`` — the
device the call runs on (the target's), never the one the model was captured on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

EXTERN_ATTRS = ("fn", "args", "kwargs", "result")


class ExternEncodingError(ValueError):
    """An argument of the call cannot be written down (a tensor list, a symbolic size, an object)."""


def resolve(fn: str) -> torch._ops.OpOverload:
    """``"aten.topk.default"`` (``namespace.op.overload``) → the op overload."""
    namespace, _, rest = fn.partition(".")
    name, _, overload = rest.rpartition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError) as e:
        raise LookupError(f"extern op {fn!r} is not registered with torch (is the library that defines it "
                          f"imported?)") from e


def op_name(op: torch._ops.OpOverload) -> str:
    """The name an extern node stores: ``namespace.op.overload``."""
    return f"{op.namespace}.{op._schema.name.split('::')[-1]}.{op._overloadname}"


def _encode(v: Any, operand: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, (int, float)):
        return v
    if isinstance(v, str):
        return "$" + v if v.startswith("$") else v
    if isinstance(v, (list, tuple)):
        return [_encode(x, operand) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": None}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    index = operand(v)
    if index is not None:
        return f"${index}"
    raise ExternEncodingError(f"argument {v!r} of type {type(v).__name__}")


def encode(args: Sequence[Any], kwargs: dict[str, Any], operand: Any) -> tuple[str, str]:
    """The call's (args, kwargs) as JSON text; ``operand(v)`` gives a tensor value's operand index
    (None for anything else)."""
    return (json.dumps([_encode(a, operand) for a in args], separators=(", ", ": ")),
            json.dumps({k: _encode(v, operand) for k, v in kwargs.items()}, separators=(", ", ": ")))


def _decode(v: Any, tensors: Sequence[torch.Tensor], device: torch.device) -> Any:
    if isinstance(v, str):
        if v.startswith("$$"):
            return v[1:]
        if v.startswith("$"):
            return tensors[int(v[1:])]
        return v
    if isinstance(v, list):
        return [_decode(x, tensors, device) for x in v]
    if isinstance(v, dict):
        (kind, value), = v.items()
        if kind == "device":
            return device
        return getattr(torch, value)
    return v


def call_extern(fn: str, args: str, kwargs: str, tensors: Sequence[torch.Tensor],
                device: torch.device | None = None) -> list[torch.Tensor]:
    """Run the call on ``tensors`` (its operands, in order); its tensor results, flat, in order."""
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    op = resolve(fn)
    a = _decode(json.loads(args), tensors, device)
    k = {name: _decode(v, tensors, device) for name, v in json.loads(kwargs).items()}
    with torch.no_grad():
        out = op(*a, **k)
    return flat_results(out)


def flatten(out: Any) -> list[Any]:
    """An op's results in order, nested tuples/lists flattened (tensors and anything else)."""
    if isinstance(out, (tuple, list)):
        return [r for x in out for r in flatten(x)]
    return [out]


def flat_results(out: Any) -> list[torch.Tensor]:
    """An op's tensor results in order (a tensor, or a tuple/list of them)."""
    return [t for t in flatten(out) if isinstance(t, torch.Tensor)]


def call_key(node: Any) -> tuple:
    """Nodes with equal keys are results of one call (same op, arguments and operands)."""
    return (node.attr("fn"), node.attr("args"), node.attr("kwargs"), node.attr("site"),
            tuple(id(i) for i in node.inputs))
