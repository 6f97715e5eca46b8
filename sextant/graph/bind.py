"""Sizes for a graph's symbols: read them off a call's inputs, and specialise the graph to them.

A graph captured with symbolic sizes (``sextant/graph/symbolic.py``) is compiled once per
binding of its symbols below the graph IR today: :func:`solve` finds each symbol's value from the
input tensors' shapes (checking every input dimension and every declared range, with errors that
name the input, the dimension and the range), and :func:`bind` substitutes the values into every
node's type and attributes, giving a static graph the rest of the pipeline compiles as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sextant.errors import InputError
from sextant.graph.ir import Graph, Node, make_node
from sextant.graph.ops import IRTypeError
from sextant.graph.symbolic import Bounds, SymbolicShapeError, SymDim, describe, graph_symbols, substitute


def is_symbolic_graph(graph: Graph) -> bool:
    return bool(graph_symbols(graph))


def solve(graph: Graph, shapes: Sequence[Sequence[int]], symbols: Bounds | None = None) -> dict[str, int]:
    """The value of every symbol of ``graph`` given its inputs' concrete ``shapes``; ``symbols``: the
    graph's symbols when the caller has them (``graph_symbols`` walks the whole graph)."""
    names = [n.attr("name") for n in graph.inputs]
    if len(shapes) != len(graph.inputs):
        raise InputError(f"graph @{graph.name} takes {len(graph.inputs)} inputs, got {len(shapes)}")
    values: dict[str, int] = {}
    where: dict[str, str] = {}
    for name, node, shape in zip(names, graph.inputs, shapes):
        if len(shape) != len(node.shape):
            raise InputError(f"input {name!r} has {len(shape)} dimensions, the model was captured with "
                             f"{len(node.shape)} ({node.type})")
        for axis, (dim, size) in enumerate(zip(node.shape, shape)):
            if isinstance(dim, SymDim) and dim.expr.is_Symbol:
                sym = dim.names[0]
                if sym in values and values[sym] != size:
                    raise InputError(f"input {name!r} dimension {axis} is {size} but {where[sym]} is "
                                     f"{values[sym]}: both are the size {sym}")
                values.setdefault(sym, int(size))
                where.setdefault(sym, f"input {name!r} dimension {axis}")
    _solve_derived(names, graph.inputs, shapes, values, where)
    for sym, lo, hi in graph_symbols(graph) if symbols is None else symbols:
        if sym not in values:
            raise InputError(f"the size {sym} is no input's dimension; it cannot be read off the call")
        if not lo <= values[sym] <= hi:
            raise InputError(f"{where[sym]} is {values[sym]}, outside the range the model was compiled for "
                             f"({describe(((sym, lo, hi),))})")
    for name, node, shape in zip(names, graph.inputs, shapes):
        want = substitute(node.shape, values)
        if tuple(shape) != want:
            raise InputError(f"input {name!r} has shape {list(shape)}; with {_show(values)} the model needs "
                             f"{list(want)} ({node.type})")
    return values


def _solve_derived(names: list[str], inputs: Sequence[Node], shapes: Sequence[Sequence[int]],
                   values: dict[str, int], where: dict[str, str]) -> None:
    """Symbols that only appear in derived input sizes (torch.export's ``20*_seq``, ``s + 1``): each
    dimension linear in one still-unknown symbol gives its value (when it divides exactly)."""
    changed = True
    while changed:
        changed = False
        for name, node, shape in zip(names, inputs, shapes):
            for axis, (dim, size) in enumerate(zip(node.shape, shape)):
                if not isinstance(dim, SymDim):
                    continue
                unknown = [n for n in dim.names if n not in values]
                if len(unknown) != 1:
                    continue
                sym = next(s for s in dim.expr.free_symbols if s.name == unknown[0])
                rest = dim.expr.subs({s: values[s.name] for s in dim.expr.free_symbols if s.name in values})
                poly = rest.as_poly(sym)
                if poly is None or poly.degree() != 1:
                    continue
                a, c = (int(x) for x in poly.all_coeffs())
                if a == 0:
                    continue
                if (int(size) - c) % a:
                    raise InputError(f"input {name!r} dimension {axis} is {size}, which is not {dim} for any "
                                     f"whole {unknown[0]}")
                values[unknown[0]] = (int(size) - c) // a
                where[unknown[0]] = f"input {name!r} dimension {axis} ({dim} = {size})"
                changed = True


def bind(graph: Graph, values: Mapping[str, int]) -> Graph:
    """``graph`` with every symbol replaced by its value in ``values``: a static graph."""
    env: dict[int, Node] = {}
    nodes = []
    for node in graph.nodes:
        attrs = {k: substitute(v, values) for k, v in node.attrs}
        try:
            new = make_node(node.op, [env[id(i)] for i in node.inputs], attrs, node.loc)
        except (IRTypeError, SymbolicShapeError) as e:
            raise SymbolicShapeError(f"{node.op} at {node.loc or '<unknown>'} is invalid with {_show(values)}: "
                                     f"{e}") from None
        want = substitute(node.type.shape, values)
        if new.shape != want:
            raise SymbolicShapeError(f"{node.op} at {node.loc or '<unknown>'}: with {_show(values)} its operands "
                                     f"give {new.type}, its symbolic type says {list(want)}")
        env[id(node)] = new
        nodes.append(new)
    return graph.with_nodes(nodes, [env[id(o)] for o in graph.outputs])


def _show(values: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(values.items()))
