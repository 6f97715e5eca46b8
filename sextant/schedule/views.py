"""Strided views: when a chain of re-indexing ops over a stored buffer is an ``as_strided`` view.

The index arithmetic ``ValueEmitter`` emits for a ``permute``/``reshape``/``slice``/``expand``
chain is general but opaque; a mapping that wants to copy whole 16-byte chunks (``cp.async``)
must know that consecutive elements along one axis are consecutive in the buffer. This module
answers that at the graph level, as torch does for its views: ``(buffer, offset, strides)``, or
None when some reshape of a non-contiguous view would need a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.symbolic import is_symbolic
from sextant.kernel.ir import Expr
from sextant.schedule.indexing import c, iadd, imul
from sextant.schedule.indexing import strides as contiguous_strides


@dataclass(frozen=True)
class StridedView:
    buffer: Node  # the stored node whose elements are read
    offset: int  # in elements of the buffer
    strides: tuple[int, ...]  # per dim of the view, in elements


def strided_view(x: Node, stored: dict[int, str], exact_from: DType | None = None) -> StridedView | None:
    """``x`` as a strided view of a node in ``stored`` (kernel buffers), through re-indexing ops
    only — and, with ``exact_from``, casts from that dtype (an exact upcast reads the same elements)."""
    chain: list[Node] = []
    while id(x) not in stored:
        if x.op in ("permute", "reshape", "expand", "slice") or (
                x.op == "cast" and exact_from is not None and x.inputs[0].dtype == exact_from):
            chain.append(x)
            x = x.inputs[0]
        else:
            return None
    if exact_from is not None and x.dtype != exact_from:
        return None
    offset, st = 0, tuple(contiguous_strides(x.shape))
    for n in reversed(chain):
        src = n.inputs[0].shape
        if n.op == "permute":
            st = tuple(st[p] for p in n.attr("perm"))
        elif n.op == "expand":
            st = tuple(0 if s == 1 and d != 1 else k for k, s, d in zip(st, src, n.shape))
        elif n.op == "slice":
            offset += sum(b * k for b, k in zip(n.attr("start"), st))
            st = tuple(k * step for k, step in zip(st, n.attr("step")))
        elif n.op == "reshape":
            new = _reshape_strides(src, st, n.shape)
            if new is None:
                return None
            st = new
    return StridedView(x, offset, st)


def _reshape_strides(old: tuple[int, ...], old_st: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides of ``new`` viewing the same elements as ``old`` with ``old_st``, or None when the
    reshape merges dims that are not laid out contiguously relative to each other. Walks both
    shapes from the innermost dim, matching groups of old dims (contiguous among themselves) to
    groups of new dims of the same element count."""
    if 0 in old:
        return tuple(contiguous_strides(new))
    out = [0] * len(new)
    vd = len(new) - 1
    base = old_st[-1] if old_st else 1
    t_numel = v_numel = 1
    for td in range(len(old) - 1, -1, -1):
        t_numel *= old[td]
        group_ends = td == 0 or (old[td - 1] != 1 and old_st[td - 1] != t_numel * base)
        if not group_ends:
            continue
        while vd >= 0 and (v_numel < t_numel or new[vd] == 1):
            out[vd] = v_numel * base
            v_numel *= new[vd]
            vd -= 1
        if v_numel != t_numel:
            return None
        if td > 0:
            base, t_numel, v_numel = old_st[td - 1], 1, 1
    while vd >= 0 and new[vd] == 1:  # trailing size-1 dims of a scalar-like view
        out[vd] = 1
        vd -= 1
    return tuple(out) if vd < 0 else None


def chunked(x: Node, buffers: dict[int, str], lead: tuple[Expr, ...], row_axis: int, col_axis: int,
            exact_from: DType | None = None) -> Callable[[Expr, Expr], tuple[str, Expr]] | None:
    """``(row, col) -> (buffer, flat index)`` of the 16-byte chunk starting at element
    ``(*lead, row, col)`` of ``x`` (``row``/``col`` along ``row_axis``/``col_axis``, the last two
    dims in some order), when ``x`` is a strided view whose ``col_axis`` is contiguous and whose
    offset and other strides keep every chunk 16-byte aligned (buffers start aligned) — so its
    tiles can be copied by ``cp.async``; else None."""
    if is_symbolic(x.shape):  # strides over symbolic sizes: element by element (a chunk may straddle the end)
        return None
    view = strided_view(x, buffers, exact_from)
    itemsize = (exact_from or x.dtype).itemsize
    per = 16 // itemsize
    if view is None or view.strides[col_axis] != 1 or view.offset % per or x.shape[col_axis] % per:
        return None
    lead_st, row_st = view.strides[:-2], view.strides[row_axis]
    if row_st % per or any(k % per for k in lead_st):
        return None
    name = buffers[id(view.buffer)]

    def index(row: Expr, col: Expr) -> tuple[str, Expr]:
        flat = iadd(c(view.offset), iadd(imul(row, row_st), col))
        for i, k in zip(lead, lead_st):
            if k:
                flat = iadd(flat, imul(i, k))
        return name, flat

    return index
