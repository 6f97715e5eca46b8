"""Mixture-of-experts routing ops, lowered onto the graph IR's primitives: ``topk``, ``sort``,
``histc`` and transformers' ``grouped_mm_fallback``.

Each has a native form for the sizes a router has (a few experts, a few thousand token-expert
pairs) and declines (:class:`NoNativeForm`: the op then runs as an extern call) beyond them:

- ``topk``: ``k`` rounds of (max, first index of the max, mask it out) — one fused reduction
  kernel per row; O(k·n), for ``k`` ≤ ``TOPK_MAX``.
- ``sort``: each element's rank is the count of elements before it (ties by position: a stable
  sort), and the element of rank ``p`` is found by a second count — O(n²) compares, two
  reductions, for rows of at most ``SORT_MAX`` elements.
- ``histc``: each element's bin as torch computes it, counted per bin — O(n·bins).
- ``grouped_mm_fallback(x[S,K], w[E,K,N], offs[E])`` (rows sorted by expert, ``offs`` the
  cumulative row counts): row ``s`` belongs to expert ``#{e: offs[e] ≤ s}``; the product is one
  dense GEMM ``A[S, E·K] @ w[E·K, N]`` with ``A[s, e, :] = x[s]`` for the row's own expert and 0
  elsewhere — E times the FLOPs of a grouped GEMM, but the tuned GEMM kernels (tensor cores on
  the GPU), for ``E`` ≤ ``GROUPED_DENSE_MAX``. Rows past ``offs[-1]`` are 0, as transformers'.
"""

from __future__ import annotations

import math

from torch.ops import aten

from sextant.frontend.lowerings.nn import lowest
from sextant.frontend.lowerings.registry import LoweringContext, NoNativeForm, lower, lower_named
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

TOPK_MAX = 16  # k rounds of a row reduction; beyond, the op is called as itself
SORT_MAX = 4096  # n² compares per row
HISTC_BINS_MAX = 1024
GROUPED_DENSE_MAX = 16  # experts: the dense form computes every expert's product


def _static(n: object, what: str) -> int:
    if not isinstance(n, int):
        raise NoNativeForm(f"{what} over a symbolic size")
    return n


def _highest(dtype: DType) -> float | int:
    import torch

    return math.inf if dtype.is_float else torch.iinfo(dtype.torch).max


@lower(aten.topk.default)
def _topk(ctx: LoweringContext, x: Node, k: int, dim: int = -1, largest: bool = True,
          sorted: bool = True) -> tuple[Node, Node]:
    b = ctx.b
    if x.type.rank == 0 or x.dtype == DType.bool:
        raise NoNativeForm("topk of a scalar or of bools")
    axis = dim % x.type.rank
    n = _static(x.shape[axis], "topk")
    if not 1 <= k <= min(n, TOPK_MAX):
        raise NoNativeForm(f"topk with k={k} (the native form takes 1 ≤ k ≤ {TOPK_MAX})")
    fn = "max" if largest else "min"
    fill = lowest(x.dtype) if largest else _highest(x.dtype)
    iota = b.iota(x.shape, axis, DType.i64)
    values, indices = [], []
    taken: Node | None = None
    current = x
    for _ in range(k):
        free = b.unary("logical_not", taken) if taken is not None else b.full(True, x.shape, DType.bool)
        if largest or not x.dtype.is_float:
            m = b.reduce(fn, current, [axis])
            hit = b.binary("eq", current, b.expand(m, x.shape))
            if x.dtype.is_float:  # NaN is the largest value to torch (and wins the max)
                hit = b.binary("bitwise_or", hit, b.unary("isnan", current))
            hit = b.binary("bitwise_and", hit, free)
        else:  # the smallest: NaN comes last, once no number is left
            nan = b.unary("isnan", current)
            m = b.reduce("min", b.where(nan, b.full(math.inf, x.shape, x.dtype), current), [axis])
            hit = b.binary("bitwise_and", b.binary("eq", current, b.expand(m, x.shape)), free)
            found = b.reduce("max", hit, [axis])
            m = b.where(found, m, b.full(math.nan, m.shape, x.dtype))
            hit = b.binary("bitwise_or", hit, b.binary("bitwise_and", b.binary("bitwise_and", nan, free),
                                                        b.unary("logical_not", b.expand(found, x.shape))))
        i = b.reduce("min", b.where(hit, iota, b.full(n, x.shape, DType.i64)), [axis])
        values.append(m)
        indices.append(i)
        chosen = b.binary("eq", iota, b.expand(i, x.shape))
        taken = chosen if taken is None else b.binary("bitwise_or", taken, chosen)
        current = b.where(taken, b.full(fill, x.shape, x.dtype), x)
    return b.concat(values, axis), b.concat(indices, axis)


def _before(b: GraphBuilder, c: Node, a: Node, descending: bool) -> Node:
    """Whether value ``c`` sorts strictly before ``a`` (NaN is the largest value, as torch sorts)."""
    op = "gt" if descending else "lt"
    out = b.binary(op, c, a)
    if c.dtype.is_float:
        nan_c, nan_a = b.unary("isnan", c), b.unary("isnan", a)
        first, second = (nan_c, nan_a) if descending else (nan_a, nan_c)
        out = b.binary("bitwise_or", out, b.binary("bitwise_and", first, b.unary("logical_not", second)))
    return out


def _same(b: GraphBuilder, c: Node, a: Node) -> Node:
    out = b.binary("eq", c, a)
    if c.dtype.is_float:
        out = b.binary("bitwise_or", out, b.binary("bitwise_and", b.unary("isnan", c), b.unary("isnan", a)))
    return out


