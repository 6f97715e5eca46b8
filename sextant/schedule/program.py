"""``schedule(graph, target) -> Program``: fused kernels, their launch sequence and buffers.

The program is what every target's runtime executes: a list of unique kernels
(structurally identical ones — the same layer repeated — are generated and compiled once),
launches naming the buffers each kernel reads and writes, and a memory plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sextant.errors import InputError
from sextant.graph.bind import solve
from sextant.graph.ir import Graph, Node
from sextant.graph.passes.in_place_updates import in_place_updates
from sextant.graph.reference import eval_node
from sextant.graph.symbolic import Bounds, Dim, graph_symbols, substitute
from sextant.kernel import simplify_kernel, verify_kernel
from sextant.kernel.ir import Kernel, Size
from sextant.kernel.sizes import check_binding, launch_blocks, with_sizes
from sextant.schedule import memory
from sextant.schedule.attention import attention_kernel, attention_refusal
from sextant.schedule.cpu_conv import explicit_padding, layout_conv_weights, pointwise_as_matmul
from sextant.schedule.cpu_gemv import uses_gemv
from sextant.schedule.cpu_pairs import uses_pair_dot
from sextant.schedule.cpu_panels import layout_gemm_weights, uses_panels
from sextant.schedule.gpu_kernels import GPU_MAPPINGS
from sextant.schedule.gpu_wgmma import reads_weight_in_place
from sextant.schedule.gpu_wgmma_conv import layout_hopper_conv_weights
from sextant.schedule.kernels import MAPPINGS, KernelChain, buffers_read, external_buffers, micro_tile
from sextant.schedule.overlap import overlap_collectives
from sextant.schedule.partition import Group, movement_of_param, partition
from sextant.schedule.scatter import scatter_kernel
from sextant.schedule.split_k import split_k
from sextant.schedule.target import TargetDesc
from sextant.work import WorkCounter


@dataclass(frozen=True)
class BufferInfo:
    index: int
    kind: str  # "input" | "param" | "temp" | "output"
    node: Node
    offset: int = -1  # byte offset in the arena, for temps

    @property
    def nbytes(self) -> int:
        return self.node.type.nbytes


@dataclass(frozen=True)
class ExternCall:
    """An op the runtime calls as itself between kernels (``sextant/graph/extern.py``): the launch's
    arguments are the call's operands, then one buffer per result it keeps (``results``: which)."""

    fn: str  # "aten.topk.default"
    args: str  # JSON, "$k" for the k-th operand
    kwargs: str
    results: tuple[int, ...]  # per output buffer, the index of the call's result written into it
    loc: str | None = None

    def split(self, args: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A launch's buffers as (the call's operands, the result buffers)."""
        n = len(args) - len(self.results)
        return args[:n], args[n:]


@dataclass(frozen=True)
class CollectiveCall:
    """One half of a transfer between ranks (``graph/collectives.py``) that the runtime hands to
    torch.distributed: ``stage="start"`` issues it, writing into the result buffer asynchronously;
    ``"wait"`` blocks (on a GPU: makes the stream wait) until it has arrived. Both launches name the
    same buffers — the operand, then the result — so the memory plan keeps the operand (still being
    sent) and the result (still being received) alive from start to wait."""

    kind: str  # graph/collectives.KINDS
    stage: str  # "start" | "wait"
    attrs: tuple[tuple[str, Any], ...]  # the collective node's attributes (group, reduce, ranks, ...)
    loc: str | None = None

    @property
    def fn(self) -> str:
        """A display name: ``all_reduce`` (start) or ``wait all_reduce``."""
        return self.kind if self.stage == "start" else f"wait {self.kind}"

    def split(self, args: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A launch's buffers as (what the transfer reads, what it writes)."""
        return args[:-1], args[-1:]


