"""The readable schedule dump: kernels, the graph nodes fused into each, launches, memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sextant.graph.ir import Node
    from sextant.schedule.program import Launch, Program


# leaves and pure re-indexing: not work a kernel does (movement ops become index arithmetic)
NOT_COMPUTED = frozenset({"param", "input", "full", "iota", "reshape", "expand", "permute", "slice", "wait"})


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _dims(d: tuple[int, int, int]) -> str:
    return "x".join(str(v) for v in (d[:1] if d[1:] == (1, 1) else d[:2] if d[2] == 1 else d))


def update_summary(p: Program, launch: Launch) -> str:
    """What a scatter launch writes, and where: ``in place: 2 of 64 positions along dim 2 of input
    %k_cache (1.0 KiB of 32.0 KiB)``; an adding one also says how repeated positions are summed."""
    s = p.groups[launch.group].anchor
    x, index, src = s.inputs
    buf = p.buffers[launch.args[-1]]
    where = f"input %{buf.node.attr('name')}" if buf.kind == "input" else f"its {buf.kind} buffer"
    if x.op == "copy":
        where += " (a copy of the value it updates: see the notes)"
    axis = s.attr("axis")
    size = f"({_mib(src.type.nbytes)} of {_mib(s.type.nbytes)})"
    if s.attr("reduce") == "add":  # an adding scatter: how it sums slices that share a position
        how = p.kernels[launch.kernel].meta.get("accumulate", "")
        return (f"in place, adding: {index.shape[0]} slices into {s.shape[axis]} positions along dim {axis} of "
                f"{where} {size}; repeats summed {how}")
    return f"in place: {index.shape[0]} of {s.shape[axis]} positions along dim {axis} of {where} {size}"


def _downstream(nodes: list[Node], root: Node) -> list[Node]:
    """``root`` and the nodes of ``nodes`` (in graph order) that read it: a split-key combine's
    epilogue, listed without the attention its partials kernel computed."""
    seen = {id(root)}
    out = []
    for n in nodes:
        if n is root or any(id(i) in seen for i in n.inputs):
            seen.add(id(n))
            out.append(n)
    return out


def launch_ops(p: Program, launch: Launch) -> str:
    """The graph ops a launch computes, in graph order (``[matmul add ...]`` in the dump); a split-key
    combine lists ``combine`` and the epilogue, not the attention its partials kernel computed."""
    computed = [n for n in p.computed_nodes(launch) if n.op not in NOT_COMPUTED]
    g = p.groups[launch.group]
    if p.kernels[launch.kernel].meta.get("mapping") == "attention-split-key-combine" and g.attention is not None:
        return " ".join(["combine", *(n.op for n in _downstream(computed, g.attention.out))])
    return " ".join(n.op for n in computed)


def describe_program(p: Program) -> str:
    from sextant.schedule.overlap import overlap_notes
    from sextant.schedule.program import CollectiveCall

    hosts = sum(launch.extern is not None for launch in p.launches)
    transfers = sum(isinstance(launch.extern, CollectiveCall) and launch.extern.stage == "start"
                    for launch in p.launches)
    externs = hosts - 2 * transfers
    calls = f" and {externs} extern call{'s' if externs > 1 else ''}" if externs else ""
    calls += f", {transfers} collective{'s' if transfers > 1 else ''} (each a start and a wait)" if transfers else ""
    lines = [f"schedule @{p.graph.name} for {p.target.name}: {len(p.launches) - hosts} launches, "
             f"{len(p.kernels)} unique kernels{calls}, planned peak {_mib(p.peak_bytes)} "
             f"(arena {_mib(p.arena_bytes)})"]
    if not p.groups:  # loaded from an artifact, which keeps kernels and launches, not the fusion groups
        lines.append("  (loaded from an artifact: which graph ops each kernel computes is not kept)")
    for li, launch in enumerate(p.launches):
        g = p.groups[launch.group] if p.groups else None
        kind = g.kind if g is not None else launch.kernel.rsplit("_", 1)[0]  # kernels are named <kind>_<n>
        if (call := launch.extern) is not None:  # an op called as itself, on the host, between kernels
            args = ", ".join(f"{p.buffers[b].kind}:{p.buffers[b].node.type}" for b in launch.args)
            if isinstance(call, CollectiveCall):  # torch.distributed's transfer, started or waited for
                what = " ".join([call.kind, *(f"{k}={v}" for k, v in call.attrs)]) if call.stage == "start" \
                    else f"wait for {launch.kernel.replace('wait', 'collective')}"
                lines.append(f"  #{li:<3} {launch.kernel:<16} {kind:<11} {'host call':<12} [{what}]")
            else:
                lines.append(f"  #{li:<3} {launch.kernel:<16} {'extern':<11} {'host call':<12} [{call.fn}]")
            lines.append(f"        buffers ({args})")
            lines.append(f"        from {call.loc or '?'}")
            continue
        computed = [n for n in p.computed_nodes(launch) if n.op not in NOT_COMPUTED] if g is not None else []
        k = p.kernels[launch.kernel]
        ops = launch_ops(p, launch) if g is not None else "?"
        locs = sorted({n.loc for n in computed if n.loc})
        args = ", ".join(f"{p.buffers[b].kind}:{p.buffers[b].node.type}" for b in launch.args)
        shape = f"grid={_dims(k.grid)} block={_dims(k.block)}" if p.target.is_gpu else f"blocks={launch.blocks}"
        lines.append(f"  #{li:<3} {launch.kernel:<16} {kind:<11} {shape:<12} [{ops}]")
        if (mapping := k.meta.get("mapping")) is not None or launch.kernel in p.resources:
            extra = [f"mapping {mapping}"] if mapping else []
            if k.meta.get("tile_source") == "tuned":  # a measured choice (schedule/tuning.py, tools/tune)
                extra.append(f"tile {k.meta['tile_name']} (measured)")
            if (r := p.resources.get(launch.kernel)) is not None:
                from sextant.kernel.shared_memory import block_shared_bytes

                extra.append(f"ptxas: {r.registers} registers, {block_shared_bytes(k, r.shared_bytes)} B shared, "
                             f"spills {r.spill_stores} B stored / {r.spill_loads} B loaded")
            lines.append(f"        {'; '.join(extra)}")
        if (split := k.meta.get("split_key")) is not None and "combine" not in k.meta.get("mapping", ""):
            lines.append(f"        split-key: {split}; partials (O, m, l) to scratch, combined by the next launch")
        if kind == "scatter" and g is not None:
            lines.append(f"        {update_summary(p, launch)}")
        lines.append(f"        buffers ({args})")
        if locs:
            lines.append(f"        from {', '.join(locs[:4])}{' ...' if len(locs) > 4 else ''}")
    if transfers:
        lines.append("  collectives in flight (schedule/overlap.py):")
        lines += [f"    - {n}" for n in overlap_notes(p.launches)]
    if p.rewrites:
        lines.append("  rewrites:")
        lines += [f"    - {n}" for n in p.rewrites]
    if p.notes:
        lines.append("  fusions refused:")
        lines += [f"    - {n}" for n in p.notes]
    return "\n".join(lines)
