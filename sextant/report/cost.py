"""What each kernel launch must do, independent of how well it does it: FLOPs and minimum bytes.

These are the two numbers a roofline needs (:mod:`sextant.report.roofline`). They count the
*algorithm* a launch implements, not the instructions the schedule happens to emit, so they
stay comparable across schedules and targets.

What counts as a FLOP (per element of the op's result unless said otherwise):

- ``matmul``: 2·M·N·K (a multiply and an add per term of every dot product, batch included);
- ``conv``: 2·N·C_out·(spatial out)·(C_in/groups)·(kernel volume);
- ``reduce``: one combine per input element folded in, i.e. ``numel(in) - numel(out)``;
- unary and binary math, comparisons and ``where``: 1 each — ``exp``/``tanh``/``erf``… too,
  though the GPU spends several instructions on them (these, and ``pow``, are also tallied
  apart as *transcendentals*);
- ``cast``, movement ops (reshape, permute, expand, slice, pad, concat, gather), ``full`` and
  ``iota``: 0 — they are index arithmetic or data movement, not math.

Minimum bytes: every buffer the launch reads is read once and every buffer it writes is
written once. A buffer reached only through ``slice`` or as the source of ``gather`` counts
just the elements those ops select (an embedding lookup reads its rows, not the table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.ops import BINARY, MOVEMENT, UNARY, UNARY_FLOAT
from sextant.graph.symbolic import SymbolicShapeError
from sextant.schedule.program import Launch, Program

FREE_OPS = MOVEMENT | {"cast", "full", "iota", "input", "param"}
_SELECTING = ("slice", "gather")  # ops that may read only part of their (first) operand
_SAME_ELEMENTS = ("reshape", "permute")  # one-to-one re-indexing: needs flow through unchanged


@dataclass(frozen=True)
class LaunchCost:
    """FLOPs and minimum memory traffic of one kernel launch."""

    launch: int  # index into Program.launches
    kernel: str
    kind: str  # the fused group's kind: "elementwise" | "reduce" | "matmul" | "conv" | "attention"
    dtype: DType  # element type of the group's anchor: selects the compute peak
    flops: int
    transcendentals: int  # of ``flops``, those that are exp/log/tanh/erf/... (special-function units)
    bytes_read: int
    bytes_written: int
    blocks: int
    flops_by_op: dict[str, int] = field(default_factory=dict)
    tensor_core: bool = False  # the kernel's products run on tensor cores (the roofline's compute peak)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte of minimum traffic."""
        return self.flops / self.bytes if self.bytes else math.inf


def node_flops(n: Node) -> int:
    """FLOPs of one graph node, by the rules in this module's docstring."""
    if n.op == "matmul":
        return 2 * n.type.numel * n.inputs[0].shape[-1]
    if n.op == "conv":
        w = n.inputs[1].shape  # [C_out, C_in/groups, *kernel]
        return 2 * n.type.numel * math.prod(w[1:])
    if n.op == "reduce":
        return n.inputs[0].type.numel - n.type.numel
    if n.op in UNARY or n.op in BINARY or n.op == "where":
        return n.type.numel
    if n.op == "scatter" and n.attr("reduce") == "add":  # one add per element of the slices
        return n.inputs[2].type.numel
    if n.op in FREE_OPS or n.op in ("extern", "scatter", "copy", "collective", "wait"):  # host calls: not modelled;
        return 0  # scatter and copy move bytes only
    raise ValueError(f"cost model: no FLOP rule for op {n.op!r}")


