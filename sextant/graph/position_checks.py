"""Positions a call must check before it runs: the arguments a ``scatter`` takes its positions from.

A kernel cannot raise: a scatter's kernel drops a write whose position lies outside the tensor
(``schedule/scatter.py``) rather than corrupt memory. But a decode step at a position past the
cache is a bug the user should hear about, so where a scatter's positions are an argument —
directly, or through the wrap-around of negative positions the frontend adds
(``where(p < 0, p + n, p)``), casts and reshapes — the compiled module checks that argument's
values against the bound before running, and raises an ``InputError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sextant.graph.ir import Graph, Node


@dataclass(frozen=True)
class PositionCheck:
    input: int  # graph input index of the positions
    name: str  # the argument's name
    size: int  # the positions index a dim of this size
    negative: bool  # whether -size..-1 are allowed (counted from the end, as torch does)
    what: str  # the updated tensor, for the message


def _strip(n: Node) -> Node:
    while n.op in ("reshape", "cast") and n.inputs[0].dtype.is_int:
        n = n.inputs[0]
    return n


def _wrapped(n: Node) -> Node | None:
    """``p`` of ``where(p < 0, p + n, p)`` (the frontend's wrap of negative positions)."""
    if n.op != "where":
        return None
    cond, wrapped, p = n.inputs
    if cond.op == "lt" and _strip(cond.inputs[0]) is _strip(p) and wrapped.op == "add" and \
            _strip(wrapped.inputs[0]) is _strip(p):
        return _strip(p)
    return None


def position_checks(graph: Graph) -> list[PositionCheck]:
    """One check per scatter whose positions come straight from a graph input of static size."""
    checks = []
    for n in graph.nodes:
        if n.op != "scatter":
            continue
        size = n.shape[n.attr("axis")]
        if not isinstance(size, int):
            continue
        index = _strip(n.inputs[1])
        p, negative = (_wrapped(index), True) if index.op == "where" else (index, False)
        if p is None or p.op != "input":
            continue
        x = n.inputs[0]
        while x.op in ("copy", "scatter"):
            x = x.inputs[0]
        what = repr(x.attr("name")) if x.op in ("input", "param") else f"the value updated at {n.loc or '?'}"
        checks.append(PositionCheck(p.attr("index"), p.attr("name"), size, negative, what))
    return checks
