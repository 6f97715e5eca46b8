"""Constant folding, in two stages.

1. Ops on ``full`` operands whose result is uniform become a ``full`` again (elementwise ops,
   casts, movement, reductions). Elementwise values are computed by the reference executor
   on one-element tensors, so they match it bit for bit (integer division, casts, ...);
   ``sum``/``prod`` of a full are ``value*count``/``value**count``, rounded once (integers wrap);
   a reduction over no elements is its identity (``-inf`` for a float ``max``), as in the reference.
2. Any other node whose operands are all compile-time constants (``full``, ``iota``, or
   nodes folded already) is evaluated with the reference executor and becomes a ``param``
   named ``folded.<n>`` (or a ``full`` if the result is uniform) — e.g. the rotary tables
   built from ``arange``. A comparison of two iotas (the causal mask ``key <= query``) is the
   exception: it stays, since a kernel recomputes it with a compare and a fused attention kernel
   recognises it; so is an integer index (``iota_0 * 32 + iota_1``) that is only combined with
   run-time values (the counters of random numbers). Only results of at most
   ``max(65536, largest materialised operand)`` elements fold; an ``expand`` whose result
   would become a param is never folded (its operand is), as it would only cost memory.

``param`` nodes (weights, buffers) are *not* treated as compile-time constants: they keep
their names (so a compiled module can take new weights), a weight that happens to be uniform
(a zero-initialised bias) is not turned into a ``full``, and layout changes of weights
(the ``permute`` of a Linear) are left to the scheduler, which folds them into indexing.

Replacement nodes keep the ``loc`` of the node they replace.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch

from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node, make_node
from sextant.graph.ops import BINARY_CMP, SOURCES, is_elementwise
from sextant.graph.passes.dce import live_nodes
from sextant.graph.passes.rewrite import rebuild, replace_nodes
from sextant.graph.reference import _identity as reduction_identity
from sextant.graph.reference import eval_node
from sextant.graph.symbolic import is_symbolic

MIN_FOLD_NUMEL = 65536
_EVAL_ERRORS = (RuntimeError, IndexError, ValueError, NotImplementedError)
_SAME_VALUE_MOVEMENT = frozenset({"reshape", "permute", "expand", "slice", "gather"})


def _scalar(value: object, dtype: DType) -> int | float | bool:
    """``value`` as the Python type a ``full`` of ``dtype`` stores."""
    return bool(value) if dtype == DType.bool else int(value) if dtype.is_int else float(value)


def _same(a: float, b: float) -> bool:
    """Equal as stored values: NaN equals NaN, 0.0 differs from -0.0."""
    return (a != a and b != b) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))


def _wrap_int(v: int, dtype: DType) -> int:
    bits = 8 * dtype.itemsize
    v %= 1 << bits
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def _reduce_full(node: Node, value: float) -> float | None:
    fn, dtype = node.attr("fn"), node.dtype
    count = math.prod(node.inputs[0].shape[a] for a in node.attr("axes"))
    if is_symbolic(count):  # the result depends on the size: computed at run time
        return None
    if not count:  # a reduction over no elements yields its identity, as in the reference
        return reduction_identity(fn, dtype.torch)
    if fn in ("max", "min"):
        return value
    if dtype.is_int:
        return _wrap_int(value * count if fn == "sum" else pow(value, count, 1 << 64), dtype)
    v = torch.tensor(value, dtype=dtype.torch).double()  # round the operand to its dtype first
    r = v * count if fn == "sum" else v.pow(count)
    return r.to(dtype.torch).item()


def uniform_value(node: Node) -> int | float | bool | None:
    """The value of ``node`` if all operands are ``full`` and its result is uniform, else None."""
    if node.op in SOURCES or not all(i.op == "full" for i in node.inputs):
        return None
    values = [i.attr("value") for i in node.inputs]
    if any(is_symbolic(v) for v in values):  # a size used as a value (``full() {value=seq}``) stays
        return None
    if is_elementwise(node.op):
        tiny = [torch.full((1,), v, dtype=i.dtype.torch) for v, i in zip(values, node.inputs)]
        try:
            return eval_node(node, tiny).item()
        except _EVAL_ERRORS:  # the reference cannot run it either: leave it
            return None
    if node.op in _SAME_VALUE_MOVEMENT:
        return values[0]
    if node.op == "pad":
        padded = any(node.attr("low") + node.attr("high"))
        return values[0] if not padded or _same(values[0], node.attr("value")) else None
    if node.op == "concat":
        return values[0] if all(_same(values[0], v) for v in values) else None
    if node.op == "reduce":
        return _reduce_full(node, values[0])
    return None  # matmul/conv: left to stage 2


def _full(node: Node, value: object) -> Node:
    return make_node("full", (), {"value": _scalar(value, node.dtype), "shape": node.shape, "dtype": node.dtype},
                     node.loc)


def fold_uniform(graph: Graph) -> Graph:
    """Stage 1: uniform ops on ``full`` operands become ``full`` nodes."""
    def fn(node: Node) -> Node | None:
        v = uniform_value(node)
        return None if v is None else _full(node, v)

    return rebuild(graph, fn)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers, so comparisons tell -0.0 from 0.0 and NaN equals itself."""
    if not t.dtype.is_floating_point:
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _uniform(t: torch.Tensor) -> bool:
    flat = _bits(t).reshape(-1)
    return t.numel() == 0 or bool((flat == flat[0]).all())


