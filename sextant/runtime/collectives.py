"""Running a program's collectives (``schedule.program.CollectiveCall``) through torch.distributed,
and checking, before a program's first call, that every rank compiled the same collectives.

A start launch issues the transfer asynchronously (``async_op=True``: gloo's or NCCL's own
threads and streams move the bytes) straight into the result buffer the schedule planned; the
runner keeps the returned ``Work`` until the wait launch, which waits on it — on a GPU that
makes the current stream wait, so later kernels queue behind the transfer without blocking the
host. Kernels the schedule placed between the two run meanwhile (``schedule/overlap.py``).
"""

from __future__ import annotations

import hashlib
import itertools
from datetime import timedelta
from typing import Any

import torch

from sextant.errors import CollectiveError
from sextant.schedule.program import CollectiveCall

CHECK_TIMEOUT_S = 600.0  # how long a rank waits for the others to compile the same program


def _group(name: str) -> Any:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_initialized():
        raise CollectiveError(f"the program calls collectives on process group {name!r}, but torch.distributed "
                              "is not initialised in this process (call torch.distributed.init_process_group)")
    try:
        return _resolve_process_group(name)
    except Exception as e:
        raise CollectiveError(f"no process group named {name!r} in this process: {e}") from e


def _reduce_op(name: str) -> Any:
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[name]


def start(kind: str, attrs: dict[str, Any], x: torch.Tensor, out: torch.Tensor) -> Any:
    """Issue the collective from ``x`` into ``out``; returns the ``Work`` to wait on."""
    import torch.distributed as dist

    group = _group(attrs["group"])
    if kind == "all_reduce":
        out.copy_(x)
        return dist.all_reduce(out, op=_reduce_op(attrs["reduce"]), group=group, async_op=True)
    if kind == "all_gather":
        return dist.all_gather_single(out, x.contiguous(), group=group, async_op=True)
    if kind == "reduce_scatter":
        return dist.reduce_scatter_single(out, x.contiguous(), op=_reduce_op(attrs["reduce"]), group=group,
                                          async_op=True)
    if kind == "all_to_all":
        return dist.all_to_all_single(out, x.contiguous(), list(attrs.get("out_splits", ())) or None,
                                      list(attrs.get("in_splits", ())) or None, group=group, async_op=True)
    if kind == "broadcast":
        out.copy_(x)
        return dist.broadcast(out, group=group, group_src=attrs["src"], async_op=True)
    raise CollectiveError(f"unknown collective kind {kind!r}")


def run_collective(call: Any, args: tuple[int, ...], tensors: dict[int, torch.Tensor],
                   pending: dict[int, Any]) -> None:
    """One launch of a collective: its start (the work kept in ``pending`` under the result buffer)
    or its wait. ``pending`` lives for one call of the program."""
    x, out = args
    where = f"{call.kind} (collective from {call.loc or 'an unknown line'})"
    try:
        if call.stage == "start":
            pending[out] = start(call.kind, dict(call.attrs), tensors[x], tensors[out])
            return
        work = pending.pop(out, None)
        if work is None:
            raise CollectiveError(f"{where}: waited for before it was started (a schedule bug)")
        work.wait()
    except CollectiveError:
        raise
    except Exception as e:  # gloo's / NCCL's own error, with the call it came from
        raise CollectiveError(f"{where} failed: {type(e).__name__}: {e}") from e


# -- every rank compiled the same program -------------------------------------------------------------
_checks = itertools.count()


def collective_plan(program: Any, graph: Any) -> list[tuple[str, str]]:
    """The collectives in issue order, as (group, one line naming it: kind, arguments, operand
    type): the program's launch order, or the graph's node order where there is no program (the
    reference target runs the graph as it stands)."""
    from sextant.graph.collectives import signature

    if program is None:
        starts = [(dict(n.attrs), n.inputs[0].type) for n in graph.nodes if n.op == "collective"]
    else:
        starts = [({"kind": la.extern.kind, **dict(la.extern.attrs)}, program.buffers[la.args[0]].node.type)
                  for la in program.launches if isinstance(la.extern, CollectiveCall) and la.extern.stage == "start"]
    return [(a["group"], signature(a, t.shape, t.dtype.value)) for a, t in starts]


def check_ranks_agree(program: Any, graph: Any, timeout_s: float | None = None) -> None:
    """Compare this program's collectives with every other rank's before the first call, through the
    default group's store — never through a collective, which would hang on a mismatch: a rank whose
    program issues other collectives, or none by the deadline, is an error naming the difference.

    Each rank numbers the programs with collectives it compiles; the k-th must match on all ranks
    (a rank that compiles one more program than the others is reported when the check times out)."""
    import torch.distributed as dist

    issued = collective_plan(program, graph)
    if not issued or not dist.is_initialized():
        return
    groups = sorted({g for g, _ in issued})
    plan = [line for _, line in issued]
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    members = sorted({r for g in groups for r in dist.get_process_group_ranks(_group(g))})
    text = "\n".join(plan)
    digest = hashlib.sha256(text.encode()).hexdigest()
    k = next(_checks)
    key = f"sextant/collectives/{k}"
    store.set(f"{key}/{rank}", f"{digest}\n{text}")
    timeout = timedelta(seconds=CHECK_TIMEOUT_S if timeout_s is None else timeout_s)
    others = [r for r in members if r != rank]
    try:
        store.wait([f"{key}/{r}" for r in others], timeout)
    except Exception as e:
        missing = [r for r in others if not store.check([f"{key}/{r}"])]
        raise CollectiveError(
            f"rank {rank}: compiled program #{k} with collectives ({len(plan)}: {plan[0]} ...), but rank(s) "
            f"{missing} compiled no program #{k} within {timeout.total_seconds():.0f} s ({type(e).__name__}). "
            "Every rank must compile the same graphs in the same order; a graph that differs between ranks "
            "(rank-dependent Python control flow, different shapes) would make the collectives hang") from None
    for r in others:
        got = store.get(f"{key}/{r}").decode()
        their_digest, _, their_text = got.partition("\n")
        if their_digest != digest:
            mine, theirs = plan, their_text.split("\n")
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise CollectiveError(
                f"rank {rank} and rank {r} compiled program #{k} with different collectives: collective {first} is "
                f"{mine[first] if first < len(mine) else '(none)'!r} here and "
                f"{theirs[first] if first < len(theirs) else '(none)'!r} on rank {r} ({len(mine)} vs "
                f"{len(theirs)} collectives). Called, they would hang or mix up data; every rank must compile "
                "the same graph")
