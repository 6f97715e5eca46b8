"""Fusion: partition a graph into groups, each of which becomes one kernel.

Elementwise and movement ops are never kernels of their own: they are *inlined* into the
kernel that consumes them (movement ops become index arithmetic). Kernels are anchored at:

- a **reduction**: the group holds every reduction over the same iteration space (input shape
  and reduced axes) that depends on it through elementwise ops and broadcasts, and the
  elementwise consumers of those reductions — softmax, LayerNorm, RMSNorm are one group;
- a **matmul** or **convolution**, with its elementwise epilogue (bias, activation, residual);
- an **attention** ``softmax(f(Q·Kᵀ))·V`` (``attention_match``): both products, the masks and
  the softmax in one kernel, with the second product's epilogue;
- a **scatter** (an update of a tensor's slices, in place: ``schedule/scatter.py``), alone — its
  updated operand stored in a buffer the scatter then owns, its slices and positions inlined;
- a value that must be stored (a graph output, or an elementwise result shared by several
  kernels whose recomputation would be costly) that no anchor absorbed: an elementwise group.

Every decision not to fuse is recorded with its reason, for the schedule dump.

Compile time stays near-linear in the graph (docs/scheduling.md, "Linear-time fusion"): every
walk uses an explicit stack, and the questions asked once per node are memoised — the groups
an inlined value reads, whether a node depends on a group, whether a value is row-compatible
with a reduction group. Walks report the nodes they visit to a :class:`WorkCounter`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from sextant.graph.extern import call_key
from sextant.graph.ir import Graph, Node
from sextant.graph.ops import MOVEMENT, is_elementwise
from sextant.schedule.attention_match import Attention, match_attention
from sextant.work import WorkCounter

INLINE_OPS_LIMIT = 24  # a shared elementwise tree larger than this is stored, not recomputed
PROLOGUE_OPS_LIMIT = 2  # a matmul/conv operand computed with more ops than this is stored first


@dataclass
class Group:
    kind: str  # "elementwise" | "reduce" | "matmul" | "conv" | "attention" | "extern" | "scatter"
    # | "collective" | "wait" (a transfer between ranks: started, then waited for)
    anchor: Node  # the node whose iteration space the kernel walks
    members: list[Node] = field(default_factory=list)  # computed in this kernel, topological order
    outputs: list[Node] = field(default_factory=list)  # members stored to memory
    notes: list[str] = field(default_factory=list)  # why fusions were refused
    # operands the kernel reads in a layout made at compile time (id of the operand -> the node
    # computing that layout from the weights), e.g. a CPU convolution's [G, strips, K, nr] weights
    packed: dict[int, Node] = field(default_factory=dict)
    attention: Attention | None = None  # the matched chain of an "attention" group
    # a CPU bf16 matmul on AMX tiles (schedule/cpu_amx.py): decided when its weight is laid out
    tiles: bool = False

    @property
    def domain(self) -> tuple:
        """(shape, reduced axes) of a reduction group's iteration space."""
        a = self.anchor
        return (a.inputs[0].shape, a.attr("axes")) if self.kind == "reduce" else (a.shape, ())


def strided_rows(b: Node) -> bool:
    """Whether ``b`` re-indexes a non-weight value so that a row of ``b`` is not a contiguous run of
    the stored value: through a permutation that moves the last axis, or a concat, pad or gather
    (each element then picks its source, or its position, by a computed index)."""
    moved = False
    while b.op in MOVEMENT:
        if b.op in ("concat", "pad", "gather") or (b.op == "permute" and b.attr("perm")[-1] != b.type.rank - 1):
            moved = True
        b = b.inputs[0]
    return moved and b.op != "param"


def inlinable(n: Node) -> bool:
    return is_elementwise(n.op) or n.op in MOVEMENT or n.op in ("full", "iota")


def is_buffer(n: Node) -> bool:
    return n.op in ("input", "param")


def movement_of_param(n: Node) -> bool:
    """``n`` is a param re-indexed by single-operand movement ops: a value the compiler can lay out
    at compile time (a Linear layer's ``permute(W)``, laid out in panels or in pairs of K)."""
    while n.op in ("reshape", "permute", "expand", "slice", "pad"):
        n = n.inputs[0]
    return n.op == "param"


def layout_chain(operand: Node, layout: Node) -> list[Node]:
    """The nodes of ``layout`` (single-operand nodes over ``operand``) in definition order."""
    chain, x = [], layout
    while x is not operand:
        chain.append(x)
        x = x.inputs[0]
    return chain[::-1]


