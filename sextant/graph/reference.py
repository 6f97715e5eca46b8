"""Reference executor: runs a graph op by op on torch CPU tensors.

It is the oracle for every later stage, so it is written for obviousness, not speed: each
primitive maps to the torch call with the same meaning. Half-precision ops compute as torch
does on the CPU (internally in fp32 where torch does, rounded to the result type).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from sextant.graph import collectives, philox
from sextant.graph.extern import call_extern
from sextant.graph.ir import Graph, Node, topo_sort
from sextant.graph.symbolic import is_symbolic
from sextant.graph.torch_ops import BINARY as _BINARY
from sextant.graph.torch_ops import UNARY as _UNARY

_REDUCE = {"sum": torch.sum, "prod": torch.prod}


def _identity(fn: str, dtype: torch.dtype) -> int | float | bool:
    """The value a reduction over no elements yields."""
    if fn in ("sum", "prod"):
        return 0 if fn == "sum" else 1
    if dtype == torch.bool:
        return fn == "min"
    if dtype.is_floating_point:
        return -math.inf if fn == "max" else math.inf
    return torch.iinfo(dtype).min if fn == "max" else torch.iinfo(dtype).max


def _reduce(node: Node, x: torch.Tensor) -> torch.Tensor:
    fn, axes = node.attr("fn"), node.attr("axes")
    if not axes:
        return x.clone()
    if x.numel() == 0:  # the reduction's identity (torch.amax/amin reject empty dims)
        return torch.full(node.shape, _identity(fn, x.dtype), dtype=x.dtype)
    if fn in _REDUCE:
        out = x
        if fn == "prod":
            for a in sorted(axes, reverse=True):
                out = torch.prod(out, dim=a, keepdim=True)
            return out
        return torch.sum(x, dim=axes, keepdim=True, dtype=x.dtype)
    return torch.amax(x, dim=axes, keepdim=True) if fn == "max" else torch.amin(x, dim=axes, keepdim=True)


def _slice(node: Node, x: torch.Tensor) -> torch.Tensor:
    index = []
    for s, st, sz in zip(node.attr("start"), node.attr("step"), node.attr("size")):
        index.append(torch.arange(sz, dtype=torch.int64) * st + s)
    out = x
    for dim, idx in enumerate(index):
        out = out.index_select(dim, idx)
    return out


def _pad(node: Node, x: torch.Tensor) -> torch.Tensor:
    out = torch.full(node.shape, node.attr("value"), dtype=x.dtype)
    region = tuple(slice(lo, lo + d) for lo, d in zip(node.attr("low"), x.shape))
    out[region] = x
    return out


def _conv(node: Node, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    fn = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d, 5: torch.nn.functional.conv3d}[x.dim()]
    return fn(x, w, None, node.attr("stride"), node.attr("padding"), node.attr("dilation"), node.attr("groups"))


def _iota(node: Node) -> torch.Tensor:
    axis, shape = node.attr("axis"), node.shape
    r = torch.arange(shape[axis], dtype=node.dtype.torch)
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return r.reshape(view).expand(shape).contiguous()


def _scatter(node: Node, x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``x`` with ``src``'s slices written (``reduce="add"``: added) at ``index`` along the axis; a
    position outside ``x`` is dropped, as the kernels drop it (the runtime refuses such a position
    first where it can see it: ``graph/position_checks.py``); of repeated positions, the last slice
    wins, or all are summed."""
    axis = node.attr("axis")
    index = index.to(torch.int64)
    keep = (index >= 0) & (index < x.shape[axis])
    out = x.clone()
    if not bool(keep.all()):
        index, src = index[keep], src.index_select(axis, keep.nonzero().flatten())
    if node.attr("reduce") == "add":
        return out.index_add_(axis, index, src)
    return out.index_copy_(axis, index, src)


