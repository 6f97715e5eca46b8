"""``sextant explain MODEL``: what the compiler did to a model, on one terminal screen or a few.

Ops captured, what each graph pass changed, the kernels the schedule formed (their fused ops,
source lines, launch shapes, ptxas's registers/spills/shared memory) and each launch's FLOPs and
minimum bytes with a roofline time on a datasheet GPU (:mod:`sextant.report`, when installed).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from sextant.cli.build import Build
from sextant.graph.ir import Graph
from sextant.schedule.dump import NOT_COMPUTED, launch_ops


def si(value: float, unit: str) -> str:
    """``33.8 kFLOP``, ``1.2 MB``: decimal prefixes, as GPU datasheets use."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def seconds(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _kib(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def op_delta(before: Graph, after: Graph) -> str:
    """What a pass changed, as op counts: ``-3 expand, -1 reshape, +1 full``."""
    a, b = before.op_counts(), after.op_counts()
    parts = [(b.get(op, 0) - a.get(op, 0), op) for op in sorted(set(a) | set(b))]
    parts = sorted((d, op) for d, op in parts if d)
    if not parts:
        return "rewrote nodes, same op counts"
    return ", ".join(f"{d:+d} {op}" for d, op in parts)


def _costs(build: Build, gpu: str) -> tuple[list[Any] | None, list[Any] | None, str]:
    """Per-launch costs and roofline estimates, or None with the reason."""
    try:
        from sextant.report.cost import program_costs
    except ImportError as e:
        return None, None, f"FLOPs and bytes not shown: the cost model is not available ({e})"
    costs = program_costs(build.compiled.stages["program"])
    try:
        from sextant.report.roofline import estimate
    except ImportError as e:
        return costs, None, f"roofline times not shown: {e}"
    return costs, [estimate(c, gpu) for c in costs], ""


def _counters(build: Build) -> tuple[dict[str, Any] | None, str]:
    """cuda-sim's counters per kernel (``codegen.counters``), from one counted run on the model's
    example inputs, or None with the reason."""
    if build.target != "cuda-sim":
        return None, "memory counters need --target cuda-sim (they come from running the GPU kernels on the CPU)"
    from sextant.runtime.counting import count_program

    c, m = build.compiled, build.model
    return count_program(c.stages["program"], c.flat_inputs(m.args, m.kwargs)), ""