@dataclass(frozen=True)
class Launch:
    kernel: str  # name of a unique kernel (for a host call: a display name, not in Program.kernels)
    group: int  # index into Program.groups
    args: tuple[int, ...]  # buffer indices, in the kernel's parameter order
    blocks: Dim  # symbolic in a program over symbolic sizes: evaluated per call (Layout)
    # a host call between kernels instead of a kernel launch: an extern op, or a collective's start or wait
    extern: ExternCall | CollectiveCall | None = None


def bounded_put(cache: dict, key: object, value: object, limit: int = 256) -> None:
    """``cache[key] = value``, dropping the oldest entries past ``limit``. Caches shared by threads use
    it without a lock: a lost entry is recomputed, and an eviction another thread already made is fine."""
    cache[key] = value
    while len(cache) > limit:
        try:
            cache.pop(next(iter(cache)), None)
        except (RuntimeError, StopIteration):  # changed under us by another thread
            break


INDEX_LIMIT = 2**31 - 1 - 2**16  # elements a buffer may have: i32 indices, with room for tile rounding


@dataclass(frozen=True)
class Layout:
    """A program's sizes at one binding of its symbols: what a runner needs per call of a program
    over symbolic sizes (a static program has one, at no symbols)."""

    binding: tuple[tuple[str, int], ...]
    shapes: tuple[tuple[int, ...], ...]  # per buffer
    offsets: tuple[int, ...]  # per buffer: arena byte offset of a temp, -1 otherwise
    arena_bytes: int
    blocks: tuple[int, ...]  # per launch

    def nbytes(self, program: Program, i: int) -> int:
        return math.prod(self.shapes[i]) * program.buffers[i].node.dtype.itemsize