def _index_predicate(n: Node, indexed: set[Node], users: dict[Node, list[Node]], constant: dict[Node, bool]) -> bool:
    """A comparison of two iotas (re-indexed) that only selects between computed values — the causal
    mask ``where(key <= query, scores, -inf)``: recomputing it in a kernel is one compare per
    element, folding it a table of that many bytes to load, and a fused attention kernel could no
    longer see its structure. Such nodes stay. Only this narrow form: a predicate combined into a
    constant mask (HF's causal-and-padding masks) folds into one table, cheaper loaded."""
    if n.op not in BINARY_CMP or not all(i in indexed for i in n.inputs):
        return False
    selects, stack = [], [n]
    while stack:  # its uses, through broadcasts and reshapes
        x = stack.pop()
        for u in users[x]:
            if u.op in ("expand", "reshape"):
                stack.append(u)
            elif u.op == "where" and u.inputs[0] is x:
                selects.append(u)
            else:
                return False
    return bool(selects) and all(not all(_constant(x, constant) for x in u.inputs[1:]) for u in selects)


def _runtime_indices(graph: Graph, users: dict[Node, list[Node]], constant: dict[Node, bool]) -> set[Node]:
    """Integer affine combinations of iotas (``iota_0 * 32 + iota_1``: an element's flat index)
    whose values only reach computations on run-time values, directly or through other such
    combinations — the counters of the Philox rounds (``passes/expand_random.py``). A kernel
    computes them from its own indices for a multiply-add an element; folded, each would be a table
    of 8 bytes an element to load. They stay."""
    affine: set[Node] = set()
    for n in graph.nodes:
        if n.op in ("add", "sub", "mul") and n.dtype.is_int and all(
                i.op in ("iota", "full") or i in affine for i in n.inputs):
            affine.add(n)
    kept: set[Node] = set()
    for n in reversed(graph.nodes):
        if n in affine and users[n] and all(u in kept if u in affine else not _constant(u, constant)
                                            for u in users[n]):
            kept.add(n)
    return kept


def _constant(n: Node, memo: dict[Node, bool]) -> bool:
    """Whether ``n`` is computed from ``full``/``iota`` alone (iteratively, memoised)."""
    stack = [n]
    while stack:
        x = stack[-1]
        if x in memo:
            stack.pop()
            continue
        if x.op in ("input", "param"):
            memo[x] = False
        elif not x.inputs:
            memo[x] = True
        else:
            pending = [i for i in x.inputs if i not in memo]
            if pending:
                stack.extend(pending)
                continue
            memo[x] = all(memo[i] for i in x.inputs)
        stack.pop()
    return memo[n]


