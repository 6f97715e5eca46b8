"""Structural and type checks for a graph, run after capture and after every pass."""

from __future__ import annotations

from collections.abc import Callable

from sextant.graph.ir import Graph, Node
from sextant.graph.ops import ALL_OPS, IRTypeError, infer_type
from sextant.graph.symbolic import SymbolicShapeError


class VerificationError(ValueError):
    """The graph breaks an IR invariant; the message names the node and the rule."""


def verify(graph: Graph, *, where: str = "") -> None:
    ctx = f" (after {where})" if where else ""
    defined: set[int] = set()
    errors: list[str] = []

    def fail(node: Node | None, msg: str) -> None:
        errors.append(f"{node!r}: {msg}" if node is not None else msg)

    for node in graph.nodes:
        if id(node) in defined:
            fail(node, "appears twice in the node list")
            continue
        if node.op not in ALL_OPS:
            fail(node, f"unknown op {node.op!r}")
        for operand in node.inputs:
            if id(operand) not in defined:
                fail(node, f"uses {operand!r} before it is defined (or it is not in the graph)")
        try:
            t = infer_type(node.op, [i.type for i in node.inputs], node.attr_dict)
            if t != node.type:
                fail(node, f"stored type {node.type} but its operands give {t}")
        except (IRTypeError, SymbolicShapeError) as e:
            fail(node, str(e))
        if node.op == "param":
            tensor = graph.params.get(node.attr("name"))
            if tensor is None:
                fail(node, f"param {node.attr('name')!r} has no tensor")
            elif tuple(tensor.shape) != node.shape or tensor.dtype != node.dtype.torch:
                fail(node, f"param tensor is {tuple(tensor.shape)} {tensor.dtype}, node says {node.type}")
        defined.add(id(node))

    input_nodes = [n for n in graph.nodes if n.op == "input"]
    if [id(n) for n in input_nodes] != [id(n) for n in graph.inputs] and \
            sorted(map(id, input_nodes)) != sorted(map(id, graph.inputs)):
        fail(None, "graph.inputs differ from the input nodes in the node list")
    if [n.attr("index") for n in graph.inputs] != list(range(len(graph.inputs))):
        fail(None, "input indices must be 0..n-1 in order")
    for out in graph.outputs:
        if id(out) not in defined:
            fail(out, "is an output but not in the node list")
    user = len(graph.outputs) - len(graph.mutations)
    for k, m in enumerate(graph.mutations):
        if m.output != user + k or not 0 <= m.input < len(graph.inputs):
            fail(None, f"update of {m.target!r}: output {m.output} / input {m.input} out of place "
                       f"(the new values follow the {user} returned outputs, in order)")
        elif graph.outputs[m.output].type != graph.inputs[m.input].type:
            fail(None, f"update of {m.target!r}: new value {graph.outputs[m.output].type} does not match "
                       f"the tensor {graph.inputs[m.input].type}")
    if graph.seed is not None and (graph.seed != len(graph.inputs) - 1 or graph.inputs[graph.seed].type.rank
                                   or graph.inputs[graph.seed].dtype.value != "i64"):
        fail(None, f"the seed (input {graph.seed}) must be the last input, an i64[] scalar")
    if graph.seed is None and any(n.op == "random" for n in graph.nodes):
        fail(None, "a random op in a graph with no seed input")
    _check_collectives(graph, fail)
    if len({m.input for m in graph.mutations}) != len(graph.mutations):
        fail(None, "a tensor is updated twice")
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise VerificationError(f"graph @{graph.name} is invalid{ctx}:\n  {shown}{more}")


def _check_collectives(graph: Graph, fail: Callable[[Node | None, str], None]) -> None:
    """A ``collective``'s value is in flight: read by ``wait`` nodes only (never a kernel, never an
    output), and a ``wait`` reads a ``collective``."""
    outputs = {id(o) for o in graph.outputs}
    for node in graph.nodes:
        if node.op == "wait" and node.inputs and node.inputs[0].op != "collective":
            fail(node, f"wait reads a {node.inputs[0].op}, not a collective")
        elif node.op != "wait":
            for operand in node.inputs:
                if operand.op == "collective":
                    fail(node, "reads a collective's value before its wait")
        if node.op == "collective" and id(node) in outputs:
            fail(node, "a collective is returned before its wait")