@dataclass
class Program:
    graph: Graph
    target: TargetDesc
    groups: list[Group]
    kernels: dict[str, Kernel]
    launches: list[Launch]
    buffers: list[BufferInfo]
    outputs: list[int]  # buffer index of each graph output
    arena_bytes: int
    constants: dict[int, torch.Tensor] = field(default_factory=dict)  # tensors of "param" buffers
    notes: list[str] = field(default_factory=list)
    # per-kernel resources ptxas reported (registers, shared bytes, spills), once a GPU target
    # assembled the program's PTX: shown in the schedule dump next to each launch
    resources: dict[str, Any] = field(default_factory=dict)
    work: WorkCounter = field(default_factory=WorkCounter)  # what scheduling did (for scaling tests)
    rewrites: list[str] = field(default_factory=list)  # graph rewrites the target's schedule made (split-K)
    # the symbols of a program over symbolic sizes (its kernels take them as arguments; buffer sizes,
    # block counts and the memory plan are evaluated per binding: layout())
    symbols: Bounds = ()
    _layouts: dict = field(default_factory=dict, repr=False, compare=False)
    _bindings: dict = field(default_factory=dict, repr=False, compare=False)  # input shapes -> binding

    def layout(self, binding: dict[str, int] | None = None) -> Layout:
        """Buffer shapes, arena offsets and block counts at ``binding`` (planned once per binding: the
        planner is a few microseconds per buffer, so each new size costs no compile)."""
        key = tuple(sorted((binding or {}).items()))
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        values = dict(key)
        shapes = tuple(tuple(substitute(b.node.shape, values)) for b in self.buffers)
        if not self.symbols:
            offsets, arena = tuple(b.offset for b in self.buffers), self.arena_bytes
        else:
            check_binding([Size(*b) for b in self.symbols], values, f"graph @{self.graph.name}")
            for b, shape in zip(self.buffers, shapes):
                if math.prod(shape) > INDEX_LIMIT:
                    raise InputError(
                        f"with {', '.join(f'{k}={v}' for k, v in key)} the value {b.node.op} at "
                        f"{b.node.loc or '?'} has {math.prod(shape)} elements: kernels index with 32-bit "
                        f"integers (at most {INDEX_LIMIT})")
            first, last = _lifetimes(self.launches)
            temps = [b.index for b in self.buffers if b.kind == "temp"]
            nbytes = [math.prod(sh) * b.node.dtype.itemsize for sh, b in zip(shapes, self.buffers)]
            offsets_by, arena = memory.plan([memory.Interval(i, nbytes[i], first[i], last[i]) for i in temps])
            offsets = tuple(offsets_by.get(b.index, -1) for b in self.buffers)
        blocks = tuple(int(substitute(la.blocks, values)) for la in self.launches)
        out = Layout(key, shapes, offsets, arena, blocks)
        bounded_put(self._layouts, key, out)  # a stream of distinct sizes must not grow memory forever
        return out

    def layout_for(self, inputs: Sequence[torch.Tensor]) -> Layout:
        """The layout a call with these inputs runs at: for a program over symbolic sizes the inputs'
        shapes bind the symbols (``graph/bind.solve``, checked; cached by shapes, as every call at a
        size seen before repeats them)."""
        if not self.symbols:
            return self.layout()
        shapes = tuple(tuple(x.shape) for x in inputs)
        binding = self._bindings.get(shapes)
        if binding is None:
            binding = solve(self.graph, shapes, self.symbols)
            bounded_put(self._bindings, shapes, binding)
        return self.layout(binding)

    def bound(self, layout: Layout) -> Program:
        """This program at one binding, for a runner that launches static grids (the CUDA runner):
        buffers with static types at their planned offsets, launches with their block counts, and
        each kernel with its launch grid and buffer sizes evaluated — still taking its size
        parameters (the same compiled code serves every binding)."""
        from sextant.graph.ir import make_node
        from sextant.kernel.sizes import instantiate_launch

        values = dict(layout.binding)
        buffers = [dataclasses.replace(b, offset=layout.offsets[b.index], node=make_node(
            "input", (), {"name": f"buffer{b.index}", "shape": layout.shapes[b.index], "dtype": b.node.dtype}))
            for b in self.buffers]
        kernels = {name: instantiate_launch(k, values) for name, k in self.kernels.items()}
        launches = [dataclasses.replace(la, blocks=blocks) for la, blocks in zip(self.launches, layout.blocks)]
        return Program(self.graph, self.target, self.groups, kernels, launches, buffers, self.outputs,
                       layout.arena_bytes, self.constants, self.notes, self.resources, self.work, self.rewrites)

    @property
    def peak_bytes(self) -> int:
        """Planned peak: the intermediate arena plus the outputs (inputs and weights excluded); for a
        program over symbolic sizes, at the sizes' upper bounds."""
        layout = self.layout({n: hi for n, _, hi in self.symbols})
        out = {i for i in self.outputs if self.buffers[i].kind == "output"}
        return layout.arena_bytes + sum(layout.nbytes(self, i) for i in out)

    def computed_nodes(self, launch: Launch) -> list[Node]:
        """The graph nodes a launch evaluates, in graph order: its group's members and every node
        inlined between them and the buffers it reads (a prologue such as softmax's ``x - max``
        belongs to no group: each kernel that reads it recomputes it)."""
        group = self.groups[launch.group]
        reads = {id(self.buffers[b].node) for b in launch.args[:len(launch.args) - len(group.outputs)]}
        seen: dict[int, Node] = {}
        stack = [*group.members, *group.outputs]
        while stack:
            n = stack.pop()
            if id(n) in seen or id(n) in reads:
                continue
            seen[id(n)] = n
            stack.extend(n.inputs)
        position = self._position
        return sorted(seen.values(), key=position.__getitem__)

    @functools.cached_property
    def output_copies(self) -> tuple[bool, ...]:
        """Per graph output, whether a runner returns a copy of its buffer: an input or a weight returned
        as itself is copied, as the module would return a new tensor — but not the new value of a tensor
        the call updates (``graph.ir.Mutation``), which is that tensor, written in place."""
        updated = {m.output for m in self.graph.mutations}
        return tuple(self.buffers[i].kind != "output" and k not in updated for k, i in enumerate(self.outputs))

    @functools.cached_property
    def _position(self) -> dict[Node, int]:
        """Graph order of every node, so a launch's nodes are sorted, not found by a scan of the graph."""
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def describe(self) -> str:
        """The schedule dump: which graph nodes went into which kernel, and refused fusions."""
        from sextant.schedule.dump import describe_program

        return describe_program(self)


