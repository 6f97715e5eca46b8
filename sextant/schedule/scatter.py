"""``scatter`` kernels: write ``src``'s slices into the updated tensor's own buffer, in place.

The graph pass ``in_place_updates`` has proved (or made, with a ``copy``) the updated operand's
buffer the scatter's to overwrite, and the schedule gives the scatter node that very buffer. So
the kernel walks ``src`` only — one decode token's K/V rows, not the cache — and stores each
element at its position along the axis; nothing else of the buffer is touched.

A position outside the tensor is never written: the store is guarded (``0 <= k < n``), and its
index is clamped too, so the verifier sees every store in bounds. (The runtime refuses such a
position before the launch where it can see it: ``graph/position_checks.py``.) Of repeated positions
one slice wins, unspecified which — as with torch's ``index_copy_`` and ``index_put_``.

- CPU: a block walks a chunk of ``src``'s rows (all dims but the last); when the axis is not the
  last dim, the row's position is loaded and checked once per row and the row is one contiguous
  store loop.
- GPU: one thread per element of ``src``, consecutive threads along its last dim.

A scatter with ``reduce="add"`` (torch's ``index_put(accumulate=True)``, ``index_add``, the
embedding backward) adds each slice at its position instead; slices at a repeated position are
all summed, so the kernel reads the buffer too (``inout``). Its work is ``src``'s size, never
positions × slices:

- CPU: deterministic. A float sum's rounding depends on its order, so the order is fixed: every
  output element is owned by one block, which adds the slices into it in the order of ``index``
  (as torch's CPU kernel does). Blocks split the independent columns — the dims before the axis
  times chunks of the dims after it — and each walks all positions for its columns: for each
  position, one contiguous read-add-write of its chunk of the slice. The result does not depend
  on how many threads run the blocks. Sorting the positions into segments would also be
  deterministic, but costs a sort per call and still needs the per-column walk to sum a segment.
- GPU: one thread per element of ``src`` adds it with an atomic add (``AtomicAdd`` →
  ``atom.global.add``): throughput over reproducibility, as torch's CUDA ``index_put_`` does.
"""

from __future__ import annotations

import math

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.symbolic import Dim
from sextant.kernel.ir import INDEX, AtomicAdd, Binary, Buffer, Cast, Const, Expr, If, Kernel, Load, Store
from sextant.kernel.sizes import capacity, with_grid
from sextant.schedule.indexing import (
    Index,
    ValueEmitter,
    c,
    delinearize,
    divisible,
    iadd,
    idiv,
    imin,
    imod,
    imul,
    linearize,
    may_be_nonzero,
)
from sextant.schedule.kernels import _chunks, _loop, _row_loop, buffers_read
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc


def scatter_params(group: Group, stored: set[int]) -> tuple[ValueEmitter, list[Buffer], list[Node]]:
    """``in0..`` for what the positions and the slices read, ``out0`` for the updated buffer (the
    schedule passes the updated operand's buffer; only an adding scatter reads it)."""
    s = group.anchor
    ins = buffers_read(s.inputs[1:], stored)
    names = {id(n): f"in{k}" for k, n in enumerate(ins)}
    params = [Buffer(f"in{k}", n.dtype, n.type.numel, "global", "in") for k, n in enumerate(ins)]
    params.append(Buffer("out0", s.dtype, s.type.numel, "global", "inout" if s.attr("reduce") else "out"))
    return ValueEmitter(names), params, ins


def _position(e: ValueEmitter, index: Node, i: Expr, n: Dim) -> tuple[Expr, Expr]:
    """Position ``index[i]`` clamped into ``[0, n)``, and whether it was inside (checked in the
    index's own type, before it narrows to the kernel's 32-bit indices)."""
    raw = e.bind(e.value(index, (i,)), "p")
    dt = index.dtype
    size = c(n) if dt == INDEX else Cast(c(n), dt)
    inside = e.bind(Binary("bitwise_and", Binary("ge", raw, Const(0, dt), DType.bool),
                           Binary("lt", raw, size, DType.bool), DType.bool), "inb")
    k = raw if dt == INDEX else Cast(raw, INDEX)
    clamped = e.bind(Binary("minimum", Binary("maximum", k, c(0), INDEX), iadd(c(n), c(-1)), INDEX), "k")
    return clamped, inside


def _store(e: ValueEmitter, s: Node, idx: Index, k: Expr, atomic: bool = False) -> None:
    """Write (an adding scatter: add) ``src[idx]`` at position ``k`` along the axis."""
    axis = s.attr("axis")
    src = s.inputs[2]
    at = linearize(idx[:axis] + (k,) + idx[axis + 1:], s.shape)
    value = e.value(src, idx)
    if s.attr("reduce") != "add":
        e.emit(Store("out0", at, value))
    elif atomic:
        e.emit(AtomicAdd("out0", at, value))
    else:  # this block owns the element: a plain read-add-write
        at = e.bind(at, "o")
        e.emit(Store("out0", at, e.bind(Binary("add", Load("out0", at, s.dtype), value, s.dtype), "a")))


