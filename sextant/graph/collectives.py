"""Collectives: communication between the ranks of a ``torch.distributed`` process group.

sextant has no communication layer of its own: a collective is a graph-IR node that the runtime
hands to torch's (gloo on CPUs, NCCL on GPUs), as Inductor does. Two nodes spell one transfer,
so that the schedule can run kernels while it is in flight:

    %4 = collective(%3) {group="0", kind="all_reduce", reduce="sum"} : f32[4,16]
    %5 = wait(%4) : f32[4,16]

``collective`` starts the transfer (its value is not to be read yet); ``wait`` is the value once
it has arrived, and the only reader a ``collective`` may have. Kinds, after torch's
``_c10d_functional`` ops:

| kind | attributes | result |
|---|---|---|
| ``all_reduce`` | ``reduce`` | the elementwise reduction over the ranks |
| ``all_gather`` | ``ranks`` | the ranks' tensors concatenated along dim 0 |
| ``reduce_scatter`` | ``reduce``, ``ranks`` | this rank's 1/ranks slice (dim 0) of the reduction |
| ``all_to_all`` | ``out_splits``, ``in_splits`` | dim-0 slices exchanged (empty splits: equal slices) |
| ``broadcast`` | ``src`` | rank ``src``'s tensor |

``group`` is the process group's name (``ProcessGroup.group_name``): the compiled program calls the
collective on the group of that name in the process that runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
REDUCE_OPS = ("sum", "avg", "product", "min", "max")


def result_shape(kind: str, shape: tuple, attrs: dict[str, Any]) -> tuple:
    """The shape of a ``collective`` of ``kind`` over an operand of ``shape`` (raises ValueError)."""
    if not shape and kind in ("all_gather", "reduce_scatter", "all_to_all"):
        raise ValueError(f"{kind} needs an operand with a first dimension")
    if kind in ("all_reduce", "broadcast"):
        return shape
    if kind == "all_gather":
        return (shape[0] * attrs["ranks"], *shape[1:])
    if kind == "reduce_scatter":
        if isinstance(shape[0], int) and shape[0] % attrs["ranks"]:
            raise ValueError(f"reduce_scatter over {attrs['ranks']} ranks: dim 0 ({shape[0]}) is not divisible")
        return (shape[0] // attrs["ranks"], *shape[1:])
    if kind == "all_to_all":
        out, ins = attrs.get("out_splits", ()), attrs.get("in_splits", ())
        if ins and isinstance(shape[0], int) and sum(ins) != shape[0]:
            raise ValueError(f"all_to_all: in_splits {list(ins)} do not add up to dim 0 ({shape[0]})")
        return (sum(out), *shape[1:]) if out else shape
    raise ValueError(f"unknown collective kind {kind!r} (known: {', '.join(KINDS)})")


def check_attrs(kind: str, attrs: dict[str, Any]) -> str | None:
    """What is wrong with a ``collective``'s attributes, or None."""
    if kind not in KINDS:
        return f"collective.kind must be one of {', '.join(KINDS)}, got {kind!r}"
    if not isinstance(attrs.get("group"), str):
        return "collective.group must be a process group's name"
    if kind in ("all_reduce", "reduce_scatter") and attrs.get("reduce") not in REDUCE_OPS:
        return f"collective.reduce must be one of {', '.join(REDUCE_OPS)}, got {attrs.get('reduce')!r}"
    if kind in ("all_gather", "reduce_scatter") and not (isinstance(attrs.get("ranks"), int) and attrs["ranks"] > 0):
        return "collective.ranks must be the group's size"
    if kind == "broadcast" and not isinstance(attrs.get("src"), int):
        return "collective.src must be a rank"
    if kind == "all_to_all":
        for k in ("out_splits", "in_splits"):
            v = attrs.get(k, ())
            if not (isinstance(v, tuple) and all(isinstance(i, int) and i >= 0 for i in v)):
                return f"collective.{k} must be a tuple of sizes"
    return None


def _functional() -> Any:
    import torch.distributed._functional_collectives

    return torch.ops._c10d_functional


def start(kind: str, attrs: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    """Start the collective with torch's functional op: the tensor it returns is in flight until
    :func:`wait`. The graph IR's reference semantics (``graph/reference.py``)."""
    f, group = _functional(), attrs["group"]
    if kind == "all_reduce":
        return f.all_reduce(x, attrs["reduce"], group)
    if kind == "all_gather":
        return f.all_gather_into_tensor(x, attrs["ranks"], group)
    if kind == "reduce_scatter":
        return f.reduce_scatter_tensor(x, attrs["reduce"], attrs["ranks"], group)
    if kind == "all_to_all":
        return f.all_to_all_single(x, list(attrs.get("out_splits", ())) or None,
                                   list(attrs.get("in_splits", ())) or None, group)
    if kind == "broadcast":
        return f.broadcast(x, attrs["src"], group)
    raise ValueError(f"unknown collective kind {kind!r}")


def wait(x: torch.Tensor) -> torch.Tensor:
    """The value of an in-flight collective, once it has arrived."""
    return _functional().wait_tensor(x)


ATTRS = ("kind", "group", "reduce", "ranks", "src", "out_splits", "in_splits")


def signature(node_attrs: dict[str, Any], shape: Sequence[Any], dtype: str) -> str:
    """One line naming a collective as every rank must issue it (kind, group, arguments, operand
    type): what ranks compare before their first call (``runtime/collectives.check_ranks_agree``).
    An all_to_all's split sizes, and so its operand's first dimension, may differ between ranks."""
    uneven = node_attrs["kind"] == "all_to_all"
    parts = [f"{k}={node_attrs[k]}" for k in ATTRS if k in node_attrs and not (uneven and k.endswith("splits"))]
    dims = ["*" if uneven and i == 0 else str(d) for i, d in enumerate(shape)]
    return f"{' '.join(parts)} {dtype}[{','.join(dims)}]"