def _evaluate(n: Node, graph: Graph) -> torch.Tensor:
    """The value of a node that depends on params only (a prepacked weight: a movement chain over
    a param, or a conv weight computed from several, e.g. weight norm), bottom up, iteratively."""
    values: dict[int, torch.Tensor] = {}
    stack: list[tuple[Node, bool]] = [(n, False)]
    while stack:
        x, ready = stack.pop()
        if id(x) in values:
            continue
        if ready:
            values[id(x)] = eval_node(x, [values[id(i)] for i in x.inputs], graph)
            continue
        stack.append((x, True))
        stack.extend((i, False) for i in x.inputs if id(i) not in values)
    return values[id(n)]


def prepack_weights(graph: Graph, groups: list[Group], target: TargetDesc | None = None) -> list[Node]:
    """Matmul right-hand sides that are a re-indexed weight (``permute(W)`` of a Linear layer)
    are laid out row-major once, at compile time, so the kernel reads B contiguously along its
    vectorised dimension. Returns the operand nodes that become prepacked constant buffers.
    Not those of a CPU GEMV (``cpu_gemv``: a decode step's Linear reads W in place) nor of a bf16
    GEMM on the pair dot product or with a constant weight (``cpu_panels`` lays those out in pairs of
    K or in panels instead), nor of a Hopper GEMM that reads ``Wᵀ`` in place (``gpu_wgmma``)."""
    packed = []
    for g in groups:
        if g.kind == "matmul" and not (target is not None and (uses_gemv(g, target) or uses_pair_dot(g, target)
                                                               or uses_panels(g, target)
                                                               or reads_weight_in_place(g, target))):
            b = g.anchor.inputs[1]
            if b.op != "param" and movement_of_param(b) and isinstance(b.type.numel, int):  # not a broadcast to a size
                packed.append(b)
    return packed


def finish_kernel(k: Kernel, target: TargetDesc, bounds: Bounds = (), work: WorkCounter | None = None) -> Kernel:
    """Simplify a freshly generated kernel's index arithmetic (dropping provably dead edge paths and
    bounds checks) and verify it: a scheduler bug is caught here, not as a wrong answer later.
    ``bounds``: the program's symbols, which the kernel takes as size arguments where it reads them;
    ``work`` counts what the kernel analyses did (the program's scaling tests read it)."""
    if bounds:
        k = with_sizes(k, bounds)
    k = simplify_kernel(k, work=work)
    verify_kernel(k, shared_limit=target.shared_bytes, work=work)
    return k


def _statements(body: tuple) -> int:
    """Statements in a kernel body, nested ones included."""
    count, stack = 0, list(body)
    while stack:
        s = stack.pop()
        count += 1
        stack.extend(getattr(s, "body", ()) + getattr(s, "then", ()) + getattr(s, "orelse", ()))
    return count


