"""Updates in place: decide, for every ``scatter``, whether it may write into its operand's storage.

A ``scatter(x, index, src)`` computes ``x`` with some slices replaced. Every scatter the schedule
sees is written *in place*: its kernel stores only the ``src`` slices, into the buffer that holds
``x`` — for a KV cache, one token's rows, not the whole cache. That is only correct when nothing
else can observe ``x``'s buffer being overwritten. This pass proves it, or makes it true:

- ``x`` is a graph **input** the module updates (a ``Mutation``: a KV-cache buffer, an argument
  updated in place), the scatter is its only reader, and the scatter — or a chain of scatters each
  the only reader of the last — is that input's new value, returned to no one. Then the program
  writes the new rows straight into the caller's tensor, and the runtime's store-back is a no-op.
- ``x`` is a value computed in the program (not a view of another buffer), read only by the
  scatter and not an output: its buffer is the scatter's to overwrite.
- Anything else — a weight, an input the module does not update, a value other kernels also
  read — first gets a ``copy`` of its own: the full write-back. The scatter then carries a
  ``note`` saying why, which the schedule dump shows.

The schedule runs this pass itself (it is idempotent), so a custom pipeline cannot skip it.
"""

from __future__ import annotations

from sextant.graph.ir import Graph, Node, make_node
from sextant.graph.ops import MOVEMENT
from sextant.graph.passes.rewrite import _rebuild


def overwrite_refusal(graph: Graph, users: dict[Node, list[Node]], s: Node) -> str | None:
    """Why scatter ``s`` may not overwrite the buffer of its operand ``x`` (None: it may)."""
    x = s.inputs[0]
    if len(users[x]) != 1:
        return f"{len(users[x])} ops read the value it updates"
    outputs = {id(o) for o in graph.outputs}
    if x.op == "input":
        mutation = next((m for m in graph.mutations if graph.inputs[m.input] is x), None)
        if mutation is None:
            return f"it updates the argument {x.attr('name')!r}, which the module does not update"
        new, cur = graph.outputs[mutation.output], s
        while cur is not new:  # a chain of updates, each the only reader of the last
            nxt = users[cur]
            if len(nxt) != 1 or nxt[0].op != "scatter" or nxt[0].inputs[0] is not cur or id(cur) in outputs:
                return f"the updated {x.attr('name')!r} is not the value stored back into it"
            cur = nxt[0]
        if sum(o is s for o in graph.outputs) > 1 or any(o is s for o in graph.user_outputs):
            return "the updated tensor is also returned"
        return None
    if x.op == "param":
        return f"it updates the weight {x.attr('name')!r}"
    if x.op in MOVEMENT:
        return f"it updates a view ({x.op}) of another value"
    if id(x) in outputs:
        return "the value it updates is also an output"
    return None


def in_place_updates(graph: Graph) -> Graph:
    """Give every scatter that may not overwrite its operand a ``copy`` of it (and a ``note``)."""
    if not any(n.op == "scatter" for n in graph.nodes):
        return graph
    users = graph.users()
    refusals = {id(n): why for n in graph.nodes if n.op == "scatter"
                and (why := overwrite_refusal(graph, users, n)) is not None}
    if not refusals:
        return graph

    def fix(old: Node, n: Node) -> Node | None:
        why = refusals.get(id(old))
        if why is None:
            return None
        x, index, src = n.inputs
        note = f"scatter at {n.loc or '?'} copies the whole tensor first: {why}"
        return make_node("scatter", (make_node("copy", (x,), loc=n.loc), index, src),
                         {**n.attr_dict, "note": note}, n.loc)

    return _rebuild(graph, fix)
