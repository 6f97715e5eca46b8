"""Common-subexpression elimination: one node per distinct (op, operands, attrs, type).

Operands are compared by identity, which is sound because the rebuild visits operands first
and has already merged them. ``param``/``input`` nodes carry their name in their attrs, so
they merge only when they name the same tensor; equal contents under different names stay.
"""

from __future__ import annotations

import struct

from sextant.graph.ir import Graph, Node
from sextant.graph.passes.rewrite import rebuild


def _attr_key(v: object) -> object:
    # Python equates 0.0 with -0.0 (and 1 with 1.0 and True), but full(0.0) and full(-0.0) differ,
    # and NaN never equals itself: key floats by their bits and every scalar by its type.
    if isinstance(v, float):
        return ("float", struct.pack("<d", v))
    if isinstance(v, tuple):
        return tuple(_attr_key(x) for x in v)
    return (type(v).__name__, v)


def cse_key(node: Node) -> tuple:
    """Structural identity of ``node`` given its operands' identities."""
    return (node.op, tuple(id(i) for i in node.inputs), tuple((k, _attr_key(v)) for k, v in node.attrs), node.type)


def cse(graph: Graph) -> Graph:
    """Replace each node by the first earlier node with the same key (inputs are never merged)."""
    seen: dict[tuple, Node] = {}

    def fn(node: Node) -> Node | None:
        first = seen.setdefault(cse_key(node), node)
        return None if first is node else first

    return rebuild(graph, fn)
