"""Textual form of the graph IR (MLIR-like), stable enough to diff and to golden-test.

    graph @name(%x: f32[4,16]) {
      %0 = param() {name="fc1.weight"} : f32[32,16]
      %1 = permute(%0) {perm=[1,0]} : f32[16,32]
      %2 = matmul(%x, %1) : f32[4,32]  loc("model.py:12")
      return (%2)
    }

A module that updates a tensor in ``forward()`` (a KV cache buffer) returns its new value after
its own outputs, and says where it goes: ``update %k_cache <- %9 {buffer="kv.k_cache"}``.

A graph with symbolic sizes (``sextant/graph/symbolic.py``) declares their ranges in its header:
``graph @lm(%ids: i64[batch,seq]) where batch in [1, 8], seq in [1, 512] {``.

Attributes that the result type already states (``shape``/``dtype`` of sources and casts,
the ``name``/``index`` of inputs) are not printed; :mod:`sextant.graph.parser` restores them.
"""

from __future__ import annotations

import json
import math
import re

from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node
from sextant.graph.ops import SOURCES
from sextant.graph.symbolic import describe, graph_symbols

_IMPLIED = {op: ("shape", "dtype") for op in SOURCES} | {"cast": ("dtype",), "extern": ("shape", "dtype"),
                                                    "random": ("shape", "dtype")}
_IMPLIED["input"] = ("shape", "dtype", "name", "index")
_NAME_OK = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def format_attr(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, DType):
        return v.value
    if isinstance(v, tuple):
        return "[" + ",".join(format_attr(x) for x in v) + "]"
    return str(v)


def input_names(graph: Graph) -> list[str]:
    """Printable, unique SSA names for the graph inputs (from the module's argument names)."""
    names: list[str] = []
    for n in graph.inputs:
        base = n.attr("name")
        base = base if _NAME_OK.fullmatch(base) else f"arg{n.attr('index')}"
        name = base
        k = 1
        while name in names or name.isdigit():
            name = f"{base}_{k}"
            k += 1
        names.append(name)
    return names


def print_graph(graph: Graph, *, show_loc: bool = True) -> str:
    names: dict[int, str] = {}
    for node, name in zip(graph.inputs, input_names(graph)):
        names[id(node)] = "%" + name
    header = ", ".join(f"{names[id(n)]}: {n.type}" for n in graph.inputs)
    syms = graph_symbols(graph)
    where = f" where {describe(syms)}" if syms else ""
    lines = [f"graph @{graph.name}({header}){where} {{"]
    counter = 0
    for node in graph.nodes:
        if node.op == "input":
            continue
        names[id(node)] = f"%{counter}"
        counter += 1
        lines.append("  " + format_node(node, names, show_loc=show_loc))
    returned = [names.get(id(o), "%<undefined>") for o in graph.user_outputs]
    for pos, value in graph.constant_outputs:  # a value torch.export computed from static sizes
        returned.insert(pos, "none" if value is None else format_attr(value))
    outs = ", ".join(returned)
    lines.append(f"  return ({outs})")
    for m in graph.mutations:  # a value the call stores back: ``update %cache <- %7 {buffer="kv.k"}``
        new = names.get(id(graph.outputs[m.output]), "%<undefined>")
        lines.append(f"  update {names[id(graph.inputs[m.input])]} <- {new} {{{m.kind}={json.dumps(m.target)}}}")
    if graph.seed is not None:  # the input each call fills with a fresh seed (graph/philox.py)
        lines.append(f"  seed {names[id(graph.inputs[graph.seed])]}")
    lines.append("}")
    return "\n".join(lines)


def format_node(node: Node, names: dict[int, str], *, show_loc: bool = True) -> str:
    operands = ", ".join(names.get(id(i), "%<undefined>") for i in node.inputs)
    implied = _IMPLIED.get(node.op, ())
    attrs = [(k, v) for k, v in node.attrs if k not in implied]
    text = f"{names[id(node)]} = {node.op}({operands})"
    if attrs:
        text += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in attrs) + "}"
    text += f" : {node.type}"
    if show_loc and node.loc:
        text += f"  loc({json.dumps(node.loc)})"
    return text