def split_args(program: Program, launch: Launch) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A launch's buffer arguments as (read, written): the schedule passes its group's outputs last."""
    outputs = program.groups[launch.group].outputs
    cut = len(launch.args) - len(outputs)
    reads, writes = launch.args[:cut], launch.args[cut:]
    group = program.groups[launch.group]
    # a scatter writes in place into its operand's buffer (schedule/scatter.py); a wait's value is its
    # collective's result buffer, once arrived (schedule/program.py)
    if group.kind in ("scatter", "wait"):
        outputs = [group.anchor.inputs[0]]
    if [id(program.buffers[b].node) for b in writes] != [id(o) for o in outputs]:
        raise ValueError(f"launch of {launch.kernel}: its last {len(outputs)} argument(s) are not its group's "
                         "outputs; the cost model relies on Program's (inputs..., outputs...) argument order")
    return reads, writes


def _needed_elements(v: Node, users: dict[int, list[Node]]) -> int:
    """How many elements of ``v`` the launch must read, given how its users (inside the launch)
    index it. Each node's answer is computed once, users first, on an explicit stack: chains and
    diamonds of re-indexing ops cost their size, not their depth in frames or their path count."""
    memo: dict[int, int] = {}

    def through(u: Node, x: Node) -> bool:
        """Whether ``u`` passes on which elements of its operand ``x`` it needs."""
        selecting = u.op in _SELECTING and u.inputs[0] is x and not (u.op == "gather" and u.inputs[1] is x)
        return selecting or u.op in _SAME_ELEMENTS or u.op == "expand"

    stack = [v]
    while stack:
        x = stack[-1]
        if id(x) in memo:
            stack.pop()
            continue
        pending = [u for u in users.get(id(x), []) if through(u, x) and id(u) not in memo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        total = 0
        for u in users.get(id(x), []):
            if not through(u, x):
                total = x.type.numel
                break
            total += min(u.type.numel, memo[id(u)] or u.type.numel) if u.op in _SELECTING and u.inputs[0] is x \
                else memo[id(u)] or u.type.numel
            if total >= x.type.numel:
                total = x.type.numel
                break
        memo[id(x)] = total
    return memo[id(v)]


def launch_cost(program: Program, index: int) -> LaunchCost:
    if program.symbols:  # flops and bytes would be polynomials of the sizes
        raise SymbolicShapeError("the cost report needs a static program: compile without dynamic_shapes (or "
                                 "bind the graph to one size) to report on it")
    launch = program.launches[index]
    group = program.groups[launch.group]
    nodes = program.computed_nodes(launch)
    inside = {id(n) for n in nodes}
    users: dict[int, list[Node]] = {}
    for n in nodes:
        for i in n.inputs:
            users.setdefault(id(i), []).append(n)
    by_op: dict[str, int] = {}
    transcendentals = 0
    for n in nodes:
        f = node_flops(n)
        if f:
            by_op[n.op] = by_op.get(n.op, 0) + f
            if n.op in UNARY_FLOAT or n.op == "pow":
                transcendentals += f
    reads, writes = split_args(program, launch)
    bytes_read = 0
    for b in dict.fromkeys(reads):  # a buffer passed twice is read once
        node = program.buffers[b].node
        if id(node) in inside:
            continue
        bytes_read += _needed_elements(node, users) * node.dtype.itemsize
    bytes_written = sum(program.buffers[b].nbytes for b in dict.fromkeys(writes))
    if group.kind == "scatter":  # only the slices it writes (an adding one reads them first)
        bytes_written = group.anchor.inputs[2].type.nbytes
        if group.anchor.attr("reduce") == "add":
            bytes_read += bytes_written
    # a contraction computes in its operands' type (split-K's partial product: f16 inputs, f32 out)
    compute_dtype = group.anchor.inputs[0].dtype if group.kind in ("matmul", "conv") else group.anchor.dtype
    chain = [i for i, la in enumerate(program.launches) if la.group == launch.group and la.extern is None]
    if len(chain) > 1:  # a kernel chain (split-key attention, ``schedule.kernels.KernelChain``): the first
        # kernel computes the group (epilogue included, as an approximation) into the scratch buffers, the
        # others only carry the scratch on; the last writes the outputs
        scratch = sum(program.buffers[b].nbytes for b in dict.fromkeys(reads)
                      if program.buffers[b].node.attr("scratch") is not None)
        if index != chain[0]:
            by_op, transcendentals, bytes_read = {}, 0, scratch
        if index != chain[-1]:
            bytes_written = scratch
    return LaunchCost(index, launch.kernel, group.kind, compute_dtype, sum(by_op.values()), transcendentals,
                      bytes_read, bytes_written, launch.blocks, dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
                      launch.extern is None and "tensor-core" in program.kernels[launch.kernel].meta.get("mapping", ""))


def program_costs(program: Program) -> list[LaunchCost]:
    """The cost of every launch of ``program``, in launch order."""
    return [launch_cost(program, i) for i in range(len(program.launches))]
