"""Algebraic simplification: remove identity ops, written as declarative pattern rules.

Each rule only ever returns an existing node or a single merged movement op, and the
:class:`PatternRewriter` discards any replacement whose type differs from the node it
replaces (so e.g. ``logical_not(logical_not(x))`` on a float ``x`` is left alone).

``x + 0 -> x`` holds for every value except ``-0.0 + 0.0`` (which is ``+0.0``); like XLA's
algebraic simplifier we accept that signed-zero difference.
"""

from __future__ import annotations

from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node, make_node
from sextant.graph.passes.rewrite import P, PatternRewriter

# Casts that represent every source value exactly, so casting back restores it.
_LOSSLESS = {
    DType.bool: {DType.i32, DType.i64, DType.f16, DType.bf16, DType.f32},
    DType.i32: {DType.i64},
    DType.f16: {DType.f32},
    DType.bf16: {DType.f32},
}


def _is_whole_slice(s: Node, x: Node) -> bool:
    return all(sz == d and (sz <= 1 or (st == 1 and start == 0))
               for start, st, sz, d in zip(s.attr("start"), s.attr("step"), s.attr("size"), x.shape))


def _merge_reshapes(r: Node, x: Node) -> Node:
    return make_node("reshape", [x], {"shape": r.shape}, r.loc)


def _merge_permutes(p: Node, inner: Node, x: Node) -> Node:
    outer, first = p.attr("perm"), inner.attr("perm")
    return make_node("permute", [x], {"perm": tuple(first[i] for i in outer)}, p.loc)


def _cast_roundtrip(c: Node, mid: Node, x: Node) -> Node | None:
    return x if c.dtype == x.dtype and mid.dtype in _LOSSLESS.get(x.dtype, ()) else None


x, y = P.var("x"), P.var("y")

RULES: list = [
    # arithmetic identities (elementwise operands have identical shapes, so these keep the type)
    (P("add", x, P.full(0)), lambda x: x),
    (P("add", P.full(0), x), lambda x: x),
    (P("sub", x, P.full(0)), lambda x: x),
    (P("mul", x, P.full(1)), lambda x: x),
    (P("mul", P.full(1), x), lambda x: x),
    (P("div", x, P.full(1)), lambda x: x),
    (P("neg", P("neg", x)), lambda x: x),
    (P("logical_not", P("logical_not", x)), lambda x: x),
    # movement ops that do nothing, and chains that collapse into one op
    (P("reshape", x, name="r"), lambda r, x: x if r.shape == x.shape else None),
    (P("reshape", P("reshape", x), name="r"), _merge_reshapes),
    (P("permute", x, name="p"), lambda p, x: x if p.attr("perm") == tuple(range(x.type.rank)) else None),
    (P("permute", P("permute", x, name="inner"), name="p"), _merge_permutes),
    (P("expand", x, name="e"), lambda e, x: x if e.shape == x.shape else None),
    (P("slice", x, name="s"), lambda s, x: x if _is_whole_slice(s, x) else None),
    (P("pad", x, name="p"), lambda p, x: x if not any(p.attr("low") + p.attr("high")) else None),
    (P("concat", x), lambda x: x),
    # casts
    (P("cast", x, name="c"), lambda c, x: x if c.dtype == x.dtype else None),
    (P("cast", P("cast", x, name="mid"), name="c"), _cast_roundtrip),
    # selects
    (P("where", P.full(True), x, y), lambda x, y: x),
    (P("where", P.full(False), x, y), lambda x, y: y),
    (P("where", P.var("c"), x, x), lambda c, x: x),
]

simplifier = PatternRewriter(RULES)


def simplify(graph: Graph) -> Graph:
    """Apply :data:`RULES` to a fixed point; returns ``graph`` itself if no rule fired."""
    return simplifier(graph)
