"""Shared machinery for graph passes: rebuilding a graph node by node, and declarative rewrites.

Graphs are immutable, so every pass is a *rebuild*: walk the nodes in order, recreate each
one on its (possibly replaced) operands, and optionally substitute a replacement. Pattern
rules in the style of tinygrad's ``PatternMatcher`` keep simplifications one line each:

    (P("mul", P.var("x"), P.full(1)), lambda x, **_: x)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sextant.graph.ir import Graph, Node
from sextant.graph.symbolic import SymbolicShapeError

Rewrite = Callable[..., Node | None]


def _rebuild(graph: Graph, fn: Callable[[Node, Node], Node | None],
             params: Mapping[str, torch.Tensor] | None = None) -> Graph:
    """Core of :func:`rebuild`; ``fn(original, remapped)`` so callers can key on either."""
    done: dict[Node, Node] = {}  # original or emitted node -> its node in the new graph
    out: list[Node] = []

    def recreate(n: Node) -> Node:
        ins = tuple(done[i] for i in n.inputs)
        if all(a is b for a, b in zip(ins, n.inputs)):
            return n
        return Node(n.op, ins, n.attrs, n.type, n.loc)

    def emit(n: Node) -> Node:
        out.append(n)
        done[n] = n
        return n

    def resolve(root: Node) -> Node:
        """Emit ``root`` and every node under it that is not emitted yet, operands first."""
        stack = [root]
        while stack:
            n = stack[-1]
            if n in done:
                stack.pop()
                continue
            pending = [i for i in n.inputs if i not in done]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            new = recreate(n)
            done[n] = done[new] if new in done else emit(new)
        return done[root]

    for node in graph.nodes:
        if node in done:  # already pulled in by an earlier replacement
            continue
        new = recreate(node)
        rep = None if node.op == "input" else fn(node, new)
        if rep is None or rep is new:
            done[node] = emit(new)
            continue
        if rep.type != node.type:
            raise TypeError(f"replacement {rep!r} does not have the type of {node!r}")
        done[node] = resolve(rep)

    outputs = tuple(done[o] for o in graph.outputs)
    unchanged = (len(out) == len(graph.nodes) and all(a is b for a, b in zip(out, graph.nodes))
                 and all(a is b for a, b in zip(outputs, graph.outputs)))
    if unchanged and params is None:
        return graph
    return graph.with_nodes(out, outputs, params)


def rebuild(graph: Graph, fn: Callable[[Node], Node | None],
            params: Mapping[str, torch.Tensor] | None = None) -> Graph:
    """Rebuild ``graph``, letting ``fn(node)`` replace nodes; returns ``graph`` itself if nothing changed.

    ``fn`` sees each non-input node already rewired onto the replacements of its operands and
    returns ``None`` (keep) or a node of the same type, possibly new and built on existing
    nodes; new nodes are inserted before their first user. Untouched nodes keep their
    identity. Replaced nodes' old operands stay in the graph: :mod:`.dce` removes them.
    """
    return _rebuild(graph, lambda _old, new: fn(new), params)


def replace_nodes(graph: Graph, mapping: Mapping[Node, Node],
                  params: Mapping[str, torch.Tensor] | None = None) -> Graph:
    """Rebuild ``graph`` with the nodes in ``mapping`` (keyed by original node) replaced."""
    return _rebuild(graph, lambda old, _new: mapping.get(old), params)


class P:
    """A node pattern: op name(s), operand patterns, a binding name and a predicate.

    ``P("add", P.var("x"), P.full(0))`` matches ``add(x, full 0)`` and binds ``x``. Omitted
    operands match any operands; given ones must match all operands, in order. A name bound
    twice must bind the same node, so ``P("where", P.var("c"), x, x)`` needs equal branches.
    """

    def __init__(self, op: str | tuple[str, ...] | None = None, *src: P, name: str | None = None,
                 pred: Callable[[Node], bool] | None = None) -> None:
        self.ops = (op,) if isinstance(op, str) else op
        self.src: tuple[P, ...] | None = src or None
        self.name = name
        self.pred = pred

    @staticmethod
    def var(name: str, pred: Callable[[Node], bool] | None = None) -> P:
        """Any node, bound to ``name``."""
        return P(None, name=name, pred=pred)

    @staticmethod
    def full(value: int | float | bool, name: str | None = None) -> P:
        """A ``full`` node whose value is exactly ``value`` (so 1.0000001 is not 1; -0.0 is 0)."""
        return P("full", name=name, pred=lambda n: n.attr("value") == value)

    def match(self, node: Node, bindings: dict[str, Node]) -> bool:
        if self.ops is not None and node.op not in self.ops:
            return False
        if self.src is not None and (len(self.src) != len(node.inputs)
                                     or not all(p.match(i, bindings) for p, i in zip(self.src, node.inputs))):
            return False
        if self.pred is not None and not self.pred(node):
            return False
        return self.name is None or bindings.setdefault(self.name, node) is node

    def __repr__(self) -> str:
        args = [repr(self.ops)] + [repr(s) for s in self.src or ()]
        return f"P({', '.join(args)}{f', name={self.name!r}' if self.name else ''})"


class PatternRewriter:
    """Applies ``(pattern, rewrite)`` rules to a graph until none fires.

    ``rewrite(**bindings)`` returns a replacement node or ``None`` to decline. A replacement
    whose type differs from the matched node is discarded, so a rule can never change a
    graph's types. Rules are tried in order; the first that returns a node wins. A rule whose
    condition depends on the value of a symbolic size (``SymbolicShapeError``) declines.
    """

    def __init__(self, rules: Sequence[tuple[P, Rewrite]]) -> None:
        self.rules = list(rules)
        self._by_op: dict[str | None, list[tuple[P, Rewrite]]] = {}
        for pat, fn in self.rules:
            for op in pat.ops or (None,):
                self._by_op.setdefault(op, []).append((pat, fn))

    def rewrite(self, node: Node) -> Node | None:
        """One rewrite of ``node`` by the first rule that applies, or ``None``."""
        for pat, fn in self._by_op.get(node.op, []) + self._by_op.get(None, []):
            bindings: dict[str, Any] = {}
            try:
                if pat.match(node, bindings):
                    rep = fn(**bindings)
                    if rep is not None and rep is not node and rep.type == node.type:
                        return rep
            except SymbolicShapeError:  # the rule's condition depends on a symbolic size's value: it declines
                continue
        return None

    def __call__(self, graph: Graph, max_rounds: int = 8, max_local: int = 64) -> Graph:
        def fn(node: Node) -> Node | None:
            cur = node
            for _ in range(max_local):  # operands are already final, so rewrite this node to a fixed point
                nxt = self.rewrite(cur)
                if nxt is None:
                    break
                cur = nxt
            return None if cur is node else cur

        for _ in range(max_rounds):
            new = rebuild(graph, fn)
            if new is graph:
                break
            graph = new
        return graph
