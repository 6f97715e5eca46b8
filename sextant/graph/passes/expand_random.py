"""Expand each ``random`` op into the integer arithmetic of Philox4x32-10 (``graph/philox.py``).

After this pass a random tensor is ordinary elementwise math on ``iota`` (the element index)
and the seed, so it needs nothing new below the graph IR: the partitioner fuses it into the
kernel that uses it (a dropout mask is computed where it is applied, never stored), and every
backend (CPU, cuda-sim, PTX) runs the same rounds, bit for bit. 32-bit words live in ``i64``
values: a 32×32-bit product fits 64 bits, wrapping in ``i64`` keeps its low 64 bits, and
``>> 32`` then ``& 0xFFFFFFFF`` recover the high word whatever the sign.
"""

from __future__ import annotations

import math

from sextant.graph import philox
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node, make_node
from sextant.graph.passes.rewrite import rebuild
from sextant.graph.symbolic import Dim

I64 = DType.i64


class _Emit:
    """make_node over one shape with scalars broadcast; every node gets the random op's ``loc``."""

    def __init__(self, shape: tuple[Dim, ...], loc: str | None) -> None:
        self.shape, self.loc = shape, loc

    def const(self, value: int | float, dtype: DType = I64) -> Node:
        return make_node("full", (), {"value": value, "shape": self.shape, "dtype": dtype}, self.loc)

    def op(self, op: str, a: Node, b: Node | int | float) -> Node:
        if not isinstance(b, Node):
            b = self.const(b, a.dtype)
        return make_node(op, (a, b), loc=self.loc)

    def unary(self, op: str, a: Node) -> Node:
        return make_node(op, (a,), loc=self.loc)

    def cast(self, a: Node, dtype: DType) -> Node:
        return a if a.dtype == dtype else make_node("cast", (a,), {"dtype": dtype}, self.loc)

    def broadcast(self, scalar: Node) -> Node:
        """An ``i64[]`` value at every element."""
        if not self.shape:
            return scalar
        one = make_node("reshape", (scalar,), {"shape": (1,) * len(self.shape)}, self.loc)
        return make_node("expand", (one,), {"shape": self.shape}, self.loc)

    def index(self) -> Node:
        """The row-major element index, ``sum(iota_d * stride_d)``."""
        total: Node | None = None
        for axis in range(len(self.shape)):
            stride = math.prod(self.shape[axis + 1:]) if self.shape[axis + 1:] else 1
            term = make_node("iota", (), {"shape": self.shape, "axis": axis, "dtype": I64}, self.loc)
            if not (isinstance(stride, int) and stride == 1):
                term = self.op("mul", term, self.const(stride))
            total = term if total is None else self.op("add", total, term)
        return total if total is not None else self.const(0)


def _words(e: _Emit, seed: Node, stream: int) -> tuple[Node, ...]:
    """Philox's four words at every element, as graph-IR i64 ops (graph/philox.py's rounds)."""
    mask = philox.MASK
    s = e.broadcast(seed)
    idx = e.op("add", e.index(), e.op("bitwise_and", e.op("shr", s, 1), philox.OFFSET))
    c0, c1 = e.op("bitwise_and", idx, mask), e.op("bitwise_and", e.op("shr", idx, 32), mask)
    c2, c3 = e.const(stream & mask), e.const(0)
    k0, k1 = e.op("bitwise_and", s, mask), e.op("bitwise_and", e.op("shr", s, 32), mask)
    for r in range(philox.ROUNDS):
        if r:
            k0 = e.op("bitwise_and", e.op("add", k0, philox.W0), mask)
            k1 = e.op("bitwise_and", e.op("add", k1, philox.W1), mask)
        p0, p1 = e.op("mul", c0, philox.M0), e.op("mul", c2, philox.M1)
        hi0, lo0 = e.op("bitwise_and", e.op("shr", p0, 32), mask), e.op("bitwise_and", p0, mask)
        hi1, lo1 = e.op("bitwise_and", e.op("shr", p1, 32), mask), e.op("bitwise_and", p1, mask)
        c0 = e.op("bitwise_xor", e.op("bitwise_xor", hi1, c1), k0)
        c2 = e.op("bitwise_xor", e.op("bitwise_xor", hi0, c3), k1)
        c1, c3 = lo1, lo0
    return c0, c1, c2, c3


def _uniform(e: _Emit, word: Node, dtype: DType, open_low: bool = False) -> Node:
    """graph/philox.py's ``to_uniform``: the word's top mantissa bits, scaled into [0, 1)."""
    bits = philox.MANTISSA[dtype.torch]
    top = e.op("shr", word, 32 - bits)
    if open_low:
        top = e.op("add", top, 1)
    return e.cast(e.op("mul", e.cast(top, DType.f32), 2.0 ** -bits), dtype)


def expansion(node: Node) -> Node:
    """The graph-IR ops computing ``random`` node ``node``."""
    e = _Emit(node.shape, node.loc)
    w = _words(e, node.inputs[0], node.attr("stream"))
    if node.attr("dist") == "uniform":
        return _uniform(e, w[0], node.dtype)
    u1, u2 = _uniform(e, w[0], DType.f32, open_low=True), _uniform(e, w[1], DType.f32)
    radius = e.unary("sqrt", e.op("mul", e.unary("log", u1), -2.0))
    return e.cast(e.op("mul", radius, e.unary("cos", e.op("mul", u2, 2 * math.pi))), node.dtype)


def expand_random(graph: Graph) -> Graph:
    """Replace every ``random`` op by its Philox arithmetic; other graphs are returned unchanged."""
    if not any(n.op == "random" for n in graph.nodes):
        return graph
    return rebuild(graph, lambda n: expansion(n) if n.op == "random" else None)
