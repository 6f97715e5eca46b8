"""``torch.distributed``'s functional collectives onto the graph IR's ``collective`` and ``wait``.

torch.export and AOTAutograd record what a model sends between ranks as ``_c10d_functional`` ops:
one op starts the transfer and returns a tensor that is not ready, ``wait_tensor`` makes it
ready. Each becomes a ``collective`` node and a ``wait`` node (``graph/collectives.py``); the
schedule later moves each wait to just before the value's first reader. The ``_coalesced`` forms
(one call over a list of tensors) become one collective per tensor, in list order.
"""

from __future__ import annotations

from typing import Any

import torch

from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower
from sextant.graph.collectives import check_attrs
from sextant.graph.ir import Node

torch.distributed.is_available()  # the ops below exist once torch.distributed is importable
import torch.distributed._functional_collectives  # noqa: E402  (registers _c10d_functional's Python side)

c10d = torch.ops._c10d_functional


def _group(name: Any) -> str:
    """A group argument as recorded: its name (a ``ProcessGroup`` when a trace kept the object)."""
    if isinstance(name, str):
        return name
    group_name = getattr(name, "group_name", None)
    if isinstance(group_name, str):
        return group_name
    raise Unsupported(f"a process group given as {type(name).__name__}: sextant names groups by their name")


def _reduce(op: str) -> str:
    return op.lower()


def _splits(sizes: Any) -> tuple[int, ...]:
    if sizes is None:
        return ()
    if not all(isinstance(s, int) for s in sizes):
        raise Unsupported("all_to_all_single with split sizes known only at run time")
    return tuple(sizes)


def _start(ctx: LoweringContext, x: Node, kind: str, **attrs: Any) -> Node:
    if not isinstance(x, Node):
        raise Unsupported(f"{kind} of a {type(x).__name__}: a tensor is expected")
    why = check_attrs(kind, attrs)
    if why is not None:
        raise Unsupported(why)
    return ctx.b.emit("collective", [x], kind=kind, **attrs)


@lower(c10d.all_reduce.default)
def _all_reduce(ctx: LoweringContext, x: Node, reduce_op: str, group: Any) -> Node:
    return _start(ctx, x, "all_reduce", reduce=_reduce(reduce_op), group=_group(group))


@lower(c10d.all_reduce_coalesced.default)
def _all_reduce_coalesced(ctx: LoweringContext, xs: list[Node], reduce_op: str, group: Any) -> tuple[Node, ...]:
    return tuple(_all_reduce(ctx, x, reduce_op, group) for x in xs)


@lower(c10d.all_gather_into_tensor.default)
def _all_gather(ctx: LoweringContext, x: Node, ranks: int, group: Any) -> Node:
    return _start(ctx, x, "all_gather", ranks=ranks, group=_group(group))


@lower(c10d.all_gather_into_tensor_coalesced.default)
def _all_gather_coalesced(ctx: LoweringContext, xs: list[Node], ranks: int, group: Any) -> tuple[Node, ...]:
    return tuple(_all_gather(ctx, x, ranks, group) for x in xs)


@lower(c10d.reduce_scatter_tensor.default)
def _reduce_scatter(ctx: LoweringContext, x: Node, reduce_op: str, ranks: int, group: Any) -> Node:
    return _start(ctx, x, "reduce_scatter", reduce=_reduce(reduce_op), ranks=ranks, group=_group(group))


@lower(c10d.reduce_scatter_tensor_coalesced.default)
def _reduce_scatter_coalesced(ctx: LoweringContext, xs: list[Node], reduce_op: str, ranks: int,
                              group: Any) -> tuple[Node, ...]:
    return tuple(_reduce_scatter(ctx, x, reduce_op, ranks, group) for x in xs)


@lower(c10d.all_to_all_single.default)
def _all_to_all(ctx: LoweringContext, x: Node, out_splits: Any, in_splits: Any, group: Any) -> Node:
    return _start(ctx, x, "all_to_all", out_splits=_splits(out_splits), in_splits=_splits(in_splits),
                  group=_group(group))


@lower(c10d.broadcast.default)
def _broadcast(ctx: LoweringContext, x: Node, src: int, group: Any) -> Node:
    return _start(ctx, x, "broadcast", src=src, group=_group(group))


@lower(c10d.wait_tensor.default)
def _wait(ctx: LoweringContext, x: Node) -> Node:
    if not isinstance(x, Node) or x.op not in ("collective", "wait"):
        what = x.op if isinstance(x, Node) else type(x).__name__
        raise Unsupported(f"wait_tensor on a {what}: only a collective started in the same graph can be waited "
                          "for (a transfer still in flight when the graph is called is not supported)")
    if x.op == "wait":  # waited for already: the value itself
        return x
    return ctx.b.emit("wait", [x])