def append_layouts(graph: Graph, layouts: list[tuple[Group, Node, Node]],
                   groups: list[Group]) -> tuple[Graph, list[Node]]:
    """Each ``(group, operand, layout)``: the group reads ``layout`` (a chain of single-operand
    nodes over ``operand``, built for it) instead of the operand (``Group.packed``), and the
    chain's nodes are appended to the graph after everything they read — the program's graph
    names every buffer it holds. An operand computed from the params alone is laid out at compile
    time; any other is laid out per call by an ``elementwise`` group of its own, inserted into
    ``groups`` before the group that reads it. Returns that graph and the compile-time layouts,
    to be evaluated into constants."""
    extra: list[Node] = []
    constant: list[Node] = []
    for g, operand, layout in layouts:
        extra += layout_chain(operand, layout)
        g.packed[id(operand)] = layout
        if params_only(operand):
            constant.append(layout)
        else:
            groups.insert(groups.index(g), Group("elementwise", layout, members=layout_chain(operand, layout),
                                                 outputs=[layout]))
    if not extra:
        return graph, []
    return graph.with_nodes((*graph.nodes, *extra), graph.outputs), constant


def params_only(n: Node) -> bool:
    """Whether ``n`` depends on params alone (no input): its layout can be changed at compile time."""
    stack, seen = [n], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.op == "input":
            return False
        stack.extend(x.inputs)
    return True


def partition(graph: Graph, work: WorkCounter | None = None, *, store_conv_inputs: bool = False,
              contiguous_rhs: bool = False, fuse_attention: bool = True,
              attention_refusal: Callable[[Attention], str | None] | None = None) -> list[Group]:
    """The fused groups of ``graph`` in a valid launch order; ``work`` counts the nodes the
    fusion walks visited.

    ``store_conv_inputs``: a convolution's input is stored rather than inlined, whatever computes
    it — zero padding, a concat, a resize, a cheap activation (the CPU reads each input element
    Cout·kernel / vector times, and its implicit GEMM wants one add per read; the GPU stages its
    tiles through shared memory and computes them there once).

    ``contiguous_rhs``: a matmul's right-hand side that re-indexes a computed value (or an input)
    so that its rows are not contiguous — ``permute(W)`` of a Linear layer whose weight is an input,
    as in a training graph, ``dYᵀ`` or the concat of ``dQ, dK, dV`` in a backward — is stored in its
    own layout first
    (:func:`strided_rows`): the CPU GEMM reads ``nr`` consecutive columns of B per step, which
    through a transpose are ``nr`` gathers ``K`` elements apart. Below any reshapes on top: a
    reshape of a stored value reads it contiguously, and the value's own shape is the one its
    kernel computes best (a 1×1 convolution's concat of upsampled maps, written flattened to
    ``[N, C, positions]``, lost the row structure of its bilinear indexing: 15× slower). A
    weight's is laid out at compile time instead (``cpu_panels``).

    ``fuse_attention``: each ``softmax(f(Q·Kᵀ))·V`` chain (``attention_match``) is one
    ``attention`` group, its score and probability matrices never stored — unless
    ``attention_refusal`` (the target's) gives a reason not to, which the dump then shows."""
    fusion = _Fusion(graph, work if work is not None else WorkCounter())
    fusion.store_conv_inputs = store_conv_inputs
    fusion.contiguous_rhs = contiguous_rhs
    fusion.fuse_attention = fuse_attention
    fusion.attention_refusal = attention_refusal
    return fusion.run()


def _row_shape(shape: tuple, axes: tuple) -> tuple:
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