def explain(build: Build, out: TextIO = sys.stdout, gpu: str = "H100", counters: bool = False) -> None:
    """Print the summary of ``build`` to ``out``; ``counters``: with cuda-sim's memory and
    tensor-core counters per kernel."""
    p = lambda *a: print(*a, file=out)
    c, m = build.compiled, build.model
    captured: Graph = c.stages["captured"]
    target = c.target + (f" {build.arch}" if build.is_gpu else "")
    p(f"sextant explain: {m.name} ({type(m.module).__name__}, {m.num_params:,} parameters) "
      f"for {target}, compiled in {build.seconds:.2f} s")
    for n in build.notes:
        p(f"note: {n}")
    ins = ", ".join(f"{leaf.name} {captured.inputs[leaf.input_index].type}" for leaf in captured.leaves
                    if leaf.input_index is not None)
    p(f"inputs: {ins}")

    counts = captured.op_counts()
    lines = {n.loc for n in captured.nodes if n.loc}
    p(f"\nops captured: {len(captured.nodes)} graph nodes from {len(lines)} source line(s)")
    ops = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    p("  " + ", ".join(f"{op} {k}" for op, k in ops))

    trace = build.trace
    changed = [r for r in trace if r.changed]
    pipeline = build.pipeline if isinstance(build.pipeline, str) else ",".join(build.pipeline)
    p(f"\npasses: pipeline {pipeline}, {len(trace)} pass runs, {len(changed)} changed the graph")
    before = captured
    for r in trace:
        if r.changed:
            p(f"  {r.name:<14} {r.nodes_before:>5} -> {r.nodes_after:<5} {op_delta(before, r.graph)}")
        before = r.graph
    p(f"  result: {len(c.graph.nodes)} nodes")

    program = c.stages.get("program")
    if program is None:
        p(f"\nkernels: none (target {c.target} runs the graph op by op)")
        return
    resources = c.stages["ptxas"].kernels if "ptxas" in c.stages else None
    costs, estimates, cost_note = _costs(build, gpu)
    counted, count_note = _counters(build) if counters else (None, "")
    externs = sum(la.extern is not None for la in program.launches)
    calls = f" and {externs} extern call(s) on the host" if externs else ""
    p(f"\nkernels: {len(program.launches) - externs} launches of {len(program.kernels)} unique kernels{calls}, "
      f"planned peak memory {_kib(program.peak_bytes)}")
    for i, launch in enumerate(program.launches):
        g = program.groups[launch.group]
        if launch.extern is not None:  # the op itself, or a collective's start or wait, between kernels
            kind = g.kind if g.kind in ("collective", "wait") else "extern"
            p(f"  #{i:<2} {launch.kernel:<16} {kind:<11} host call  [{launch.extern.fn}]")
            p(f"      from:  {launch.extern.loc or '?'}")
            continue
        k = program.kernels[launch.kernel]
        if build.is_gpu:
            shape = f"grid {'x'.join(map(str, k.grid))}  block {'x'.join(map(str, k.block))}"
        else:  # CPU kernels: each block is one task on a core, its threads a loop
            shape = f"{launch.blocks} blocks x {k.threads_per_block} threads"
        res = ""
        if resources is not None and launch.kernel in resources:
            r = resources[launch.kernel]
            spill = r.spill_stores + r.spill_loads
            from sextant.kernel.shared_memory import block_shared_bytes

            res = f"  {r.registers} regs  spills {spill} B  smem {_kib(block_shared_bytes(k, r.shared_bytes))}"
            if r.stack_frame:
                res += f"  stack {r.stack_frame} B"
        mapping = k.meta.get("mapping")
        if mapping and k.meta.get("tile_source") == "tuned":  # a measured tile (tools/tune)
            mapping += f"; tile {k.meta['tile_name']} (measured)"
        p(f"  #{i:<2} {launch.kernel:<16} {g.kind:<11} {shape}{res}" + (f"  [{mapping}]" if mapping else ""))
        computed = [n for n in program.computed_nodes(launch) if n.op not in NOT_COMPUTED]
        p(f"      fused: {launch_ops(program, launch)}")
        locs = sorted({n.loc for n in computed if n.loc})
        if locs:
            p(f"      from:  {', '.join(locs[:4])}{' ...' if len(locs) > 4 else ''}")
        if costs is not None:
            cost = costs[i]
            line = (f"      cost:  {si(cost.flops, 'FLOP')}, {si(cost.bytes, 'B')} min traffic, "
                    f"{cost.intensity:.2f} FLOP/B")
            if estimates is not None:
                e = estimates[i]
                line += f"; {e.gpu.name.split()[0]} roofline {seconds(e.time_s)} ({e.bound}-bound)"
            p(line)
        if counted is not None and launch.kernel in counted:
            p(f"      cuda-sim: {counted[launch.kernel].summary()}")
    if counted is not None:
        p("  (cuda-sim counters: block 0 of each launch, the first 16 executions of each access, summed over the "
          "kernel's launches; MMA counts every block)")
    if count_note:
        p(f"  ({count_note})")
    if resources is None:
        why = "use --target cuda-sim or cuda" if not build.is_gpu else "ptxas was not available"
        p(f"  (registers and spills come from ptxas: {why})")
    if costs is not None:
        flops = sum(x.flops for x in costs)
        nbytes = sum(x.bytes for x in costs)
        total = f"\ntotal: {si(flops, 'FLOP')}, {si(nbytes, 'B')} minimum traffic"
        if estimates is not None:
            t = sum(e.time_s for e in estimates)
            launch_s = sum(e.overhead_s for e in estimates)
            total += (f"; {estimates[0].gpu.name} roofline estimate {seconds(t)} "
                      f"({seconds(launch_s)} of it launch overhead)")
        p(total)
    if cost_note:
        p(f"({cost_note})")
    if program.rewrites:
        p("\nrewrites:")
        for n in program.rewrites:
            p(f"  - {n}")
    if program.notes:
        p("\nfusions refused:")
        for n in program.notes:
            p(f"  - {n}")
