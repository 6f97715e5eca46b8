"""Common-subexpression elimination: one node per distinct (op, operands, attrs, type).

Operands are compared by identity, which is sound because the rebuild visits operands first
and has already merged them. ``param``/``input`` nodes carry their name in their attrs, so
they merge only when they name the same tensor; equal contents under different names stay.
"""

from __future__ import annotations

from sextant.graph.ir import Graph, Node
from sextant.graph.passes.rewrite import rebuild


def cse_key(node: Node) -> tuple:
    """Structural identity of ``node`` given its operands' identities (floats compared by bits)."""
    return node.key()


def cse(graph: Graph) -> Graph:
    """Replace each node by the first earlier node with the same key (inputs are never merged)."""
    seen: dict[tuple, Node] = {}

    def fn(node: Node) -> Node | None:
        first = seen.setdefault(cse_key(node), node)
        return None if first is node else first

    return rebuild(graph, fn)
