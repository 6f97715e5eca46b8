"""Fusion: partition a graph into groups, each of which becomes one kernel.

Elementwise and movement ops are never kernels of their own: they are *inlined* into the
kernel that consumes them (movement ops become index arithmetic). Kernels are anchored at:

- a **reduction**: the group holds every reduction over the same iteration space (input shape
  and reduced axes) that depends on it through elementwise ops and broadcasts, and the
  elementwise consumers of those reductions — softmax, LayerNorm, RMSNorm are one group;
- a **matmul** or **convolution**, with its elementwise epilogue (bias, activation, residual);
- a value that must be stored (a graph output, or an elementwise result shared by several
  kernels whose recomputation would be costly) that no anchor absorbed: an elementwise group.

Every decision not to fuse is recorded with its reason, for the schedule dump.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sextant.graph.ir import Graph, Node
from sextant.graph.ops import MOVEMENT, is_elementwise

INLINE_OPS_LIMIT = 24  # a shared elementwise tree larger than this is stored, not recomputed
PROLOGUE_OPS_LIMIT = 2  # a matmul/conv operand computed with more ops than this is stored first


@dataclass
class Group:
    kind: str  # "elementwise" | "reduce" | "matmul" | "conv"
    anchor: Node  # the node whose iteration space the kernel walks
    members: list[Node] = field(default_factory=list)  # computed in this kernel, topological order
    outputs: list[Node] = field(default_factory=list)  # members stored to memory
    notes: list[str] = field(default_factory=list)  # why fusions were refused
    # operands the kernel reads in a layout made at compile time (id of the operand -> the node
    # computing that layout from the weights), e.g. a CPU convolution's [G, K, Cout] weights
    packed: dict[int, Node] = field(default_factory=dict)

    @property
    def domain(self) -> tuple:
        """(shape, reduced axes) of a reduction group's iteration space."""
        a = self.anchor
        return (a.inputs[0].shape, a.attr("axes")) if self.kind == "reduce" else (a.shape, ())


def inlinable(n: Node) -> bool:
    return is_elementwise(n.op) or n.op in MOVEMENT or n.op in ("full", "iota")


def is_buffer(n: Node) -> bool:
    return n.op in ("input", "param")


def _tree_cost(n: Node, stored: set[int], seen: set[int] | None = None) -> int:
    """Ops recomputed when ``n`` is inlined (stopping at stored values)."""
    seen = set() if seen is None else seen
    if id(n) in seen or id(n) in stored or is_buffer(n) or not inlinable(n):
        return 0
    seen.add(id(n))
    own = 0 if n.op in MOVEMENT or n.op in ("full", "iota") else 1
    return own + sum(_tree_cost(i, stored, seen) for i in n.inputs)


def _drop_stored_reshapes(groups: list[Group], stored: set[int], outputs: set[int]) -> None:
    """A stored epilogue ``reshape`` of another stored member is the same bytes: consumers can
    index the member's buffer instead, so the reshape leaves the kernel."""
    for g in groups:
        for m in list(g.members):
            if (m.op == "reshape" and id(m) in stored and id(m) not in outputs
                    and id(m.inputs[0]) in stored and any(m.inputs[0] is x for x in g.members)):
                stored.discard(id(m))
                g.members.remove(m)


def _effective_users(n: Node, users: dict[Node, list[Node]], group_of: dict[int, Group],
                     outputs: set[int]) -> list[Group | None]:
    """The kernels that read ``n``, looking through the ungrouped inlined nodes in between
    (None stands for a kernel not formed yet)."""
    out: list[Group | None] = []
    stack, seen = list(users[n]), set()
    while stack:
        u = stack.pop()
        if id(u) in seen:
            continue
        seen.add(id(u))
        g = group_of.get(id(u))
        if g is not None:
            out.append(g)
        elif inlinable(u) and id(u) not in outputs:
            stack.extend(users[u])
        else:
            out.append(None)
    return out


