"""Dead-code elimination: drop nodes no output depends on, and the params they held.

Inputs always stay, even unused: they are the graph's calling signature.
"""

from __future__ import annotations

from sextant.graph.ir import Graph, Node


def live_nodes(graph: Graph) -> set[Node]:
    """Nodes some output depends on (iterative, so long chains do not hit the recursion limit)."""
    live: set[Node] = set()
    stack = list(graph.outputs)
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.inputs)
    return live


def dce(graph: Graph) -> Graph:
    """Remove dead nodes and unreferenced params; returns ``graph`` itself if nothing is dead."""
    live = live_nodes(graph)
    nodes = [n for n in graph.nodes if n in live or n.op == "input"]
    used = {n.attr("name") for n in nodes if n.op == "param"}
    if len(nodes) == len(graph.nodes) and used >= set(graph.params):
        return graph
    params = {k: v for k, v in graph.params.items() if k in used}
    return graph.with_nodes(nodes, graph.outputs, params)