def cpu_scatter_add_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """The deterministic CPU scatter-add (module docstring): a block owns chunks of columns and adds
    the slices into them in position order."""
    s = group.anchor
    x, index, src = s.inputs
    axis, n, k = s.attr("axis"), x.shape[s.attr("axis")], src.shape[s.attr("axis")]
    e, params, _ = scatter_params(group, stored)
    pre, post = src.shape[:axis], src.shape[axis + 1:]
    outer, inner = math.prod(pre), math.prod(post)
    width = inner  # columns per unit of work: the whole slice, unless too few units to feed the cores
    if isinstance(outer, int) and isinstance(inner, int) and outer < 4 * target.cores:
        vec = max(1, target.vector_bytes // s.dtype.itemsize)
        split = math.ceil(4 * target.cores / outer)  # chunks per slice: a few units per core
        width = min(inner, max(4 * vec, math.ceil(inner / split / vec) * vec))  # whole vectors, not tiny
    tiles = 1 if width == inner else -(-inner // width)
    units = outer * tiles
    blocks, per = _chunks(units, target, k * width)

    def unit(u: Expr) -> None:
        o, t = (u, c(0)) if tiles == 1 else (e.bind(idiv(u, tiles), "o"), e.bind(imod(u, tiles), "t"))
        lead = delinearize(o, pre) if pre else ()
        j0 = c(0) if tiles == 1 else e.bind(imul(t, width), "lo")
        j1 = c(inner) if tiles == 1 else e.bind(imin(iadd(j0, c(width)), c(inner)), "hi")

        def position(q: Expr) -> None:
            p, inside = _position(e, index, q, n)
            with e.scope() as body:
                _loop(e, 0, lambda j: _store(e, s, lead + (q,) + (delinearize(j, post) if post else ()), p),
                      start=j0, stop=j1)
            e.emit(If(inside, tuple(body)))

        _loop(e, 0, position, "q", stop=c(k))

    if may_be_nonzero(src.type.numel):
        _row_loop(e, units, per, unit)
    meta = {"mapping": "scatter-add-columns", "in_place": True,
            "accumulate": "in position order, each element by one block (deterministic)"}
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), meta=meta)


def cpu_scatter_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    s = group.anchor
    if s.attr("reduce") == "add":
        return cpu_scatter_add_kernel(group, stored, target, name)
    x, index, src = s.inputs
    axis, n = s.attr("axis"), x.shape[s.attr("axis")]
    e, params, _ = scatter_params(group, stored)
    shape = src.shape
    inner = shape[-1]
    rows = math.prod(shape[:-1])
    blocks, per = _chunks(rows, target, inner)

    def row(r: Expr) -> None:
        outer = delinearize(r, shape[:-1])
        if axis < len(shape) - 1:  # one position per row: checked once, the row stored contiguously
            k, inside = _position(e, index, outer[axis], n)
            with e.scope() as body:
                _loop(e, inner, lambda j: _store(e, s, outer + (j,), k))
            e.emit(If(inside, tuple(body)))
            return

        def elem(j: Expr) -> None:
            k, inside = _position(e, index, j, n)
            with e.scope() as body:
                _store(e, s, outer + (j,), k)
            e.emit(If(inside, tuple(body)))

        _loop(e, inner, elem)

    if may_be_nonzero(src.type.numel):
        _row_loop(e, rows, per, row)
    meta = {"mapping": "scatter-rows", "in_place": True}
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), meta=meta)


def gpu_scatter_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    from sextant.schedule.gpu_kernels import BID_X, ELEMENTWISE_THREADS, TID_X, _bool, _guarded, _threads_for

    s = group.anchor
    x, index, src = s.inputs
    axis, n = s.attr("axis"), x.shape[s.attr("axis")]
    e, params, _ = scatter_params(group, stored)
    numel = src.type.numel
    threads = _threads_for(capacity(numel), target, ELEMENTWISE_THREADS)
    blocks = -(-numel // threads)
    if may_be_nonzero(numel):
        i = e.bind(iadd(imul(BID_X, threads), TID_X), "i")

        def body() -> None:
            idx = delinearize(i, src.shape)
            k, inside = _position(e, index, idx[axis], n)
            with e.scope() as then:
                _store(e, s, idx, k, atomic=True)
            e.emit(If(inside, tuple(then)))

        _guarded(e, None if divisible(numel, threads) else _bool("lt", i, c(numel)), body)
    meta = {"mapping": "scatter-thread-per-element", "in_place": True}
    if s.attr("reduce") == "add":
        meta["accumulate"] = "by atomic adds (order unspecified)"
    return with_grid(Kernel(name, tuple(params), (1, 1, 1), (threads, 1, 1), tuple(e.stmts), meta=meta),
                     (blocks, 1, 1))


def scatter_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """The target's scatter mapping (module docstring)."""
    return (gpu_scatter_kernel if target.is_gpu else cpu_scatter_kernel)(group, stored, target, name)