class _Fusion:
    """The state of one partition: groups formed so far, and the memos of its walks.

    Nodes are visited in topological order, and a node's group is settled when it is visited
    (later groups only merge existing ones), so what a walk learns about nodes already visited
    stays true — except across a merge of reduction groups, which clears the one memo it
    affects (row compatibility)."""

    def __init__(self, graph: Graph, work: WorkCounter) -> None:
        self.store_conv_inputs = False
        self.contiguous_rhs = False
        self.fuse_attention = True
        self.refused_attention: list[tuple[Node, str]] = []
        self.attention_refusal: Callable[[Attention], str | None] | None = None
        self.graph = graph
        self.work = work
        self.pos = {id(n): i for i, n in enumerate(graph.nodes)}
        self.users = graph.users()
        self.outputs = {id(o) for o in graph.outputs}
        self.stored: set[int] = set()  # nodes that get a buffer written by some kernel
        self.pinned: set[int] = set()  # stored nodes read by extern calls: never dropped from memory
        self.group_of: dict[int, Group] = {}
        self.groups: dict[int, Group] = {}  # id -> group, in creation order
        # members of a contraction/reduction group that all its other members depend on: its
        # anchor, and the anchors of the sibling reductions merged into it
        self.roots: dict[int, list[Node]] = {}
        self._frontier_memo: dict[int, list[Node]] = {}  # ungrouped node -> a node per reduction group it reads
        self._depends_memo: dict[int, dict[int, bool]] = {}  # root -> {node: node is or depends on root}
        self._members_reach: dict[tuple[int, int], tuple[int, bool]] = {}  # (group, root) -> (checked, any)
        self._row_memo: dict[tuple[int, int], bool] = {}  # (group anchor, node) -> row-compatible
        self._readers: dict[int, frozenset] = {}  # ungrouped node -> up to two kernels reading it

    # -- driver ----------------------------------------------------------------------------
    def run(self) -> list[Group]:
        graph, stored, group_of = self.graph, self.stored, self.group_of
        self.work.add("fusion: nodes", len(graph.nodes))
        fused_probs = self.form_attention_groups() if self.fuse_attention else set()
        # Operands of matmul/conv that carry arithmetic are stored: inlined, they would be
        # recomputed for every multiply-add of the contraction.
        for n in graph.nodes:
            if n.op in ("matmul", "conv"):
                for operand in n.inputs:
                    if id(operand) in fused_probs and operand is n.inputs[0]:
                        continue  # an attention's probabilities: computed in its kernel, never stored
                    if self.store_conv_inputs and n.op == "conv" and operand is n.inputs[0] \
                            and inlinable(operand) and not is_buffer(operand):
                        stored.add(id(operand))
                        continue
                    if self.contiguous_rhs and n.op == "matmul" and operand is n.inputs[1] \
                            and id(n) not in group_of and strided_rows(operand):  # (attention reads K, V itself)
                        while operand.op == "reshape" and strided_rows(operand.inputs[0]):
                            operand = operand.inputs[0]  # stored in its own shape: a reshape of it is contiguous
                        stored.add(id(operand))
                        continue
                    while operand.op in MOVEMENT and operand.op != "gather":  # re-indexing is free: store below it
                        operand = operand.inputs[0]
                    if (not is_buffer(operand) and inlinable(operand)
                            and self.tree_cost(operand, PROLOGUE_OPS_LIMIT) > PROLOGUE_OPS_LIMIT):
                        stored.add(id(operand))

        # An extern call reads its operands from memory, whole and in their own shape, and writes
        # every result: the operands are stored (kept through _drop_stored_reshapes), the results too.
        extern_calls: dict[tuple, Group] = {}
        for n in graph.nodes:
            if n.op in ("extern", "collective", "wait"):  # a transfer reads and writes whole buffers too
                for operand in n.inputs:
                    if not is_buffer(operand):
                        stored.add(id(operand))
                        self.pinned.add(id(operand))
                stored.add(id(n))
            elif n.op == "scatter":  # writes into its operand's buffer, which readers see as its value
                stored.add(id(n))
                if not is_buffer(n.inputs[0]):
                    stored.add(id(n.inputs[0]))
                    self.pinned.add(id(n.inputs[0]))

        for n in graph.nodes:
            if is_buffer(n) or id(n) in group_of:
                continue
            if n.op == "scatter":
                self.new_group("scatter", n)
                g = self.group_of[id(n)]
                if n.attr("note"):
                    g.notes.append(n.attr("note"))
            elif n.op in ("collective", "wait"):
                self.new_group(n.op, n)
            elif n.op == "extern":
                key = call_key(n)
                if key in extern_calls:
                    self.add(extern_calls[key], n)
                else:
                    extern_calls[key] = self.new_group("extern", n)
            elif n.op == "reduce":
                g = self.join_reduce_group(n) or self.new_group("reduce", n)
                group_of[id(n)] = g
                if n is not g.anchor:
                    g.members.append(n)
            elif n.op in ("matmul", "conv"):
                self.new_group(n.op, n)
            elif inlinable(n):
                self.maybe_join_epilogue(n)

        # Decide which values are stored: outputs of the graph, anchors used outside their group,
        # elementwise values shared by several kernels (when costly to recompute).
        users = self.users
        bound: dict[int, tuple[int, bool]] = {}  # tree_cost's upper bound and whether it is exact
        for n in graph.nodes:
            if is_buffer(n):
                continue
            g = group_of.get(id(n))
            bound[id(n)] = self.cost_bound(n, bound, INLINE_OPS_LIMIT)
            if id(n) in self.outputs or (g is not None and self.used_outside(n, g)):
                stored.add(id(n))
            elif g is None and inlinable(n):
                # the kernels that would recompute n, looking through the ungrouped nodes between
                # (a residual stream read by a LayerNorm and the next residual add, both inlined);
                # the bound spares the walk while a chain is still short
                upper, exact = bound[id(n)]
                if len(users[n]) > 1 and upper > INLINE_OPS_LIMIT and len(self.readers(n)) > 1:
                    cost = upper if exact else self.tree_cost(n, INLINE_OPS_LIMIT)
                    if cost > INLINE_OPS_LIMIT:
                        stored.add(id(n))
                    else:
                        bound[id(n)] = (cost, True)  # users' bounds start from the exact figure
            elif g is None:
                stored.add(id(n))

        self.adopt_stored_into_reductions()
        # Stored nodes that no group computes become elementwise groups.
        for n in graph.nodes:
            if id(n) in stored and id(n) not in group_of and not is_buffer(n):
                self.new_group("elementwise", n)
        for node, why in self.refused_attention:
            g = group_of.get(id(node))
            if g is not None:
                g.notes.append(f"attention at {node.loc or '?'} not fused: {why}")
        groups = list(self.groups.values())
        _drop_stored_reshapes(groups, stored, self.outputs | self.pinned)
        pos = self.pos
        for g in groups:
            g.members.sort(key=lambda m: pos[id(m)])
            g.outputs = [m for m in g.members if id(m) in stored]
        groups.sort(key=lambda g: pos[id(g.members[-1])])
        groups = self.merge_elementwise_chains(groups)
        return self.dependency_order(groups)

    def adopt_stored_into_reductions(self) -> None:
        """A stored, ungrouped value that a reduction group reads inline *and* depends on is
        computed by that group. It arises when an epilogue's join was refused (it read a second
        reduction domain: a softmax over a row that an earlier reduction produced) and a later
        reduction of the same group reads it (the next softmax) — legal while the value was
        inlined, since the group's row loop computes it anyway, but as a kernel of its own the
        stored value would read the group and be read by it: a cycle between kernels. The joins
        already checked that the group's readers use it row by row, so it can be a member.

        Walked from the graph's end: a stored value read only through another one is adopted
        after that one (its reader is then a member)."""
        stored, group_of, users = self.stored, self.group_of, self.users
        for n in reversed(self.graph.nodes):
            if id(n) not in stored or id(n) in group_of or is_buffer(n) or not inlinable(n):
                continue
            readers: dict[int, Group] = {}
            stack, seen = list(users[n]), set()
            while stack:
                u = stack.pop()
                if id(u) in seen:
                    continue
                seen.add(id(u))
                g = group_of.get(id(u))
                if g is not None:
                    readers[id(g)] = g
                elif id(u) not in stored and inlinable(u):
                    stack.extend(users[u])
            cyclic = [g for g in readers.values() if g.kind == "reduce" and self.reaches(n, g)]
            if len(cyclic) == 1:
                self.add(cyclic[0], n)

    def merge_elementwise_chains(self, groups: list[Group]) -> list[Group]:
        """An elementwise kernel whose stored values one other elementwise kernel alone reads, each
        directly at the element it writes (an elementwise op of the same shape), is computed inside
        that kernel: one launch storing both — an optimizer's momentum and the parameter updated
        from it, a saved activation and the value computed from it — instead of a kernel storing a
        value that the next one loads back."""
        stored, group_of = self.stored, self.group_of
        readers: dict[int, set[int]] = {}  # stored node -> the groups that load it
        for g in groups:
            members = {id(m) for m in g.members}
            seen: set[int] = set()
            stack = [i for m in g.members for i in m.inputs]
            while stack:
                n = stack.pop()
                if id(n) in seen or id(n) in members:
                    continue
                seen.add(id(n))
                if id(n) in stored or is_buffer(n):
                    readers.setdefault(id(n), set()).add(id(g))
                elif id(n) not in group_of:  # inlined into g: look through it
                    stack.extend(n.inputs)
        by_id = {id(g): g for g in groups}
        merged: set[int] = set()

        def plain(g: Group) -> bool:
            return g.kind == "elementwise" and not (g.outputs[0].op == "concat" and len(g.outputs) == 1)

        for a in groups:
            if not plain(a) or id(a) in merged:
                continue
            into = {r for o in a.outputs for r in readers.get(id(o), ())}
            if len(into) != 1:
                continue
            b = by_id[next(iter(into))]
            shape = a.outputs[0].shape
            if b is a or not plain(b) or any(o.shape != shape for o in (*a.outputs, *b.outputs)):
                continue
            if not self._read_in_place(a.outputs, {id(m) for m in b.members}, shape):
                continue
            b.members = sorted(a.members + b.members, key=lambda m: self.pos[id(m)])
            b.outputs = [m for m in b.members if id(m) in stored]
            b.notes += a.notes
            for m in a.members:
                group_of[id(m)] = b
            merged.add(id(a))
        return [g for g in groups if id(g) not in merged]

    def _read_in_place(self, values: list[Node], members: set[int], shape: tuple) -> bool:
        """Whether every use of ``values`` is by elementwise ops of ``shape`` — a group's members
        (``members``) or unstored ungrouped ops inlined on the way to them — so each element is
        read at the index it is written."""
        stack, seen = [u for v in values for u in self.users[v]], set()
        while stack:
            u = stack.pop()
            if id(u) in seen:
                continue
            seen.add(id(u))
            if not is_elementwise(u.op) or u.shape != shape:
                return False
            if id(u) in members:
                continue
            if id(u) in self.group_of or id(u) in self.stored or id(u) in self.outputs:
                return False
            stack.extend(self.users[u])
        return True

    def form_attention_groups(self) -> set[int]:
        """One ``attention`` group per matched chain (anchored at ``O``; every member depends on
        ``S``, its root); returns the ids of the probability operands, which stay unstored."""
        found, self.refused_attention = match_attention(self.graph, self.users)
        probs: set[int] = set()
        for a in found:
            why = self.attention_refusal(a) if self.attention_refusal is not None else None
            if why is not None:
                self.refused_attention.append((a.out, why))
                continue
            g = Group("attention", a.out, list(a.members), attention=a)
            for m in a.members:
                self.group_of[id(m)] = g
            self.groups[id(g)] = g
            self.roots[id(g)] = [a.scores]
            probs.add(id(a.probs))
        self.work.add("fusion: attention chains", len(found))
        return probs

    def new_group(self, kind: str, anchor: Node) -> Group:
        g = Group(kind, anchor, [anchor])
        self.group_of[id(anchor)] = g
        self.groups[id(g)] = g
        self.roots[id(g)] = [anchor]
        return g

    def add(self, g: Group, n: Node) -> None:
        g.members.append(n)
        self.group_of[id(n)] = g

    # -- walks -------------------------------------------------------------------------------
    def tree_cost(self, n: Node, limit: int) -> int:
        """Ops recomputed when ``n`` is inlined (stopping at stored values), counted up to
        ``limit + 1``: callers compare with ``limit``, and the cap bounds the walk."""
        stored, cost, visited = self.stored, 0, 0
        stack, seen = [n], set()
        while stack and cost <= limit:
            x = stack.pop()
            if id(x) in seen or id(x) in stored or is_buffer(x) or not inlinable(x):
                continue
            seen.add(id(x))
            visited += 1
            if x.op not in MOVEMENT and x.op not in ("full", "iota"):
                cost += 1
            stack.extend(reversed(x.inputs))
        self.work.add("fusion: tree cost", visited)
        return cost

    def cost_bound(self, n: Node, bound: dict[int, tuple[int, bool]], limit: int) -> tuple[int, bool]:
        """An upper bound of :meth:`tree_cost` (capped at ``limit + 1``) from the bounds of ``n``'s
        operands (a shared operand counts once per use), and whether it is exact: when at most one
        operand costs anything and its bound is exact — a chain, such as a residual stream."""
        total = 0 if n.op in MOVEMENT or n.op in ("full", "iota") else 1
        costly = []
        for i in n.inputs:
            if id(i) in self.stored or is_buffer(i) or not inlinable(i):
                continue
            b, exact = bound.get(id(i), (limit + 1, False))
            if b:
                costly.append(exact)
            total += b
        exact = len(costly) == 0 or (len(costly) == 1 and costly[0])
        return (limit + 1, exact) if total > limit else (total, exact)

    def reduce_frontier(self, n: Node) -> list[Node]:
        """One grouped node per *reduction* group that ``n`` reads through ungrouped inlined
        nodes, in depth-first order of the inputs (the order the joins pick targets in).

        Memoised per ungrouped node: its ancestors' groups are settled, and merges only make
        reduction groups coarser, so the first node kept per group at memo time still names
        each group's first occurrence. Only reduction groups are kept: a long ungrouped chain
        (a residual stream between kernels) reads ever more matmul/conv groups, and listing
        them at every node of the chain would be quadratic."""
        group_of, memo = self.group_of, self._frontier_memo
        if id(n) in group_of:
            return [n] if group_of[id(n)].kind == "reduce" else []
        if not inlinable(n):
            return []
        stack = [n]
        while stack:
            x = stack[-1]
            if id(x) in memo:
                stack.pop()
                continue
            pending = [i for i in x.inputs if id(i) not in memo and id(i) not in group_of and inlinable(i)]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            out: list[Node] = []
            seen: set[int] = set()
            for i in x.inputs:
                for b in [i] if id(i) in group_of else memo.get(id(i), []):
                    g = group_of[id(b)]
                    if g.kind == "reduce" and id(g) not in seen:
                        seen.add(id(g))
                        out.append(b)
            memo[id(x)] = out
            self.work.add("fusion: reachable groups", 1 + len(out))
        return memo[id(n)]

    def reachable_reductions(self, *nodes: Node) -> list[Group]:
        """The reduction groups ``nodes`` read through ungrouped inlined nodes (themselves if
        grouped), in first-occurrence order."""
        out: dict[int, Group] = {}
        for n in nodes:
            for b in self.reduce_frontier(n):
                g = self.group_of[id(b)]
                out.setdefault(id(g), g)
        return list(out.values())

    def reachable_groups(self, *nodes: Node) -> list[Group]:
        """Every group ``nodes`` read through ungrouped inlined nodes: a walk of that region,
        asked only when a join is about to happen (for its cycle check)."""
        group_of = self.group_of
        out: dict[int, Group] = {}
        stack, seen = list(nodes), set()
        while stack:
            x = stack.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            g = group_of.get(id(x))
            if g is not None:
                out.setdefault(id(g), g)
            elif inlinable(x):
                stack.extend(x.inputs)
        self.work.add("fusion: reachable groups", len(seen))
        return list(out.values())

    def depends(self, x: Node, root: Node) -> bool:
        """Whether ``x`` is ``root`` or depends on it through any path (kernels included).

        The walk skips nodes placed before ``root`` in the graph (they cannot depend on it)
        and is memoised per root: the answer is a fact about the graph, which never changes."""
        memo = self._depends_memo.setdefault(id(root), {})
        lo, pos = self.pos[id(root)], self.pos

        def known(y: Node) -> bool | None:
            if y is root:
                return True
            if pos[id(y)] < lo:
                return False
            return memo.get(id(y))

        k = known(x)
        if k is not None:
            return k
        stack: list[tuple[Node, int]] = [(x, 0)]  # the current path, with the next input to try
        visited = 0
        while stack:
            y, i = stack[-1]
            if i == len(y.inputs):
                memo[id(y)] = False
                stack.pop()
                continue
            stack[-1] = (y, i + 1)
            child = y.inputs[i]
            k = known(child)
            if k is None:
                visited += 1
                stack.append((child, 0))
            elif k:
                for on_path, _ in stack:  # every node on the path reaches root
                    memo[id(on_path)] = True
                self.work.add("fusion: reaches", visited + 1)
                return True
        self.work.add("fusion: reaches", visited + 1)
        return False

    def reaches(self, n: Node, g: Group) -> bool:
        """Whether ``n`` depends on (or is) any member of ``g``: every member depends on one of
        the group's roots, so asking about the roots suffices."""
        return any(self.depends(n, r) for r in self.roots[id(g)])

    def group_reaches(self, h: Group, g: Group) -> bool:
        """Whether some member of ``h`` reads a member of ``g``. Kept per (group, root) pair
        and extended only over the members ``h`` gained since the last question."""
        for r in self.roots[id(g)]:
            key = (id(h.anchor), id(r))
            checked, hit = self._members_reach.get(key, (0, False))
            while not hit and checked < len(h.members):
                m = h.members[checked]
                hit = any(self.depends(i, r) for i in m.inputs)
                checked += 1
            self._members_reach[key] = (checked, hit)
            if hit:
                return True
        return False

    def depends_on(self, n: Node, g: Group) -> bool:
        """Whether ``n`` reads the reduction group ``g`` through ungrouped inlined nodes."""
        return any(x is g for x in self.reachable_reductions(n))

    def row_compatible(self, n: Node, g: Group, shape: tuple, axes: tuple) -> bool:
        """``n`` (of the full ``shape``) uses group values only elementwise, or through an
        ``expand`` of a row-shaped value back over the reduced ``axes``. The answer is the
        conjunction of a local check over every node the relation reaches, memoised per node."""
        row_shape = _row_shape(shape, axes)
        memo, anchor = self._row_memo, id(g.anchor)

        def local(x: Node) -> tuple[bool, tuple[Node, ...]]:
            """x's own condition, and the nodes whose answers it also needs."""
            if self.group_of.get(id(x)) is g:
                return x.shape in (shape, row_shape), ()
            if not self.depends_on(x, g):
                return True, ()
            if x.op == "expand" and x.shape == shape:
                return x.inputs[0].shape == row_shape, x.inputs[:1]
            if is_elementwise(x.op) and x.shape in (shape, row_shape):
                return True, x.inputs
            return False, ()

        stack = [n]
        while stack:
            x = stack[-1]
            if (anchor, id(x)) in memo:
                stack.pop()
                continue
            ok, needs = local(x)
            pending = [i for i in needs if (anchor, id(i)) not in memo]
            if ok and pending:
                stack.extend(pending)
                continue
            stack.pop()
            memo[(anchor, id(x))] = ok and all(memo[(anchor, id(i))] for i in needs)
            self.work.add("fusion: row compatible", 1)
        return memo[(anchor, id(n))]

    def used_outside(self, n: Node, g: Group) -> bool:
        """Whether a kernel other than ``n``'s own group ``g`` reads ``n``, looking through the
        ungrouped inlined nodes in between (a kernel not formed yet counts as another)."""
        readers = self.readers(n)
        return len(readers) > 1 or (bool(readers) and next(iter(readers)) != id(g))

    def readers(self, n: Node) -> frozenset:
        """Up to two of the kernels that read ``n`` (group ids; ``None``: a kernel not formed yet, or
        a graph output), looking through the ungrouped inlined nodes in between.

        Each ungrouped node's readers are computed once, as at most two distinct readers:
        two are enough to know that one of them is not a given kernel."""
        memo = self._readers
        group_of, users, outputs = self.group_of, self.users, self.outputs

        def direct(u: Node) -> frozenset | None:
            """The reader of ``u`` itself, or None when it reads through its users."""
            h = group_of.get(id(u))
            if h is not None:
                return frozenset((id(h),))
            if inlinable(u) and id(u) not in outputs:
                return memo.get(id(u))
            return frozenset((None,))

        stack = [u for u in users[n] if direct(u) is None]
        while stack:
            u = stack[-1]
            if id(u) in memo:
                stack.pop()
                continue
            pending = [w for w in users[u] if direct(w) is None]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            found: set = set()
            for w in users[u]:
                found |= direct(w)  # type: ignore[arg-type]
                if len(found) > 1:
                    break
            memo[id(u)] = frozenset(found)
            self.work.add("fusion: effective users", 1)
        readers: set = set()
        for u in users[n]:
            readers |= direct(u)  # type: ignore[arg-type]
            if len(readers) > 1:
                break
        self.work.add("fusion: effective users", 1)
        return frozenset(readers)

    # -- joins -------------------------------------------------------------------------------
    def join_reduce_group(self, n: Node) -> Group | None:
        """An earlier reduction group over the same iteration space that ``n`` depends on only
        through elementwise ops and row broadcasts (so the group can compute ``n`` after it in
        the same row loop)."""
        shape, axes = n.inputs[0].shape, n.attr("axes")
        same = [g for g in self.reachable_reductions(n.inputs[0]) if g.domain == (shape, axes)]
        if len(same) != 1:
            return None
        found = same[0]
        others = [g for g in self.reachable_groups(n.inputs[0]) if g is not found]
        if any(self.group_reaches(h, found) for h in others):  # fusing would make a cycle between kernels
            found.notes.append(f"{n.op} at {n.loc or '?'} depends on the group through another kernel: "
                               f"separate kernel")
            return None
        if not self.row_compatible(n.inputs[0], found, shape, axes):
            found.notes.append(f"{n.op} at {n.loc or '?'} reads the group's reductions through a non-broadcast "
                               f"movement: separate kernel")
            return None
        return found

    def maybe_join_epilogue(self, n: Node) -> None:
        """Fuse ``n`` into the kernel of its operands when it is that kernel's epilogue."""
        if not (is_elementwise(n.op) or n.op == "reshape"):
            return
        group_of = self.group_of
        direct = {id(g): g for g in (group_of.get(id(i)) for i in n.inputs) if g is not None}
        contractions = [g for g in direct.values() if g.kind in ("matmul", "conv", "attention")]
        for g in sorted(contractions, key=lambda g: -len(g.members)):
            # Pointwise on the accumulator (reshapes included: the element is the same); the other
            # operands are loaded, so they must not depend on this kernel.
            if n.type.numel == g.anchor.type.numel and all(group_of.get(id(i)) is g or not self.reaches(i, g)
                                                            for i in n.inputs):
                self.add(g, n)
                return
        if contractions or not is_elementwise(n.op):
            return
        reduce_groups = self.reachable_reductions(*n.inputs)
        domains = {(r.domain[0], r.domain[1]) for r in reduce_groups}
        if not reduce_groups or len(domains) != 1:
            return
        shape, axes = next(iter(domains))
        if n.shape not in (shape, _row_shape(shape, axes)):
            return
        target = reduce_groups[0]
        others = [h for h in self.reachable_groups(*n.inputs) if h.kind != "reduce"]
        if any(self.group_reaches(h, r) for h in others for r in reduce_groups):
            target.notes.append(f"{n.op} at {n.loc or '?'} also depends on the group through another kernel")
            return
        if any(self.group_reaches(a, b) for a in reduce_groups for b in reduce_groups if a is not b):
            return  # sibling groups must be independent to merge
        for other in reduce_groups[1:]:  # independent reductions over one domain: one kernel
            for m in other.members:
                group_of[id(m)] = target
            target.members += other.members
            target.notes += other.notes
            self.roots[id(target)] += self.roots.pop(id(other))
            del self.groups[id(other)]
            self._row_memo.clear()  # members moved: row compatibility may change
        if all(self.row_compatible(i, target, shape, axes) for i in n.inputs):
            self.add(target, n)

    # -- launch order --------------------------------------------------------------------------
    def dependency_order(self, groups: list[Group]) -> list[Group]:
        """``groups`` (in their given order where free) with every group after the groups it reads.

        The position of a group's last member is not enough: an epilogue joined to a reduction
        (``softmax * 2``) can come after a matmul that consumes the softmax, which would then be
        launched before its operand was computed. Kahn's algorithm, always taking the first
        ready group in the given order."""
        deps = group_dependencies(groups, self.work)
        waiting = [len(d) for d in deps]
        readers: list[list[int]] = [[] for _ in groups]
        for gi, d in enumerate(deps):
            for j in d:
                readers[j].append(gi)
        ready = [gi for gi, w in enumerate(waiting) if w == 0]
        heapq.heapify(ready)
        out: list[Group] = []
        while ready:
            gi = heapq.heappop(ready)
            out.append(groups[gi])
            for r in readers[gi]:
                waiting[r] -= 1
                if waiting[r] == 0:
                    heapq.heappush(ready, r)
        if len(out) < len(groups):  # a fusion bug: the joins are meant to keep the groups acyclic
            raise AssertionError(f"fused groups depend on each other in a cycle: {[g.anchor for g in groups]}")
        return out


