"""Graph IR: an SSA dataflow graph of tensor ops with static shapes and dtypes.

A :class:`Node` is immutable and produces exactly one value (multi-result ATen ops become
several nodes). A :class:`Graph` is an ordered tuple of nodes in which every operand is
defined before use (like an MLIR block), plus the graph's inputs, outputs and the tensors
behind its ``param`` nodes. Passes never mutate: they build a new graph.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sextant.graph.dtypes import DType
from sextant.graph.ops import TensorType, infer_type

AttrValue = int | float | bool | str | DType | tuple[int, ...]


@dataclass(frozen=True, eq=False, slots=True)
class Node:
    """One SSA value: ``op(inputs) {attrs} : type``. Compared by identity."""

    op: str
    inputs: tuple[Node, ...]
    attrs: tuple[tuple[str, AttrValue], ...]
    type: TensorType
    loc: str | None = None  # user source location, "file.py:LINE"

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, AttrValue]:
        return dict(self.attrs)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def key(self) -> tuple:
        """Structural identity of this node given its operands (used by CSE)."""
        return (self.op, tuple(id(i) for i in self.inputs), _attr_key(self.attrs), self.type)

    def __repr__(self) -> str:
        return f"Node({self.op}, {self.type}, {dict(self.attrs)})"


def _attr_key(v: object) -> object:
    """A hashable key that tells apart what Python's ``==`` equates: 0.0 vs -0.0, 1 vs 1.0 vs True.

    Floats are keyed by their bits, so NaN matches NaN (full(nan) nodes can merge).
    """
    if isinstance(v, float):
        return ("float", struct.pack("<d", v))
    if isinstance(v, tuple):
        return tuple(_attr_key(x) for x in v)
    return (type(v).__name__, v)


def freeze_attrs(attrs: Mapping[str, Any]) -> tuple[tuple[str, AttrValue], ...]:
    """Normalise attributes to a sorted, hashable tuple (lists become tuples)."""
    out = []
    for k, v in sorted(attrs.items()):
        if isinstance(v, list):
            v = tuple(v)
        out.append((k, v))
    return tuple(out)


def make_node(op: str, inputs: Iterable[Node] = (), attrs: Mapping[str, Any] | None = None,
              loc: str | None = None) -> Node:
    """Build a node, inferring (and thereby checking) its type."""
    inputs = tuple(inputs)
    fattrs = freeze_attrs(attrs or {})
    t = infer_type(op, [i.type for i in inputs], dict(fattrs))
    return Node(op, inputs, fattrs, t, loc)


@dataclass(frozen=True)
class InputLeaf:
    """One flat leaf of the module's (args, kwargs) pytree: a tensor input, or a value torch.export
    specialised the graph for (an int, a bool, None) that calls must repeat."""

    name: str
    input_index: int | None
    value: Any = None


@dataclass(frozen=True)
class Mutation:
    """A tensor the module writes in ``forward()`` (a KV cache, a running statistic, an argument
    updated in place): graph output ``output`` holds its new value, which the runtime stores into
    the tensor behind graph input ``input`` after each call — a module buffer (or a parameter an
    optimizer step updates) named ``target``
    (``kind="buffer"``: the compiled module passes the live buffer as that input) or the caller's
    argument ``target`` (``kind="input"``). When the schedule writes the new value into the input's
    own storage (``graph/passes/in_place_updates.py``) the store is a no-op."""

    output: int
    input: int
    target: str
    kind: str  # "buffer" | "input"


@dataclass(frozen=True)
class Graph:
    """A whole program in graph IR.

    ``in_spec``/``out_spec`` are torch pytree specs that rebuild the module's argument and
    result structure from the flat ``inputs``/``outputs``. ``mutations`` name the outputs that are
    new values of tensors the module updates (after the user's outputs, which ``out_spec`` covers);
    a mutated buffer is an input past the user's (no leaf names it), and so is ``seed``.
    """

    name: str
    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    params: Mapping[str, torch.Tensor] = field(default_factory=dict)
    in_spec: Any = None
    out_spec: Any = None
    leaves: tuple[InputLeaf, ...] = ()
    mutations: tuple[Mutation, ...] = ()
    # returned values that are not tensors, as (position among the returned values, value): an int
    # torch.export computed from static sizes (``out_spec`` counts them; ``outputs`` does not)
    constant_outputs: tuple[tuple[int, int | float | bool | None], ...] = ()
    # the input (its index, the last one) that each call fills with a fresh seed drawn from
    # torch's generator, for the graph's ``random`` ops (graph/philox.py); None when it has none
    seed: int | None = None

    @property
    def user_outputs(self) -> tuple[Node, ...]:
        """The outputs the module returns (the rest are the new values of mutated tensors)."""
        return self.outputs[:len(self.outputs) - len(self.mutations)]

    def __str__(self) -> str:
        from sextant.graph.printer import print_graph

        return print_graph(self)

    def with_nodes(self, nodes: Iterable[Node], outputs: Iterable[Node],
                   params: Mapping[str, torch.Tensor] | None = None) -> Graph:
        """A copy with new nodes/outputs; inputs are taken from ``nodes``' input ops."""
        nodes = tuple(nodes)
        by_index = sorted((n for n in nodes if n.op == "input"), key=lambda n: n.attr("index"))
        return replace(self, nodes=nodes, inputs=tuple(by_index), outputs=tuple(outputs),
                       params=self.params if params is None else params)

    def users(self) -> dict[Node, list[Node]]:
        out: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n)
        return out

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts


def topo_sort(outputs: Iterable[Node], extra: Iterable[Node] = ()) -> list[Node]:
    """Nodes reachable from ``outputs`` (plus ``extra``), operands first; iterative DFS."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in list(extra) + list(outputs):
        if id(root) in seen:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        seen.add(id(root))
        while stack:
            node, i = stack.pop()
            if i < len(node.inputs):
                stack.append((node, i + 1))
                child = node.inputs[i]
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append((child, 0))
            else:
                order.append(node)
    return order
