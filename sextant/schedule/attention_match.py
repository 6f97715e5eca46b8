"""Finding attention in the graph: ``softmax(f(Q·Kᵀ))·V`` chains that become one fused kernel.

Both sources of attention reach the graph IR as the same primitive chain — sextant's SDPA
lowering (``frontend/lowerings/attention.py``) and the explicit chains HF models write
(``matmul → scale → mask → softmax → matmul``), whose softmax lowers through the same
``softmax_terms``::

    S = matmul(Q, Kᵀ)                         the scores
    Z = f(S, masks, iota, constants)          elementwise, S's rows (scale, masks, casts, batch reshapes)
    m = max(Z, -1)   e = exp(Z - m)   s = sum(e, -1)
    P = g(e / s)                              casts, and ``where(m == -inf, 0, .)`` (rows fully masked)
    O = matmul(P, V)

A fused kernel never materialises ``S``, ``Z`` or ``P``: it streams the keys and values past a
resident tile of queries with an online softmax. That is only sound when nothing else reads
those intermediates, so each condition is checked and, for a chain that reaches ``O`` through a
softmax but fails one, the reason is returned for the schedule dump.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sextant.graph.ir import Graph, Node
from sextant.graph.ops import is_elementwise
from sextant.graph.reference import constant_value
from sextant.graph.symbolic import is_symbolic
from sextant.kernel.ir import Expr
from sextant.schedule.indexing import delinearize


@dataclass(frozen=True)
class Attention:
    """One matched chain. ``members``: every node the fused kernel computes, in graph order."""

    scores: Node  # S = matmul(Q, Kᵀ)
    logits: Node  # Z, the row max's operand
    row_max: Node
    exp: Node
    row_sum: Node
    probs: Node  # P, the second matmul's left operand
    out: Node  # O = matmul(P, V)
    guarded: bool  # a row the mask hides entirely gives 0 (else NaN, as softmax of all -inf)
    members: tuple[Node, ...]
    causal: bool = False  # the logits hide every key j > query i: later key tiles can be skipped
    # boolean conditions of Z's rows: where one is false, the logit is -inf (``where(c, x, -inf)``
    # at the top of Z's chain), so a key tile that every row hides contributes exactly nothing
    masks: tuple[Node, ...] = ()

    @property
    def q(self) -> Node:
        return self.scores.inputs[0]

    @property
    def kt(self) -> Node:
        return self.scores.inputs[1]

    @property
    def v(self) -> Node:
        return self.out.inputs[1]


def at(n: Node, batch: Expr, row: Expr, col: Expr) -> tuple[Expr, ...]:
    """The index of element ``(row, col)`` of ``n`` in the attention's ``batch``-th matrix (a linear
    index over the batch dims: the chain's nodes may split them differently)."""
    lead = n.shape[:-2]
    return (*(delinearize(batch, lead) if lead else ()), row, col)


def _batch_reshape(n: Node) -> bool:
    """A reshape that only merges or splits batch dims (the last two stay): attention written as a
    3-D ``bmm`` over ``batch·heads`` between 4-D masks and views."""
    return n.op == "reshape" and n.shape[-2:] == n.inputs[0].shape[-2:] and n.type.rank >= 2 \
        and n.inputs[0].type.rank >= 2


def _same_rows(a: Node, shape: tuple, numel: int) -> bool:
    return a.shape[-2:] == shape[-2:] and a.type.numel == numel


def _strip_expand(n: Node) -> Node:
    """``n`` below its broadcasts (and the batch reshapes that add the leading dims they need)."""
    while n.op == "expand" or _batch_reshape(n):
        n = n.inputs[0]
    return n


def _is_full(n: Node, value: float) -> bool:
    n = _strip_expand(n)
    if n.op != "full":
        return False
    v = n.attr("value")
    return v == value or (math.isinf(value) and math.isinf(v) and (v > 0) == (value > 0))


def _last_axis_reduce(n: Node, fn: str) -> bool:
    return n.op == "reduce" and n.attr("fn") == fn and tuple(n.attr("axes")) == (n.inputs[0].type.rank - 1,)


def _row_guard(n: Node) -> Node | None:
    """The row max ``m`` when ``n`` is ``where(m == -inf, 0, x)`` (the fully-masked-row guard)."""
    if n.op != "where" or not _is_full(n.inputs[1], 0.0):
        return None
    cond = _strip_expand(n.inputs[0])
    if cond.op != "eq":
        return None
    a, b = cond.inputs
    if _is_full(b, -math.inf):
        return _strip_expand(a)
    if _is_full(a, -math.inf):
        return _strip_expand(b)
    return None


class _NoMatch(Exception):
    pass


def _softmax_of(probs: Node) -> tuple[Node, list[Node], Node | None]:
    """(the ``e / s`` division, the cast/guard nodes above it, the guard's row max) of ``P``."""
    above: list[Node] = []
    guard_max = None
    x = probs
    while True:
        if x.op == "cast" or _batch_reshape(x):
            above.append(x)
            x = x.inputs[0]
            continue
        m = _row_guard(x)
        if m is not None and guard_max is None:
            above.append(x)
            guard_max = m
            x = x.inputs[2]
            continue
        break
    if x.op != "div":
        raise _NoMatch("not softmax")
    return x, above, guard_max


