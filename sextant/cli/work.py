"""What a compile produced, in counts, for ``--verbose``: the stage times say *where* a slow
compile spent its time, these lines say *why* — a graph of hundreds of thousands of nodes, a
kernel of a million statements (every pass over kernels is linear in their size, so their size
is what to look at)."""

from __future__ import annotations

from typing import Any

from sextant.kernel.exprs import statement_count


def work_lines(stages: dict[str, Any]) -> list[str]:
    """Summary lines for a compiled module's ``stages`` (empty where a stage is missing)."""
    lines = []
    captured, program = stages.get("captured"), stages.get("program")
    if captured is not None and program is not None:
        lines.append(f"  graph: {len(captured.nodes):,} nodes captured, {len(program.graph.nodes):,} scheduled")
    if program is not None:
        sizes = {name: statement_count(k.body) for name, k in program.kernels.items()}
        work = program.work.counts
        line = (f"  kernels: {work.get('kernels: generated', len(program.launches)):,} generated, "
                f"{len(sizes):,} unique, {sum(sizes.values()):,} statements")
        if sizes:
            largest = max(sizes, key=lambda n: sizes[n])
            line += f" (largest: {largest}, {sizes[largest]:,})"
        lines.append(line)
        fusion = sum(v for k, v in work.items() if k.startswith("fusion: "))
        if fusion:
            lines.append(f"  fusion: {fusion:,} node visits")
    return lines