def foldable(graph: Graph) -> set[Node]:
    """Non-source nodes computed from ``full``/``iota`` only, within the size budget — except index
    predicates (:func:`_index_predicate`) and indices combined with run-time values
    (:func:`_runtime_indices`)."""
    out: set[Node] = set()
    indexed: set[Node] = set()  # iotas and their re-indexings
    users = graph.users()
    constant: dict[Node, bool] = {}
    runtime_indices = _runtime_indices(graph, users, constant)
    for n in graph.nodes:
        if n in runtime_indices:
            continue
        if n.op == "iota":
            indexed.add(n)
        if n.op in SOURCES or n.op in ("input", "extern", "collective", "wait"):  # calls run where the model runs
            continue
        if not isinstance(n.type.numel, int):  # a size that depends on a symbol: evaluated per call
            continue
        if n.op in _SAME_VALUE_MOVEMENT and n.op != "gather" and n.inputs[0] in indexed:
            indexed.add(n)
        if _index_predicate(n, indexed, users, constant):
            continue
        materialised = [i.type.numel for i in n.inputs if i in out]
        bound = max([MIN_FOLD_NUMEL, *materialised])
        if n.type.numel <= bound and all(i in out or (i.op in ("full", "iota") and isinstance(i.type.numel, int)
                                                      and i.type.numel <= bound
                                                      and not is_symbolic(i.attr("value")))
                                         for i in n.inputs):
            out.add(n)
    return out


def fold_subgraphs(graph: Graph) -> Graph:
    """Stage 2: evaluate constant subgraphs; each value that escapes them becomes a param or full."""
    live = live_nodes(graph)  # dead constants are not worth evaluating
    fold = foldable(graph) & live
    if not fold:
        return graph
    users = {n: [u for u in us if u in live] for n, us in graph.users().items()}
    roots = {n for n in fold if n in graph.outputs or any(u not in fold for u in users[n])}
    remaining = {n: sum(u in fold for u in users[n]) for n in graph.nodes}
    params = dict(graph.params)
    env: dict[Node, torch.Tensor] = {}
    mapping: dict[Node, Node] = {}
    folded: dict[tuple, list[tuple[Node, torch.Tensor]]] = {}  # (type, content hash) -> params
    names = (f"folded.{k}" for k in itertools.count() if f"folded.{k}" not in params)

    def materialise(n: Node, value: torch.Tensor) -> None:
        if n in mapping:
            return
        if _uniform(value):
            mapping[n] = _full(n, value.reshape(-1)[0].item() if value.numel() else 0)
            return
        if n.op == "expand":  # a broadcast would only cost memory: keep it lazy, fold its operand
            src = n.inputs[0]
            if src in fold:  # its value is any one copy of the broadcast (only size-1 dims expand)
                materialise(src, value[tuple(slice(0, d) for d in src.shape)].clone())
            return
        # identical results share one param (CSE cannot merge distinct names); a hash of the bits
        # finds the candidates, so each fold compares with equal-looking tensors only
        key = (n.type, hash(_bits(value).contiguous().numpy().tobytes()))
        for prev, tensor in folded.get(key, []):
            if torch.equal(_bits(tensor), _bits(value)):
                mapping[n] = prev
                return
        name = next(names)
        params[name] = value.contiguous()
        mapping[n] = make_node("param", (), {"name": name, "shape": n.shape, "dtype": n.dtype}, n.loc)
        folded.setdefault(key, []).append((mapping[n], params[name]))

    with torch.no_grad():
        for n in graph.nodes:
            if n not in fold:
                continue
            if all(i in env or i.op in SOURCES for i in n.inputs):  # else an operand failed to evaluate
                with contextlib.suppress(*_EVAL_ERRORS):  # the reference rejects it too: keep the node
                    env[n] = eval_node(n, [env[i] if i in env else eval_node(i, [], graph) for i in n.inputs], graph)
            if n not in env:
                for i in n.inputs:
                    if i in env:
                        materialise(i, env[i])
            if n in roots and n in env:
                materialise(n, env[n])
            for i in n.inputs:  # free values once their last folded user ran
                remaining[i] -= 1
                if remaining[i] == 0:
                    env.pop(i, None)
            if remaining[n] == 0:
                env.pop(n, None)
    return replace_nodes(graph, mapping, params) if mapping else graph


def constant_fold(graph: Graph) -> Graph:
    """Both stages; the folded-away nodes stay behind for :mod:`.dce` to remove."""
    return fold_subgraphs(fold_uniform(graph))