def match_attention(graph: Graph, users: dict[Node, list[Node]]) -> tuple[list[Attention], list[tuple[Node, str]]]:
    """Every attention chain of ``graph`` that can be fused, and ``(O, reason)`` for each
    softmax-times-matrix product that looks like attention but cannot be."""
    outputs = {id(o) for o in graph.outputs}
    found: list[Attention] = []
    refused: list[tuple[Node, str]] = []
    taken: set[int] = set()
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for out in graph.nodes:
        if out.op != "matmul" or id(out) in taken:
            continue
        try:
            div, above, guard_max = _softmax_of(out.inputs[0])
        except _NoMatch:
            continue
        try:
            found.append(_match(out, div, above, guard_max, users, outputs, taken, pos, graph.params))
            taken.update(id(m) for m in found[-1].members)
        except _NoMatch as why:
            refused.append((out, str(why)))
    return found, refused


def _match(out: Node, div: Node, above: list[Node], guard_max: Node | None, users: dict[Node, list[Node]],
           outputs: set[int], taken: set[int], pos: dict[Node, int], params: Mapping[str, torch.Tensor]) -> Attention:
    e, sx = div.inputs
    s = _strip_expand(sx)
    if not (e.op == "exp" and _last_axis_reduce(s, "sum") and s.inputs[0] is e):
        raise _NoMatch("the left operand is not exp(x - max) / sum(exp(x - max)) over the last axis")
    sub = e.inputs[0]
    if sub.op != "sub":
        raise _NoMatch("the softmax does not subtract its row max")
    z, mx = sub.inputs
    m = _strip_expand(mx)
    if not (_last_axis_reduce(m, "max") and m.inputs[0] is z):
        raise _NoMatch("the softmax's shift is not the row max of its operand")
    if guard_max is not None and guard_max is not m:
        raise _NoMatch("the fully-masked-row guard tests another row max")
    chain: list[Node] = [*above, div, *_expands(sx), s, e, sub, *_expands(mx), m]
    if guard_max is not None:
        chain += _guard_nodes(above)
    # Z's producers, down to the one matmul reached through same-shape elementwise ops
    path, scores = _logit_path(z)
    chain += path
    if scores.type.rank < 2 or out.type.rank < 2:
        raise _NoMatch("scores of rank < 2")
    kt, v = scores.inputs[1], out.inputs[1]
    if v.shape[:-2] != out.shape[:-2] or v.shape[-2] != kt.shape[-1] \
            or math.prod(scores.shape[:-2]) != math.prod(out.shape[:-2]):
        raise _NoMatch("Q, K and V disagree on batch dims or sequence length")
    members = {id(n): n for n in [scores, *chain, out]}
    for n in members.values():
        if id(n) in taken:
            raise _NoMatch(f"{n.op} at {n.loc or '?'} already belongs to another attention")
        if id(n) in outputs and n is not out:
            raise _NoMatch(f"the {_role(n, scores, m, s, div)} ({n.op} at {n.loc or '?'}) is a graph output")
        if n is not out and any(id(u) not in members for u in users[n]):
            raise _NoMatch(f"the {_role(n, scores, m, s, div)} ({n.op} at {n.loc or '?'}) is also read "
                           "outside the attention")
    order = sorted(members.values(), key=pos.__getitem__)
    return Attention(scores, z, m, e, s, out.inputs[0], out, guard_max is not None, tuple(order),
                     any(_causal_where(n) or _causal_table(n, params) for n in path), _hiding_masks(z, path))


def _hiding_masks(z: Node, path: list[Node]) -> tuple[Node, ...]:
    """The conditions ``c`` of ``where(c, x, -inf)`` at the top of ``Z``'s chain (under nothing but
    more such wheres, casts and batch reshapes, which keep -inf as it is) that do not depend on the
    scores: where ``c`` is false the logit is -inf, whatever the score."""
    on_path = {id(n) for n in path}
    masks, x = [], z
    while id(x) in on_path:
        if x.op == "where" and _is_full(x.inputs[2], -math.inf) and id(x.inputs[0]) not in on_path \
                and not _reads_matmul(x.inputs[0]):
            masks.append(x.inputs[0])
            x = x.inputs[1]
        elif (x.op == "cast" and x.dtype.is_float) or _batch_reshape(x):
            x = x.inputs[0]
        else:
            break
    return tuple(masks)


def _iota_axis(n: Node) -> int | None:
    """The axis counted from the end (-1: keys, -2: queries) of an (expanded) iota."""
    n = _strip_expand(n)
    return n.attr("axis") - n.type.rank if n.op == "iota" else None


