"""Overlap communication with computation: start each collective as early as its operand allows and
wait for it as late as its first reader allows.

A transfer between ranks takes time during which the device (or the CPU) is free to run kernels
that do not need its result. The fusion order puts a ``collective`` right before its ``wait``
(both come from one ``_c10d_functional`` call and its ``wait_tensor``); this pass reorders the
launch groups — a topological order, like Inductor's ``reorder_compute_for_overlap`` and
``sink_waits`` — so that independent kernels run in between:

- a ``collective`` group is taken as soon as every group it reads is done;
- a ``wait`` group only when nothing else is ready;
- everything else keeps its relative order where dependencies allow.

The order is a function of the graph alone, so every rank that compiles the same graph issues its
collectives in the same order (which NCCL and gloo require; ``runtime/collectives`` checks it).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from sextant.schedule.partition import Group, group_dependencies

if TYPE_CHECKING:
    from sextant.schedule.program import Launch


def overlap_collectives(groups: list[Group]) -> list[Group]:
    """``groups`` reordered so that transfers overlap independent kernels (unchanged without any)."""
    if not any(g.kind == "collective" for g in groups):
        return groups
    deps = group_dependencies(groups)
    waiting = [len(d) for d in deps]
    readers: list[list[int]] = [[] for _ in groups]
    for gi, d in enumerate(deps):
        for j in d:
            readers[j].append(gi)
    rank = {"collective": 0, "wait": 2}
    ready = [(rank.get(g.kind, 1), gi) for gi, g in enumerate(groups) if waiting[gi] == 0]
    heapq.heapify(ready)
    out: list[Group] = []
    while ready:
        _, gi = heapq.heappop(ready)
        out.append(groups[gi])
        for r in readers[gi]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, (rank.get(groups[r].kind, 1), r))
    if len(out) != len(groups):
        raise AssertionError("launch groups depend on each other in a cycle")
    return out


def overlap_notes(launches: list[Launch]) -> list[str]:
    """One line per transfer: how many kernel launches run while it is in flight."""
    from sextant.schedule.program import CollectiveCall  # (program.py imports this module)

    notes = []
    started: dict[tuple[int, ...], int] = {}
    for li, la in enumerate(launches):
        call = la.extern
        if not isinstance(call, CollectiveCall):  # a kernel, or an extern op
            continue
        if call.stage == "start":
            started[la.args] = li
            continue
        kernels = sum(x.extern is None for x in launches[started[la.args] + 1:li])
        notes.append(f"{la.kernel.replace('wait', 'collective')} ({call.kind} at {call.loc or '?'}): in flight over "
                     f"{kernels} kernel launch{'' if kernels == 1 else 'es'}")
    return notes