def sort_last(b: GraphBuilder, x: Node, descending: bool) -> tuple[Node, Node]:
    """(values, indices) of a stable sort of ``x`` along its last axis, by rank counting."""
    *lead, n = x.shape
    lead = tuple(lead)
    square = lead + (n, n)
    a = b.expand(b.reshape(x, lead + (n, 1)), square)  # a[..., i, j] = x_i
    c = b.expand(b.reshape(x, lead + (1, n)), square)  # c[..., i, j] = x_j
    i_of, j_of = b.iota(square, len(lead), DType.i64), b.iota(square, len(lead) + 1, DType.i64)
    earlier = b.binary("bitwise_or", _before(b, c, a, descending),
                       b.binary("bitwise_and", _same(b, c, a), b.binary("lt", j_of, i_of)))
    rank = b.reduce("sum", b.cast(earlier, DType.i64), [len(lead) + 1])  # [..., n, 1]: x_i's position
    ranks = b.expand(b.reshape(rank, lead + (1, n)), square)  # ranks[..., p, i] = rank of x_i
    at = b.binary("eq", ranks, i_of)  # x_i goes to position p (the row index here)
    index = b.reduce("sum", b.where(at, j_of, b.full(0, square, DType.i64)), [len(lead) + 1])
    index = b.reshape(index, lead + (n,))
    return b.gather(x, len(lead), index), index


@lower(aten.sort.default, aten.sort.stable)
def _sort(ctx: LoweringContext, x: Node, *args: object, **kwargs: object) -> tuple[Node, Node]:
    b = ctx.b
    if ctx.fx_node.target == aten.sort.stable:  # sort.stable(self, *, stable, dim=-1, descending=False)
        dim, descending = kwargs.get("dim", -1), kwargs.get("descending", False)
    else:  # sort(self, dim=-1, descending=False)
        dim = args[0] if args else kwargs.get("dim", -1)
        descending = args[1] if len(args) > 1 else kwargs.get("descending", False)
    if x.type.rank == 0:
        return x, b.full(0, (), DType.i64)
    if x.dtype == DType.bool:
        raise NoNativeForm("sort of bools")
    axis = int(dim) % x.type.rank  # type: ignore[call-overload]
    n = _static(x.shape[axis], "sort")
    if n > SORT_MAX:
        raise NoNativeForm(f"sort of {n} elements per row (the rank-count form takes at most {SORT_MAX})")
    last = x.type.rank - 1
    perm = list(range(x.type.rank))
    perm[axis], perm[last] = last, axis
    values, index = sort_last(b, b.permute(x, perm), bool(descending))
    return b.permute(values, perm), b.permute(index, perm)


@lower(aten.histc.default)
def _histc(ctx: LoweringContext, x: Node, bins: int = 100, min: float = 0, max: float = 0) -> Node:
    b = ctx.b
    lo, hi = float(min), float(max)
    if lo == hi:
        raise NoNativeForm("histc with min == max takes its range from the data")
    if not x.dtype.is_float or not 1 <= bins <= HISTC_BINS_MAX:
        raise NoNativeForm(f"histc of {x.dtype.value} into {bins} bins")
    n = _static(x.type.numel, "histc")
    flat = b.reshape(x, (n, 1))
    inside = b.binary("bitwise_and", b.binary("ge", flat, lo), b.binary("le", flat, hi))
    pos = b.unary("floor", b.div(b.mul(b.sub(flat, lo), float(bins)), hi - lo))  # torch's order of operations
    pos = b.minimum(pos, float(bins - 1))  # x == max falls in the last bin
    grid = (n, bins)
    hit = b.binary("bitwise_and", b.binary("eq", b.expand(pos, grid), b.cast(b.iota(grid, 1, DType.i32), x.dtype)),
                   b.expand(inside, grid))
    counts = b.reduce("sum", b.cast(hit, x.dtype), [0])  # [1, bins]
    return b.reshape(counts, (bins,))


@lower_named("transformers.grouped_mm_fallback.default")
def _grouped_mm(ctx: LoweringContext, x: Node, weight: Node, offs: Node) -> Node:
    b = ctx.b
    if x.type.rank != 2 or weight.type.rank != 3 or offs.type.rank != 1:
        raise NoNativeForm("grouped_mm_fallback over operands that are not [S,K], [E,K,N], [E]")
    s, k = (_static(d, "grouped_mm") for d in x.shape)
    e, _, n = (_static(d, "grouped_mm") for d in weight.shape)
    if e > GROUPED_DENSE_MAX:
        raise NoNativeForm(f"a grouped GEMM over {e} experts (the dense form takes at most {GROUPED_DENSE_MAX})")
    if x.dtype != weight.dtype:
        x = b.cast(x, weight.dtype)
    ends = b.expand(b.reshape(b.cast(offs, DType.i64), (1, e)), (s, e))
    row = b.iota((s, e), 0, DType.i64)
    expert = b.reduce("sum", b.cast(b.binary("ge", row, ends), DType.i64), [1])  # [S,1]: the row's expert
    mine = b.binary("eq", b.expand(expert, (s, e)), b.iota((s, e), 1, DType.i64))  # [S,E]
    spread = b.where(b.expand(b.reshape(mine, (s, e, 1)), (s, e, k)), b.expand(b.reshape(x, (s, 1, k)), (s, e, k)),
                     b.full(0.0, (s, e, k), x.dtype))
    return b.matmul(b.reshape(spread, (s, e * k)), b.reshape(weight, (e * k, n)))