def _causal_where(n: Node) -> bool:
    """``where(key <= query, x, -inf)`` — the causal mask SDPA's lowering writes (constant folding
    keeps such index predicates, so it reaches the schedule as this comparison of iotas)."""
    if n.op != "where" or not _is_full(n.inputs[2], -math.inf):
        return False
    cond = _strip_expand(n.inputs[0])
    if cond.op not in ("le", "ge"):
        return False
    a, b = (_iota_axis(x) for x in cond.inputs)
    return (a, b) == ((-1, -2) if cond.op == "le" else (-2, -1))


def _causal_table(n: Node, params: Mapping[str, torch.Tensor]) -> bool:
    """``x + mask`` or ``where(mask, x, lowest)`` with ``mask`` a constant (no graph input reaches
    it: ``reference.constant_value``) that is the causal pattern, the same matrix for every batch and
    head: additive — 0 where key <= query, the dtype's lowest value (or -inf) above the diagonal
    (transformers' folded mask: GPT-2's eager attention) — or boolean — true on and below the
    diagonal. A hidden logit is then at most ``x - 65504`` (or -inf), whose exp underflows to
    exactly 0 beside any visible row max, so key tiles past the diagonal can be skipped as for
    ``where(key <= query, x, -inf)``. The mask is evaluated once, at schedule time."""
    q, k = n.shape[-2:] if n.type.rank >= 2 else (0, 0)
    if is_symbolic((q, k)) or q != k or q < 2:  # a constant table has constant sizes
        return False
    visible = torch.ones(q, k, dtype=torch.bool).tril()
    if n.op == "add":
        for table in n.inputs:
            t = constant_value(_strip_expand(table), params)
            if t is None or not t.dtype.is_floating_point or tuple(t.shape[-2:]) != (q, k):
                continue
            rows = t.reshape(-1, q, k)
            first, lowest = rows[0], torch.finfo(t.dtype).min
            hidden = first[~visible]
            if (bool((first[visible] == 0).all()) and bool(((hidden == lowest) | (hidden == -math.inf)).all())
                    and bool((rows == first).all())):
                return True
    if n.op == "where" and n.inputs[2].op == "full" and n.dtype.is_float:
        fill = n.inputs[2].attr("value")
        if fill not in (-math.inf, torch.finfo(n.dtype.torch).min):
            return False
        t = constant_value(_strip_expand(n.inputs[0]), params)
        if t is not None and t.dtype == torch.bool and tuple(t.shape[-2:]) == (q, k):
            rows = t.reshape(-1, q, k)
            return bool((rows == visible).all())
    return False


def _role(n: Node, scores: Node, m: Node, s: Node, div: Node) -> str:
    names = {id(scores): "score matrix", id(m): "row max", id(s): "row sum", id(div): "probability matrix"}
    return names.get(id(n), "intermediate")


def _expands(n: Node) -> list[Node]:
    out = []
    while n.op == "expand" or _batch_reshape(n):
        out.append(n)
        n = n.inputs[0]
    return out


def _guard_nodes(above: list[Node]) -> list[Node]:
    """The condition and constant nodes of the guard ``where`` (they read only the row max)."""
    out: list[Node] = []
    for w in above:
        if w.op != "where":
            continue
        stack = [w.inputs[0], w.inputs[1]]
        while stack:
            x = stack.pop()
            if (x.op in ("expand", "eq") or _batch_reshape(x)) and not _is_full(x, -math.inf):  # constants stay free
                out.append(x)
                stack.extend(x.inputs)
    return out


def _logit_path(z: Node) -> tuple[list[Node], Node]:
    """(the elementwise nodes between ``Z`` and ``S``, ``S``): ``S`` is the one matmul reached from
    ``Z`` through elementwise ops (and batch reshapes) of ``Z``'s rows; other operands of those
    ops (masks, iota, constants) are read as they are."""
    shape, numel = z.shape, z.type.numel
    path: list[Node] = []
    scores: list[Node] = []
    stack, seen = [z], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if x.op == "matmul" and _same_rows(x, shape, numel):
            scores.append(x)
        elif (is_elementwise(x.op) or _batch_reshape(x)) and _same_rows(x, shape, numel) and _reads_matmul(x):
            path.append(x)
            stack.extend(x.inputs)
    if len(scores) != 1:
        raise _NoMatch("the softmax's operand is not computed from one Q·Kᵀ by elementwise ops"
                       if not scores else "the softmax's operand reads several matmuls")
    return path, scores[0]


def _reads_matmul(x: Node, limit: int = 64) -> bool:
    """Whether a matmul is reachable from ``x`` through elementwise ops of its shape (bounded:
    mask trees are small, and a chain longer than ``limit`` is not an attention's logits)."""
    stack, seen = [x], set()
    while stack and len(seen) < limit:
        y = stack.pop()
        if id(y) in seen:
            continue
        seen.add(id(y))
        if y.op == "matmul" and _same_rows(y, x.shape, x.type.numel):
            return True
        if (is_elementwise(y.op) or _batch_reshape(y)) and _same_rows(y, x.shape, x.type.numel):
            stack.extend(y.inputs)
    return False

