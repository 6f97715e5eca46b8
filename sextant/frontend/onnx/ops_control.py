"""ONNX control flow: If, Loop, Scan, resolved or unrolled at compile time.

The graph IR is a flat dataflow graph without regions, so a branch is chosen by a compile-time
condition (a data-dependent one asks for ``constant_inputs``) and loops are unrolled: every
iteration inlines a fresh copy of the body (``ctx.subgraph``) with the iteration's values bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

MAX_UNROLL = 4096  # iterations; beyond this the unrolled graph would be too large to compile
SMALL_STATE = 16  # loop-carried values up to this many elements are folded when constant


def _too_long(ctx: OnnxContext, n: int | str) -> Unsupported:
    return Unsupported(f"{ctx.op_type}: {n} iterations; sextant unrolls loops at compile time (the graph IR has no "
                       f"loops) and refuses more than {MAX_UNROLL}")


NO_REGIONS = "the graph IR has no branches or loops: control flow is resolved at compile time"


def _flag(ctx: OnnxContext, x: Node, what: str) -> bool:
    value = ctx.const(x, what, NO_REGIONS)
    if value.numel() != 1:
        raise Unsupported(f"{ctx.op_type}: {what} has {value.numel()} elements, expected one")
    return bool(value.reshape(-1)[0])


def _element(b: GraphBuilder, x: Node, axis: int, t: int) -> Node:
    """``x`` indexed at ``t`` along ``axis`` (the axis dropped)."""
    part = b.slice(x, axis, t, 1)
    return b.reshape(part, x.shape[:axis] + x.shape[axis + 1:])


def _stack(ctx: OnnxContext, xs: Sequence[Node], like: Node, axis: int = 0, reverse: bool = False) -> Node:
    """The per-iteration values ``xs`` (each shaped like ``like``) stacked along a new ``axis``."""
    rank = like.type.rank + 1
    if not -rank <= axis < rank:
        raise Unsupported(f"{ctx.op_type}: scan output axis {axis} out of range for rank {rank}")
    axis %= rank
    if any(x.shape != like.shape or x.dtype != like.dtype for x in xs):
        raise Unsupported(f"{ctx.op_type}: a scan output changes shape or type between iterations")
    if not xs:
        return ctx.b.full(0, like.shape[:axis] + (0,) + like.shape[axis:], like.dtype)
    parts = [ctx.b.reshape(x, like.shape[:axis] + (1,) + like.shape[axis:]) for x in (xs[::-1] if reverse else xs)]
    return ctx.b.concat(parts, axis)


@onnx_op("If")
def _if(ctx: OnnxContext, cond: Node) -> list[Node]:
    taken = _flag(ctx, cond, "the condition")
    outs = ctx.subgraph(ctx.attr("then_branch" if taken else "else_branch"), [])
    if len(outs) < ctx.num_outputs:
        raise Unsupported(f"If: the branch has {len(outs)} outputs, the node {ctx.num_outputs}")
    return outs


@onnx_op("Loop")
def _loop(ctx: OnnxContext, m: Node | None = None, cond: Node | None = None, *initial: Node) -> list[Node]:
    """Unrolled while the trip count and the condition (known at compile time each iteration) allow;
    the body's condition output is ignored when the node has no condition input (a for loop)."""
    body = ctx.attr("body")
    trips = None if m is None else int(ctx.const(m, "the trip count M", NO_REGIONS).reshape(-1)[0])
    if trips is None and cond is None:
        raise Unsupported("Loop without trip count or condition (an infinite loop)")
    if trips is not None and cond is None and trips > MAX_UNROLL:
        raise _too_long(ctx, trips)
    going = cond is None or _flag(ctx, cond, "the initial condition")
    state: list[Node] = list(initial)
    n_state = len(state)
    dynamic: set[int] = set()  # carried values seen to depend on graph inputs: not worth folding
    scans: list[list[Node]] = []
    i = 0
    while going and (trips is None or i < trips):
        if i >= MAX_UNROLL:
            raise _too_long(ctx, f"more than {MAX_UNROLL}")
        outs = ctx.subgraph(body, [ctx.b.full(i, (), DType.i64), ctx.b.full(True, (), DType.bool), *state])
        state = outs[1:1 + n_state]
        scans.append(outs[1 + n_state:])
        for k, v in enumerate(state):  # fold small constant state (counters) so later checks stay cheap
            if k in dynamic or v.type.numel > SMALL_STATE or v.op in ("full", "param"):
                continue
            if ctx.is_const(v):
                state[k] = ctx.tensor(ctx.const(v), f"state{i}.{k}")
            else:
                dynamic.add(k)
        if cond is not None:
            going = _flag(ctx, outs[0], "the loop condition")
        i += 1
    if not scans:  # no iteration ran: the body's outputs, translated once (and left dead), give the shapes
        probe = ctx.subgraph(body, [ctx.b.full(0, (), DType.i64), ctx.b.full(True, (), DType.bool), *state])
        return [*state, *(_stack(ctx, [], like) for like in probe[1 + n_state:])]
    return [*state, *(_stack(ctx, [it[k] for it in scans], scans[0][k]) for k in range(len(scans[0])))]


