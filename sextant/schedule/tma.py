"""GEMM and attention operands as TMA tensor maps see them (the Hopper schedules' shared piece).

An operand ``x`` (``[*batch, a, b]``, a strided view of a kernel buffer) is a batch of matrices:
rows along one of its last two axes, contiguous columns along the other, and its batch dims as
the tensor map's *outer* dimensions (``kernel.ir.TmaLoad``'s ``outer``), so a box never reads a
neighbouring matrix and rows or columns past the edge arrive as zeros. Dims of size 1 or
stride 0 (a broadcast operand) are left out of the map; the view's offset becomes a shift of the
outer coordinates (GPT-2's K and V: column slices of one projection, ``h·d`` elements in), which
keeps the map at the buffer's own start address.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.symbolic import is_symbolic
from sextant.kernel.ir import Expr, TmaLoad
from sextant.schedule.indexing import c, delinearize, iadd, idiv, imod
from sextant.schedule.views import strided_view

SWIZZLE = 128  # bytes: one swizzled row
MAX_OUTER = 3  # a tensor map has at most 5 dimensions


@dataclass(frozen=True)
class TmaOperand:
    """An operand as a TMA source: ``rows × cols`` matrices of buffer ``name``, rows ``stride``
    apart, one per value of the ``outer`` dims — each ``(size, stride, batch_dim, shift)``:
    ``batch_dim`` the batch dim its coordinate comes from, ``shift`` added to it (the view's
    offset, in whole steps of that dim)."""

    name: str
    rows: int
    cols: int
    stride: int
    outer: tuple[tuple[int, int, int, int], ...]
    lead: tuple[int, ...]  # the batch dims the outer dims' coordinates come from

    def box(self, dst: str, dst_off: Expr, bz: Expr, row: Expr, col: Expr, rows: int, bar: str,
            bar_index: Expr, swizzle: int = SWIZZLE) -> TmaLoad:
        """The copy of the box of ``rows`` × one swizzled row (64 16-bit columns at the 128-byte
        swizzle) at ``(row, col)`` of matrix ``bz`` (a linear index over ``lead``) into ``dst``,
        completing on ``bar[bar_index]``."""
        idx = delinearize(bz, self.lead) if self.lead else ()
        outer = tuple(iadd(idx[d], c(shift)) if shift else idx[d] for _, _, d, shift in self.outer)
        dims = tuple((n, k) for n, k, _, _ in self.outer)
        return TmaLoad(dst, dst_off, self.name, row, col, (rows, swizzle // 2), (self.rows, self.cols), self.stride,
                       swizzle, bar, bar_index, outer, dims)

    def load(self, dst: str, dst_off: Expr, bz: Expr, row: Expr, rows: int, bar: str,
             bar_index: Expr, swizzle: int = SWIZZLE) -> list[TmaLoad]:
        """The copies of a ``rows × cols`` tile from ``row`` of matrix ``bz`` into ``dst``: one box
        of ``swizzle/2`` columns after the other, ``rows·swizzle/2`` elements apart."""
        box = swizzle // 2
        return [self.box(dst, iadd(dst_off, c(j * rows * box)), bz, row, c(j * box), rows, bar, bar_index, swizzle)
                for j in range(self.cols // box)]


def tma_operand(x: Node, buffers: dict[int, str], dt: DType, row_axis: int, col_axis: int) -> TmaOperand | None:
    """``x`` (``[*batch, a, b]``) as a :class:`TmaOperand` whose matrix rows run along ``row_axis``
    and contiguous columns along ``col_axis`` (-1 or -2), or None. A reshape that merges batch
    dims no single stride describes (``[b, h, …]`` of a projection, permuted, flattened for a
    ``bmm``) is looked through: its batch index is delinearised over the dims below it instead."""
    if is_symbolic(x.shape):
        return None
    view = strided_view(x, buffers, exact_from=dt)
    rank = len(x.shape)
    if view is None and x.op == "permute" and list(x.attr("perm")) == [*range(rank - 2), rank - 1, rank - 2]:
        # a transposed matrix (attention's Kᵀ) of something only the reshape look-through below can
        # describe (GQA's K, its kv heads repeated by expand + reshape): the same matrix, axes swapped
        return tma_operand(x.inputs[0], buffers, dt, -1 - (row_axis == -1), -1 - (col_axis == -1))
    while view is None and x.op in ("reshape", "cast") and x.inputs[0].shape[-2:] == x.shape[-2:] and (
            x.op == "reshape" or x.inputs[0].dtype == dt):
        x = x.inputs[0]
        view = strided_view(x, buffers, exact_from=dt)
    if view is None or view.strides[col_axis] != 1:
        return None
    size = dt.itemsize
    rows, cols, stride = int(x.shape[row_axis]), int(x.shape[col_axis]), view.strides[row_axis]
    if stride < cols or (stride * size) % 16:
        return None
    dims = [(int(n), k, i) for i, (n, k) in enumerate(zip(x.shape[:-2], view.strides[:-2])) if n != 1 and k != 0]
    # the view's offset as whole steps of its outer dims (largest stride first): the tensor map
    # starts at the buffer, its outer coordinates shifted; the rows and columns must start at 0
    # so TMA's bounds stay those of the matrix
    rest, shifts = view.offset, {}
    for _n, k, i in sorted(dims, key=lambda d: -d[1]):
        shifts[i], rest = rest // k, rest % k
    if rest or len(dims) > MAX_OUTER or any((k * size) % 16 for _, k, _ in dims):
        return None
    return TmaOperand(buffers[id(view.buffer)], rows, cols, stride,
                      tuple((n + shifts[i], k, i, shifts[i]) for n, k, i in dims), tuple(int(n) for n in x.shape[:-2]))


@dataclass(frozen=True)
class HeadsOperand:
    """An ``[*, n, h·d]`` GEMM operand that is the permute of a stored ``[b, h, n, d]`` (attention's
    output feeding the output projection: ``o.transpose(1, 2).reshape(b·n, h·d)``). No single row
    stride describes it, but each head is an ``n × d`` matrix TMA can read: a K tile of 64 is
    ``64 / w`` boxes of ``w = min(d, 64)`` columns — of consecutive heads when ``d < 64``, swizzled
    ``w · 2`` bytes — the head index an outer coordinate computed from K (past the last head, TMA
    fills zeros); the batch ``b`` an outer dim too, so a GEMM row tile never straddles two batches:
    the kernel runs ``b`` matrices of ``n`` rows."""

    name: str
    n: int
    h: int
    d: int
    row_stride: int
    head_stride: int
    batch: tuple[int, int] | None  # (b, stride); None when b = 1

    @property
    def width(self) -> int:
        return min(self.d, 64)

    def boxes(self, dst: str, dst_off: Expr, bz: Expr, row: Expr, k0: Expr, rows: int, k_tile: int, bar: str,
              bar_index: Expr, itemsize: int) -> list[TmaLoad]:
        """The copies of rows ``row …`` × K ``k0 … k0 + k_tile`` of matrix ``bz`` into ``dst``: box
        ``j`` (``w`` columns) ``j · rows · w`` elements on."""
        w = self.width
        loads = []
        for j in range(k_tile // w):
            k = iadd(k0, c(j * w))
            outer = ((bz,) if self.batch else ()) + (idiv(k, self.d),)
            dims = ((self.batch,) if self.batch else ()) + ((self.h, self.head_stride),)
            loads.append(TmaLoad(dst, iadd(dst_off, c(j * rows * w)), self.name, row, imod(k, self.d), (rows, w),
                                 (self.n, self.d), self.row_stride, w * itemsize, bar, bar_index, outer, dims))
        return loads


def heads_operand(x: Node, buffers: dict[int, str], dt: DType) -> HeadsOperand | None:
    """``x`` as a :class:`HeadsOperand`, or None: ``x`` is ``[b·n, h·d]`` (or ``[b, n, h·d]``), a
    reshape of a ``[b, n, h, d]`` view of a stored buffer with ``d`` contiguous, ``d`` 16 or 32 or a
    multiple of 64 (16-bit elements), 16-byte-aligned strides and no offset."""
    if x.op != "reshape" or is_symbolic(x.shape) or x.inputs[0].type.rank not in (3, 4):
        return None
    p = x.inputs[0]
    *lead, n, h, d = (int(s) for s in p.shape)
    b = math.prod(lead)
    if tuple(x.shape) not in ((b * n, h * d), (b, n, h * d)) or not (d in (16, 32) or d % 64 == 0):
        return None
    view = strided_view(p, buffers, exact_from=dt)
    if view is None or view.offset or view.strides[-1] != 1:
        return None
    *sb, sn, sh, _ = view.strides
    size = dt.itemsize
    if any((s * size) % 16 or s <= 0 for s in (sn, sh, *sb)) or (b > 1 and len(lead) != 1):
        return None
    return HeadsOperand(buffers[id(view.buffer)], n, h, d, sn, sh, (b, sb[0]) if b > 1 else None)