def partition(graph: Graph, *, store_conv_inputs: bool = False) -> list[Group]:
    """``store_conv_inputs``: a convolution's input is stored rather than inlined, whatever computes
    it — zero padding, a concat, a resize, a cheap activation (the CPU reads each input element
    Cout·kernel / vector times, and its implicit GEMM wants one add per read; the GPU stages its
    tiles through shared memory and computes them there once)."""
    users = graph.users()
    outputs = {id(o) for o in graph.outputs}
    stored: set[int] = set()  # nodes that get a buffer written by some kernel
    group_of: dict[int, Group] = {}
    groups: list[Group] = []

    def new_group(kind: str, anchor: Node) -> Group:
        g = Group(kind, anchor, [anchor])
        group_of[id(anchor)] = g
        groups.append(g)
        return g

    # Operands of matmul/conv that carry arithmetic are stored: inlined, they would be
    # recomputed for every multiply-add of the contraction.
    for n in graph.nodes:
        if n.op in ("matmul", "conv"):
            for operand in n.inputs:
                if store_conv_inputs and n.op == "conv" and operand is n.inputs[0] and inlinable(operand) \
                        and not is_buffer(operand):
                    stored.add(id(operand))
                    continue
                while operand.op in MOVEMENT and operand.op != "gather":  # re-indexing is free: store below it
                    operand = operand.inputs[0]
                if not is_buffer(operand) and inlinable(operand) and _tree_cost(operand, stored) > PROLOGUE_OPS_LIMIT:
                    stored.add(id(operand))

    for n in graph.nodes:
        if is_buffer(n) or id(n) in group_of:
            continue
        if n.op == "reduce":
            g = _join_reduce_group(n, group_of, groups) or new_group("reduce", n)
            group_of[id(n)] = g
            if n is not g.anchor:
                g.members.append(n)
        elif n.op in ("matmul", "conv"):
            new_group(n.op, n)
        elif inlinable(n):
            _maybe_join_epilogue(n, group_of, groups)

    # Decide which values are stored: outputs of the graph, anchors used outside their group,
    # elementwise values shared by several kernels (when costly to recompute).
    for n in graph.nodes:
        if is_buffer(n):
            continue
        g = group_of.get(id(n))
        outside = [u for u in _effective_users(n, users, group_of, outputs) if u is not g]
        if id(n) in outputs or (g is not None and outside):
            stored.add(id(n))
        elif g is None and inlinable(n):
            consumers = {id(group_of.get(id(u))) for u in users[n]}
            if len(users[n]) > 1 and len(consumers) > 1 and _tree_cost(n, stored) > INLINE_OPS_LIMIT:
                stored.add(id(n))
        elif g is None:
            stored.add(id(n))

    # Stored nodes that no group computes become elementwise groups.
    for n in graph.nodes:
        if id(n) in stored and id(n) not in group_of and not is_buffer(n):
            new_group("elementwise", n)
    _drop_stored_reshapes(groups, stored, outputs)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    for g in groups:
        g.members.sort(key=lambda m: order[id(m)])
        g.outputs = [m for m in g.members if id(m) in stored]
    groups.sort(key=lambda g: max(order[id(m)] for m in g.members))
    return _dependency_order(groups, group_of)


def _dependency_order(groups: list[Group], group_of: dict[int, Group]) -> list[Group]:
    """``groups`` (in their given order where free) with every group after the groups it reads.

    The position of a group's last member is not enough: an epilogue joined to a reduction
    (``softmax * 2``) can come after a matmul that consumes the softmax, which would then be
    launched before its operand was computed."""
    index = {id(g): i for i, g in enumerate(groups)}

    def reads(g: Group) -> set[int]:
        found: set[int] = set()
        stack, seen = [i for m in g.members for i in m.inputs], set()
        while stack:
            x = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            h = group_of.get(id(x))
            if h is None:  # inlined into g: computed from its own operands
                stack.extend(x.inputs)
            elif h is not g:
                found.add(index[id(h)])
        return found

    deps = [reads(g) for g in groups]
    done: set[int] = set()
    out: list[Group] = []
    while len(out) < len(groups):
        i = next((i for i in range(len(groups)) if i not in done and deps[i] <= done), None)
        if i is None:  # a fusion bug: the joins are meant to keep the groups acyclic
            raise AssertionError(f"fused groups depend on each other in a cycle: {[g.anchor for g in groups]}")
        done.add(i)
        out.append(groups[i])
    return out


def _join_reduce_group(n: Node, group_of: dict[int, Group], groups: list[Group]) -> Group | None:
    """An earlier reduction group over the same iteration space that ``n`` depends on only through
    elementwise ops and row broadcasts (so the group can compute ``n`` after it in the same row loop)."""
    shape, axes = n.inputs[0].shape, n.attr("axes")
    reachable = _reachable_groups(n.inputs[0], group_of)
    same = [g for g in reachable if g.kind == "reduce" and g.domain == (shape, axes)]
    if len(same) != 1:
        return None
    found = same[0]
    others = [g for g in reachable if g is not found]
    if any(_group_reaches(h, found) for h in others):  # fusing would make a cycle between kernels
        found.notes.append(f"{n.op} at {n.loc or '?'} depends on the group through another kernel: "
                           f"separate kernel")
        return None
    if not _row_compatible(n.inputs[0], found, group_of, shape, axes):
        found.notes.append(f"{n.op} at {n.loc or '?'} reads the group's reductions through a non-broadcast "
                           f"movement: separate kernel")
        return None
    return found