def _ints(ctx: OnnxContext, name: str, n: int) -> list[int]:
    given = list(ctx.attr(name) or [])
    return [int(v) for v in given] + [0] * (n - len(given))


def _scan(ctx: OnnxContext, body: Any, state: list[Node], xs: Sequence[Node], in_axes: Sequence[int],
          in_dirs: Sequence[int], out_axes: Sequence[int], out_dirs: Sequence[int]) -> list[Node]:
    """Opset-9 Scan semantics over ``xs`` (the scan inputs) with static sequence length."""
    axes = []
    for x, a in zip(xs, in_axes):
        if not -x.type.rank <= a < x.type.rank:
            raise Unsupported(f"Scan: scan input axis {a} out of range for rank {x.type.rank}")
        axes.append(a % x.type.rank)
    lengths = {x.shape[a] for x, a in zip(xs, axes)}
    if len(lengths) != 1:
        raise Unsupported(f"Scan: scan inputs have different sequence lengths {sorted(lengths)}")
    n = lengths.pop()
    if n > MAX_UNROLL:
        raise _too_long(ctx, n)
    n_state = len(state)
    steps: list[list[Node]] = []
    for t in range(n):
        elems = [_element(ctx.b, x, a, n - 1 - t if d else t) for x, a, d in zip(xs, axes, in_dirs)]
        outs = ctx.subgraph(body, [*state, *elems])
        state = outs[:n_state]
        steps.append(outs[n_state:])
    if not steps:  # empty sequence: translate the body once (left dead) for the scan outputs' shapes
        dummy = [ctx.b.full(0, x.shape[:a] + x.shape[a + 1:], x.dtype) for x, a in zip(xs, axes)]
        likes = ctx.subgraph(body, [*state, *dummy])[n_state:]
    else:
        likes = steps[0]
    stacked = [_stack(ctx, [s[k] for s in steps], like, a, bool(d))
               for k, (like, a, d) in enumerate(zip(likes, out_axes, out_dirs))]
    return [*state, *stacked]


@onnx_op("Scan")
def _scan_op(ctx: OnnxContext, *args: Node | None) -> list[Node]:
    body = ctx.attr("body")
    m = int(ctx.attr("num_scan_inputs", 0))
    if ctx.opset >= 9:
        inits, xs = list(args[:len(args) - m]), list(args[len(args) - m:])
        n_out = len(body.output) - len(inits)
        return _scan(ctx, body, inits, xs, _ints(ctx, "scan_input_axes", m), _ints(ctx, "scan_input_directions", m),
                     _ints(ctx, "scan_output_axes", n_out), _ints(ctx, "scan_output_directions", n_out))
    # opset 8: a leading batch axis and optional per-batch sequence_lens; each batch row scans alone
    lens, rest = args[0], list(args[1:])
    inits, xs = rest[:len(rest) - m], rest[len(rest) - m:]
    if any(x is None for x in rest) or not xs:
        raise Unsupported("Scan: missing inputs")
    batch, length = xs[0].shape[0], xs[0].shape[1]
    if lens is not None and any(v != length for v in ctx.ints(lens, "sequence_lens")):
        raise Unsupported("Scan (opset 8): sequence_lens shorter than the scan inputs (ragged batches)")
    dirs = _ints(ctx, "directions", m)
    n_out = len(body.output) - len(inits)
    rows = [_scan(ctx, body, [_element(ctx.b, s, 0, r) for s in inits], [_element(ctx.b, x, 0, r) for x in xs],
                  [0] * m, dirs, [0] * n_out, [0] * n_out) for r in range(batch)]
    return [_stack(ctx, [row[k] for row in rows], rows[0][k]) for k in range(len(rows[0]))] if rows else []
