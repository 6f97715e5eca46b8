"""GraphBuilder: a tiny tensor API that emits graph-IR nodes.

Lowerings of ATen ops are written against it, so a lowering reads like the math: the
builder inserts the explicit ``expand``/``reshape``/``cast`` nodes that the primitive ops
require (numpy broadcasting rules), and turns Python scalars into ``full`` nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, InputLeaf, Mutation, Node, make_node
from sextant.graph.symbolic import SymbolicShapeError, SymDim

Operand = Node | int | float | bool


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for i, d in enumerate((1,) * (rank - len(s)) + tuple(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError(f"shapes {[list(x) for x in shapes]} do not broadcast")
                out[i] = d
    return tuple(out)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Views of the same memory with the same layout (``detach().contiguous()`` makes new objects)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


class GraphBuilder:
    """Accumulates nodes in definition order; ``loc`` is attached to every node emitted."""

    def __init__(self, name: str = "main") -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.inputs: list[Node] = []
        self.params: dict[str, torch.Tensor] = {}
        self.loc: str | None = None
        self._seed: Node | None = None
        self._streams = 0

    # -- sources ---------------------------------------------------------------------------
    def emit(self, op: str, inputs: Sequence[Node] = (), **attrs: object) -> Node:
        node = make_node(op, inputs, attrs, self.loc)
        self.nodes.append(node)
        return node

    def input(self, name: str, shape: Sequence[int], dtype: DType) -> Node:
        node = self.emit("input", name=name, index=len(self.inputs), shape=tuple(shape), dtype=dtype)
        self.inputs.append(node)
        return node

    def param(self, name: str, tensor: torch.Tensor) -> Node:
        """A named constant. The same tensor may be named twice (one param); a name already taken by a
        different tensor gets a ``.1``, ``.2``, ... suffix (an ONNX initializer and a constant a
        lowering makes may otherwise meet), so no tensor is ever replaced."""
        tensor = tensor.detach().contiguous()
        key, k = name, 0
        while key in self.params and not _same_tensor(self.params[key], tensor):
            k += 1
            key = f"{name}.{k}"
        self.params[key] = tensor
        return self.emit("param", name=key, shape=tuple(tensor.shape), dtype=DType.from_torch(tensor.dtype))

    def full(self, value: int | float | bool, shape: Sequence[int], dtype: DType) -> Node:
        if isinstance(value, SymDim):  # a symbolic size as a tensor value (e.g. wrapping a negative index)
            if dtype == DType.bool:
                raise SymbolicShapeError(f"the size {value} as a bool value")
            if not dtype.is_int:  # x * x.shape[1]: the size as an integer fill, cast (as torch converts it)
                return self.cast(self.emit("full", value=value, shape=tuple(shape), dtype=DType.i64), dtype)
        else:
            value = bool(value) if dtype == DType.bool else int(value) if dtype.is_int else float(value)
        return self.emit("full", value=value, shape=tuple(shape), dtype=dtype)

    def iota(self, shape: Sequence[int], axis: int, dtype: DType = DType.i64) -> Node:
        return self.emit("iota", shape=tuple(shape), axis=axis, dtype=dtype)

    def arange(self, n: int, dtype: DType = DType.i64) -> Node:
        return self.iota((n,), 0, dtype)

    def random(self, shape: Sequence[int], dtype: DType, dist: str = "uniform") -> Node:
        """Random numbers (``dist``: "uniform" in [0, 1) or "normal"), each op its own Philox stream
        of the per-call seed, which becomes the graph's last input (``Graph.seed``) on first use."""
        if self._seed is None:
            loc, self.loc = self.loc, None
            self._seed = self.input("rng_seed", (), DType.i64)
            self.loc = loc
        self._streams += 1
        return self.emit("random", [self._seed], shape=tuple(shape), dtype=dtype, dist=dist,
                         stream=self._streams - 1)

    def build(self, outputs: Sequence[Node], in_spec: object = None, out_spec: object = None,
              leaves: Sequence[InputLeaf] = (), mutations: Sequence[Mutation] = ()) -> Graph:
        seed = None if self._seed is None else self._seed.attr("index")
        if seed is not None and seed != len(self.inputs) - 1:
            raise ValueError("the seed input must be the graph's last input (no input may follow a random op)")
        return Graph(self.name, tuple(self.nodes), tuple(self.inputs), tuple(outputs), dict(self.params),
                     in_spec, out_spec, tuple(leaves), tuple(mutations), seed=seed)

    # -- conversions -----------------------------------------------------------------------
    def cast(self, x: Node, dtype: DType) -> Node:
        return x if x.dtype == dtype else self.emit("cast", [x], dtype=dtype)

    def const_like(self, value: Operand, like: Node, dtype: DType | None = None) -> Node:
        """A Python scalar as a node of ``like``'s shape (nodes pass through, cast to dtype)."""
        dtype = dtype or like.dtype
        if isinstance(value, Node):
            return self.cast(value, dtype)
        return self.full(value, like.shape, dtype)

    def broadcast_to(self, x: Node, shape: Sequence[int]) -> Node:
        shape = tuple(shape)
        if x.shape == shape:
            return x
        if x.type.rank < len(shape):
            x = self.reshape(x, (1,) * (len(shape) - x.type.rank) + x.shape)
        return self.expand(x, shape)

    def broadcast(self, *xs: Node) -> list[Node]:
        shape = broadcast_shapes(*(x.shape for x in xs))
        return [self.broadcast_to(x, shape) for x in xs]

    def _operands(self, values: Sequence[Operand], dtype: DType | None) -> list[Node]:
        nodes = [v for v in values if isinstance(v, Node)]
        if not nodes:
            raise ValueError("at least one operand must be a tensor")
        dtype = dtype or nodes[0].dtype
        shape = broadcast_shapes(*(n.shape for n in nodes))
        out = []
        for v in values:
            v = self.cast(v, dtype) if isinstance(v, Node) else self.full(v, shape, dtype)
            out.append(self.broadcast_to(v, shape))
        return out

    # -- elementwise -----------------------------------------------------------------------
    def unary(self, op: str, x: Node) -> Node:
        return self.emit(op, [x])

    def binary(self, op: str, a: Operand, b: Operand, dtype: DType | None = None) -> Node:
        """``op(a, b)`` with broadcasting; operands are cast to ``dtype`` (default: first tensor's)."""
        x, y = self._operands([a, b], dtype)
        return self.emit(op, [x, y])

    def where(self, cond: Node, a: Operand, b: Operand, dtype: DType | None = None) -> Node:
        x, y = self._operands([a, b], dtype)
        c, x, y = self.broadcast(self.cast(cond, DType.bool), x, y)
        return self.emit("where", [c, x, y])

    def add(self, a: Operand, b: Operand) -> Node:
        return self.binary("add", a, b)

    def sub(self, a: Operand, b: Operand) -> Node:
        return self.binary("sub", a, b)

    def mul(self, a: Operand, b: Operand) -> Node:
        return self.binary("mul", a, b)

    def div(self, a: Operand, b: Operand) -> Node:
        return self.binary("div", a, b)

    def maximum(self, a: Operand, b: Operand) -> Node:
        return self.binary("maximum", a, b)

    def minimum(self, a: Operand, b: Operand) -> Node:
        return self.binary("minimum", a, b)

    # -- reductions ------------------------------------------------------------------------
    def reduce(self, fn: str, x: Node, axes: Sequence[int], keepdim: bool = True) -> Node:
        axes = tuple(sorted({a % x.type.rank for a in axes})) if x.type.rank else ()
        out = self.emit("reduce", [x], fn=fn, axes=axes)
        if not keepdim:
            out = self.reshape(out, tuple(d for i, d in enumerate(x.shape) if i not in axes))
        return out

    def mean(self, x: Node, axes: Sequence[int], keepdim: bool = True) -> Node:
        axes = [a % x.type.rank for a in axes] if x.type.rank else []
        count = math.prod(x.shape[a] for a in set(axes))
        s = self.reduce("sum", x, axes, keepdim)
        return self.div(s, count) if count else self.mul(s, float("nan"))  # a symbolic count: see full()

    # -- movement --------------------------------------------------------------------------
    def reshape(self, x: Node, shape: Sequence[int]) -> Node:
        shape = tuple(shape)
        return x if x.shape == shape else self.emit("reshape", [x], shape=shape)

    def permute(self, x: Node, perm: Sequence[int]) -> Node:
        perm = tuple(p % x.type.rank for p in perm) if x.type.rank else ()
        return x if perm == tuple(range(len(perm))) else self.emit("permute", [x], perm=perm)

    def transpose(self, x: Node, a: int, b: int) -> Node:
        perm = list(range(x.type.rank))
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(x, perm)

    def expand(self, x: Node, shape: Sequence[int]) -> Node:
        shape = tuple(shape)
        return x if x.shape == shape else self.emit("expand", [x], shape=shape)

    def slice(self, x: Node, dim: int, start: int, size: int, step: int = 1) -> Node:
        """Elements ``start, start+step, ...`` (``size`` of them) along ``dim``."""
        dim %= x.type.rank
        if start == 0 and step == 1 and size == x.shape[dim]:
            return x
        starts = [0] * x.type.rank
        steps = [1] * x.type.rank
        sizes = list(x.shape)
        starts[dim], steps[dim], sizes[dim] = (start if size else 0), step, size
        return self.emit("slice", [x], start=tuple(starts), step=tuple(steps), size=tuple(sizes))

    def pad(self, x: Node, low: Sequence[int], high: Sequence[int], value: int | float | bool = 0) -> Node:
        """Pad (or, for negative amounts, crop) each dim."""
        for d, (lo, hi) in enumerate(zip(low, high)):
            if lo < 0:
                x = self.slice(x, d, -lo, x.shape[d] + lo)
            if hi < 0:
                x = self.slice(x, d, 0, x.shape[d] + hi)
        low = tuple(max(v, 0) for v in low)
        high = tuple(max(v, 0) for v in high)
        if not any(low) and not any(high):
            return x
        if x.dtype == DType.bool:
            value = bool(value)
        elif x.dtype.is_int:
            value = int(value)
        else:
            value = float(value)
        return self.emit("pad", [x], low=low, high=high, value=value)

    def concat(self, xs: Sequence[Node], axis: int) -> Node:
        xs = [x for x in xs if x.shape[axis] > 0] or list(xs[:1])
        return xs[0] if len(xs) == 1 else self.emit("concat", list(xs), axis=axis % xs[0].type.rank)

    def scatter(self, x: Node, axis: int, index: Node, src: Node, reduce: str | None = None) -> Node:
        """``x`` with ``src``'s slices along ``axis`` written at positions ``index`` (1-D);
        ``reduce="add"``: added there instead, slices at a repeated position summed."""
        attrs = {"reduce": reduce} if reduce is not None else {}
        return self.emit("scatter", [x, index, src], axis=axis % x.type.rank, **attrs)

    def gather(self, x: Node, axis: int, index: Node) -> Node:
        return self.emit("gather", [x, index], axis=axis % x.type.rank)

    def take(self, x: Node, axis: int, index: Node) -> Node:
        """numpy.take: select along ``axis`` by an index tensor of any shape (index_select/embedding)."""
        axis %= x.type.rank
        flat = self.reshape(index, (index.type.numel,))
        pre, post = x.shape[:axis], x.shape[axis + 1:]
        idx = self.reshape(flat, (1,) * len(pre) + (index.type.numel,) + (1,) * len(post))
        idx = self.expand(idx, pre + (index.type.numel,) + post)
        out = self.gather(x, axis, idx)
        return self.reshape(out, pre + index.shape + post)

    # -- compute ---------------------------------------------------------------------------
    def matmul(self, a: Node, b: Node) -> Node:
        """torch.matmul semantics: 1-D operands and broadcasting batch dims."""
        a1, b1 = a.type.rank == 1, b.type.rank == 1
        if a1:
            a = self.reshape(a, (1, a.shape[0]))
        if b1:
            b = self.reshape(b, (b.shape[0], 1))
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a = self.broadcast_to(a, batch + a.shape[-2:])
        b = self.broadcast_to(b, batch + b.shape[-2:])
        out = self.emit("matmul", [a, b])
        shape = list(out.shape)
        if b1:
            shape.pop(-1)
        if a1:
            shape.pop(-2 if not b1 else -1)
        return self.reshape(out, shape)