def group_dependencies(groups: list[Group], work: WorkCounter | None = None) -> list[set[int]]:
    """Per group, the indices of the groups it reads: directly, or through the ungrouped nodes it
    recomputes inline (memoised per node, walked iteratively). ``work`` counts the nodes visited."""
    owner = {id(m): gi for gi, g in enumerate(groups) for m in g.members}
    inlined: dict[int, frozenset[int]] = {}  # ungrouped node -> groups it reads

    def reads_of(x: Node) -> frozenset[int]:
        stack = [x]
        while stack:
            y = stack[-1]
            if id(y) in inlined:
                stack.pop()
                continue
            pending = [i for i in y.inputs if id(i) not in owner and id(i) not in inlined]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            found: set[int] = set()
            for i in y.inputs:
                found |= {owner[id(i)]} if id(i) in owner else inlined[id(i)]
            inlined[id(y)] = frozenset(found)
            if work is not None:
                work.add("fusion: dependency order", 1)
        return inlined[id(x)]

    deps: list[set[int]] = []
    for gi, g in enumerate(groups):
        found: set[int] = set()
        for m in g.members:
            for x in m.inputs:
                found |= {owner[id(x)]} if id(x) in owner else reads_of(x)
        found.discard(gi)
        deps.append(found)
        if work is not None:
            work.add("fusion: dependency order", len(g.members))
    return deps


def _drop_stored_reshapes(groups: list[Group], stored: set[int], outputs: set[int]) -> None:
    """A stored epilogue ``reshape`` (or chain of reshapes) of another stored member is the same
    bytes: consumers can index the member's buffer instead, so the reshape leaves the kernel."""
    for g in groups:
        members = {id(m) for m in g.members}
        dropped: set[int] = set()
        kept = []
        for m in g.members:
            src = m.inputs[0] if m.op == "reshape" else m
            while src.op == "reshape" and (id(src) in dropped or (id(src) in members and id(src) not in stored)):
                src = src.inputs[0]
            if (m.op == "reshape" and id(m) in stored and id(m) not in outputs
                    and id(src) in stored and id(src) in members):
                stored.discard(id(m))
                members.discard(id(m))
                dropped.add(id(m))
            else:
                kept.append(m)
        g.members = kept