def schedule(graph: Graph, target: TargetDesc, work: WorkCounter | None = None) -> Program:
    """The program for ``graph`` on ``target``; ``work`` (also kept on the program) counts what
    fusion and kernel generation did."""
    work = work if work is not None else WorkCounter()
    bounds = graph_symbols(graph)
    graph = in_place_updates(graph)  # every scatter then owns its operand's buffer (idempotent)
    split_notes: list[str] = []
    if not target.is_gpu:
        graph = explicit_padding(pointwise_as_matmul(graph, micro_tile(target)[1], target))
    else:
        graph, split_notes = split_k(graph, target)
    groups = partition(graph, work, store_conv_inputs=not target.is_gpu, contiguous_rhs=not target.is_gpu,
                      attention_refusal=attention_refusal(target))
    groups = overlap_collectives(groups)
    packed = prepack_weights(graph, groups, target)
    if not target.is_gpu:
        graph, conv_weights = layout_conv_weights(graph, groups, target)
        graph, gemm_weights = layout_gemm_weights(graph, groups, target)
        packed += conv_weights + gemm_weights
    else:
        graph, conv_weights = layout_hopper_conv_weights(graph, groups, target)
        packed += conv_weights
    stored = {id(o) for g in groups for o in g.outputs} | {id(b) for b in packed}
    constants: dict[int, torch.Tensor] = {}
    buffers: list[BufferInfo] = []
    index_of: dict[int, int] = {}

    def buffer(n: Node, kind: str) -> int:
        if id(n) not in index_of:
            index_of[id(n)] = len(buffers)
            buffers.append(BufferInfo(len(buffers), kind, n))
        return index_of[id(n)]

    def operand(n: Node, computed: str = "temp") -> int:
        """The buffer a launch reads ``n`` from: an input's or a weight's own, else one of ``computed``'s kind."""
        return buffer(n, n.op if n.op in ("param", "input") else computed)

    for n in graph.inputs:
        buffer(n, "input")
    with torch.no_grad():
        for n in packed:
            constants[buffer(n, "param")] = _evaluate(n, graph).contiguous()
    for n in graph.nodes:
        if n.op == "param":
            constants[buffer(n, "param")] = graph.params[n.attr("name")]
    graph_outputs = {id(o) for o in graph.outputs}
    mappings = {**(GPU_MAPPINGS if target.is_gpu else MAPPINGS), "attention": attention_kernel,
                "scatter": scatter_kernel}
    unique: dict[tuple, str] = {}
    kernels: dict[str, Kernel] = {}
    launches: list[Launch] = []
    scratch_nodes: list[Node] = []  # a kernel chain's scratch values, appended to the graph below
    externs = 0
    transfers: dict[int, int] = {}  # collective node -> its number, in the names of its two launches
    for gi, g in enumerate(groups):
        if all(o.type.numel == 0 for o in g.outputs):
            continue  # nothing to compute: an empty output needs a buffer (allocated below), not a kernel
        if g.kind in ("collective", "wait"):  # torch.distributed's, on the host: the operand and the result
            c = g.anchor if g.kind == "collective" else g.anchor.inputs[0]
            x, out = operand(c.inputs[0]), buffer(c, "temp")
            if g.kind == "wait":  # the wait's value is the result buffer, once arrived
                _share_buffer(g.anchor, c, buffers, index_of, graph_outputs)
            call = CollectiveCall(c.attr("kind"), "start" if g.kind == "collective" else "wait",
                                  tuple((k, v) for k, v in c.attrs if k != "kind"), c.loc)
            launches.append(Launch(f"{g.kind}_{transfers.setdefault(id(c), len(transfers))}", gi, (x, out), 1, call))
            work.add("collective calls")
            continue
        if g.kind == "extern":  # an op called as itself: no kernel, its operands and results as buffers
            ins = [operand(n) for n in g.outputs[0].inputs]
            outs = [buffer(o, "output" if id(o) in graph_outputs else "temp") for o in g.outputs]
            launches.append(Launch(f"extern_{externs}", gi, tuple(ins + outs), 1, extern_call(g)))
            externs += 1
            work.add("extern calls")
            continue
        mapped = mappings[g.kind](g, stored, target, "kernel")
        # a chain (split-key attention) launches its kernels in order, its scratch between reads and outputs
        chain = mapped.kernels if isinstance(mapped, KernelChain) else (mapped,)
        scratch = mapped.scratch if isinstance(mapped, KernelChain) else ()
        scratch_nodes += scratch
        reads, writes = external_buffers(g, stored), g.outputs
        if g.kind == "scatter":  # it writes the slices into its operand's buffer, reads what computes them
            reads = buffers_read(g.anchor.inputs[1:], stored)
            _alias_update(g.anchor, buffers, index_of, graph_outputs)
        ins = [operand(n) for n in reads]
        ins += [buffer(n, "temp") for n in scratch]
        outs = [buffer(o, "output" if id(o) in graph_outputs else "temp") for o in writes]
        for k in chain:
            work.add("kernels: generated")
            work.add("kernels: statements", _statements(k.body))
            key = (dataclasses.replace(k, name=""), k.meta.get("grid"))
            name = unique.get(key)
            if name is None:
                name = f"{g.kind}_{len(kernels)}"
                unique[key] = name
                kernels[name] = finish_kernel(dataclasses.replace(k, name=name), target, bounds, work)
                work.add("kernels: finished")
            launches.append(Launch(name, gi, tuple(ins + outs), launch_blocks(k)))
    outputs = [operand(o, "output") for o in graph.outputs]
    if scratch_nodes:  # the graph names every buffer the program holds (artifacts, dumps)
        graph = graph.with_nodes((*graph.nodes, *scratch_nodes), graph.outputs)

    first, last = _lifetimes(launches)
    arena = 0
    if not bounds:  # over symbolic sizes the plan is made per binding (Program.layout)
        temps = [b for b in buffers if b.kind == "temp"]
        offsets, arena = memory.plan([memory.Interval(b.index, b.nbytes, first[b.index], last[b.index])
                                      for b in temps])
        buffers = [dataclasses.replace(b, offset=offsets[b.index]) if b.kind == "temp" else b for b in buffers]
    notes = [note for g in groups for note in g.notes]
    used = {a for launch in launches for a in launch.args} | set(outputs)
    constants = {k: v for k, v in constants.items() if k in used}
    return Program(graph, target, groups, kernels, launches, buffers, outputs, arena, constants, notes,
                   work=work, rewrites=split_notes, symbols=bounds)