def eval_node(node: Node, args: Sequence[torch.Tensor], graph: Graph | None = None) -> torch.Tensor:
    """Evaluate one node given its operand values (``graph`` supplies param tensors)."""
    op = node.op
    if op in _UNARY:
        return _UNARY[op](args[0])
    if op in _BINARY:
        return _BINARY[op](args[0], args[1])
    if op == "where":
        return torch.where(args[0], args[1], args[2])
    if op == "cast":
        return args[0].to(node.dtype.torch)
    if op == "copy":
        return args[0].clone()
    if op == "scatter":
        return _scatter(node, *args)
    if op == "reduce":
        return _reduce(node, args[0])
    if op == "reshape":
        return args[0].reshape(node.shape)
    if op == "permute":
        return args[0].permute(node.attr("perm"))
    if op == "expand":
        return args[0].expand(node.shape)
    if op == "slice":
        return _slice(node, args[0])
    if op == "pad":
        return _pad(node, args[0])
    if op == "concat":
        return torch.cat(list(args), dim=node.attr("axis"))
    if op == "gather":
        x, idx = args
        return torch.gather(x, node.attr("axis"), idx.to(torch.int64))
    if op == "matmul":
        if node.dtype != node.inputs[0].dtype:  # a mixed-precision product: f32 accumulation and result
            return torch.matmul(args[0].float(), args[1].float())
        return torch.matmul(args[0], args[1])
    if op == "conv":
        return _conv(node, args[0], args[1])
    if op == "full":
        return torch.full(node.shape, node.attr("value"), dtype=node.dtype.torch)
    if op == "iota":
        return _iota(node)
    if op == "random":
        return philox.random(int(args[0]), node.attr("stream"), node.shape, node.dtype.torch, node.attr("dist"))
    if op == "collective":
        return collectives.start(node.attr("kind"), node.attr_dict, args[0])
    if op == "wait":
        return collectives.wait(args[0])
    if op == "extern":
        return call_extern(node.attr("fn"), node.attr("args"), node.attr("kwargs"), args)[node.attr("result")]
    if op == "param":
        if graph is None:
            raise ValueError("evaluating a param node needs the graph")
        return graph.params[node.attr("name")]
    raise NotImplementedError(f"reference executor: no rule for op {op!r}")


def constant_value(x: Node, params: Mapping[str, torch.Tensor],
                   memo: dict[int, torch.Tensor] | None = None) -> torch.Tensor | None:
    """Evaluate ``x`` if no graph input reaches it and its constant subgraph is small (at most 4M
    elements besides params); else None. ``memo`` keeps values across calls (the ONNX importer
    evaluates shape chains node by node; the attention matcher a mask table once)."""
    memo = {} if memo is None else memo
    if id(x) in memo:
        return memo[id(x)]
    order = topo_sort([x])
    if any(n.op in ("input", "collective", "wait") or not isinstance(n.type.numel, int)
           or is_symbolic(n.attr("value")) for n in order):
        return None  # an input, a transfer, or a size only a call knows, reaches it
    if sum(n.type.numel for n in order if n.op != "param") > 1 << 22:
        return None  # large constant subgraphs stay in the graph (constant folding may still run them)
    env: dict[int, torch.Tensor] = {}
    for n in order:
        if id(n) in memo:
            env[id(n)] = memo[id(n)]
            continue
        env[id(n)] = params[n.attr("name")] if n.op == "param" else eval_node(n, [env[id(i)] for i in n.inputs])
        memo[id(n)] = env[id(n)]
    return env[id(x)]


def run_graph(graph: Graph, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``graph`` on flat input tensors; returns the flat outputs (contiguous CPU tensors). A
    graph with symbolic sizes runs at the sizes its inputs give (``sextant/graph/bind.py``)."""
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"graph @{graph.name} takes {len(graph.inputs)} inputs, got {len(inputs)}")
    from sextant.graph.bind import bind, is_symbolic_graph, solve

    if is_symbolic_graph(graph):
        graph = bind(graph, solve(graph, [tuple(x.shape) for x in inputs]))
    env: dict[int, torch.Tensor] = {}
    for node, value in zip(graph.inputs, inputs):
        env[id(node)] = value
    remaining = {id(n): 0 for n in graph.nodes}
    for n in graph.nodes:
        for i in n.inputs:
            remaining[id(i)] += 1
    keep = {id(o) for o in graph.outputs}
    with torch.no_grad():
        for node in graph.nodes:
            if node.op == "input":
                continue
            env[id(node)] = eval_node(node, [env[id(i)] for i in node.inputs], graph)
            for i in node.inputs:  # free intermediates as soon as their last user ran
                remaining[id(i)] -= 1
                if remaining[id(i)] == 0 and id(i) not in keep:
                    env.pop(id(i), None)
    return [env[id(o)].contiguous() for o in graph.outputs]