def _reachable_groups(n: Node, group_of: dict[int, Group], seen: set[int] | None = None) -> list[Group]:
    seen = set() if seen is None else seen
    if id(n) in seen:
        return []
    seen.add(id(n))
    if id(n) in group_of:
        return [group_of[id(n)]]
    if not inlinable(n):
        return []
    out: list[Group] = []
    for i in n.inputs:
        for g in _reachable_groups(i, group_of, seen):
            if all(g is not o for o in out):
                out.append(g)
    return out


def _row_compatible(n: Node, g: Group, group_of: dict[int, Group], shape: tuple, axes: tuple) -> bool:
    """``n`` (of the full ``shape``) uses group values only elementwise, or through an ``expand``
    of a row-shaped value back over the reduced ``axes``."""
    row_shape = tuple(1 if i in axes else d for i, d in enumerate(shape))
    if group_of.get(id(n)) is g:
        return n.shape in (shape, row_shape)
    if not _depends_on(n, g, group_of):
        return True
    if n.op == "expand" and n.shape == shape:
        src = n.inputs[0]
        return src.shape == row_shape and _row_compatible(src, g, group_of, shape, axes)
    if is_elementwise(n.op) and n.shape in (shape, row_shape):
        return all(_row_compatible(i, g, group_of, shape, axes) for i in n.inputs)
    return False


def _depends_on(n: Node, g: Group, group_of: dict[int, Group]) -> bool:
    return any(x is g for x in _reachable_groups(n, group_of))


def _maybe_join_epilogue(n: Node, group_of: dict[int, Group], groups: list[Group]) -> None:
    """Fuse ``n`` into the kernel of its operands when it is that kernel's epilogue."""
    if not (is_elementwise(n.op) or n.op == "reshape"):
        return
    direct = {id(g): g for g in (group_of.get(id(i)) for i in n.inputs) if g is not None}
    contractions = [g for g in direct.values() if g.kind in ("matmul", "conv")]
    for g in sorted(contractions, key=lambda g: -len(g.members)):
        # Pointwise on the accumulator (reshapes included: the element is the same); the other
        # operands are loaded, so they must not depend on this kernel.
        if n.type.numel == g.anchor.type.numel and all(group_of.get(id(i)) is g or not _reaches(i, g)
                                                        for i in n.inputs):
            _add(g, n, group_of)
            return
    if contractions or not is_elementwise(n.op):
        return
    reachable = [g for i in n.inputs for g in _reachable_groups(i, group_of)]
    reduce_groups: list[Group] = []
    for g in reachable:
        if g.kind == "reduce" and all(g is not r for r in reduce_groups):
            reduce_groups.append(g)
    domains = {(r.domain[0], r.domain[1]) for r in reduce_groups}
    if not reduce_groups or len(domains) != 1:
        return
    shape, axes = next(iter(domains))
    row_shape = tuple(1 if i in axes else d for i, d in enumerate(shape))
    if n.shape not in (shape, row_shape):
        return
    target = reduce_groups[0]
    others = [h for h in reachable if all(h is not r for r in reduce_groups)]
    if any(_group_reaches(h, r) for h in others for r in reduce_groups):
        target.notes.append(f"{n.op} at {n.loc or '?'} also depends on the group through another kernel")
        return
    if any(_group_reaches(a, b) for a in reduce_groups for b in reduce_groups if a is not b):
        return  # sibling groups must be independent to merge
    for other in reduce_groups[1:]:  # independent reductions over one domain: one kernel
        for m in other.members:
            group_of[id(m)] = target
        target.members += other.members
        target.notes += other.notes
        groups.remove(other)
    if all(_row_compatible(i, target, group_of, shape, axes) for i in n.inputs):
        _add(target, n, group_of)


def _add(g: Group, n: Node, group_of: dict[int, Group]) -> None:
    g.members.append(n)
    group_of[id(n)] = g


def _reaches(n: Node, g: Group) -> bool:
    """Whether ``n`` depends on any member of ``g`` through any path (kernels included)."""
    targets = {id(m) for m in g.members}
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if id(x) in targets:
            return True
        if id(x) in seen:
            continue
        seen.add(id(x))
        stack.extend(x.inputs)
    return False


def _group_reaches(h: Group, g: Group) -> bool:
    return any(_reaches(i, g) for m in h.members for i in m.inputs)