def _alias_update(s: Node, buffers: list[BufferInfo], index_of: dict[int, int], graph_outputs: set[int]) -> None:
    """Scatter ``s`` gets the buffer of the operand it updates (``graph/passes/in_place_updates``
    proved it the scatter's); a temporary that is thereby returned becomes an output buffer."""
    x = s.inputs[0]
    if id(x) not in index_of or id(s) in index_of:
        raise AssertionError(f"scatter at {s.loc or '?'}: its operand has no buffer yet, or it has one already")
    if buffers[index_of[id(x)]].kind == "param":
        raise AssertionError(f"scatter at {s.loc or '?'} would overwrite a weight")
    _share_buffer(s, x, buffers, index_of, graph_outputs)


def _share_buffer(n: Node, source: Node, buffers: list[BufferInfo], index_of: dict[int, int],
                  graph_outputs: set[int]) -> None:
    """``n``'s value lives in ``source``'s buffer (a scatter's updated operand, a collective's result
    its wait reads); a temporary that is thereby returned becomes an output buffer."""
    i = index_of[id(n)] = index_of[id(source)]
    if buffers[i].kind == "temp" and id(n) in graph_outputs:
        buffers[i] = dataclasses.replace(buffers[i], kind="output")


def extern_call(g: Group) -> ExternCall:
    """The call an extern group makes: its op and arguments, and which result each output receives."""
    first = g.outputs[0]
    return ExternCall(first.attr("fn"), first.attr("args"), first.attr("kwargs"),
                      tuple(o.attr("result") for o in g.outputs), first.loc)


def _lifetimes(launches: list[Launch]) -> tuple[dict[int, int], dict[int, int]]:
    """The first and last launch that touches each buffer."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for li, launch in enumerate(launches):
        for b in launch.args:
            first.setdefault(b, li)
            last[b] = li
    return first, last

