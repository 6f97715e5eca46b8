"""Tensor-core and ``cp.async`` statements on the CPU: what each lane of a warp would get.

``simt.plan_kernel`` cuts an ``Mma`` or ``LdMatrix`` into a staging step at the end of one
phase and a computing step at the start of the next (all lanes of the block run in between).
This module emits both for ``llvm_cpu``'s thread loops:

* **Mma**: staging scatters each lane's A and B fragment elements into per-warp A (M×K) and
  B (K×N) matrices at the positions the PTX ISA's layout gives (``kernel.fragments``, as
  constant tables indexed by the lane); computing gives each of the lane's D elements its row
  and column's dot product, accumulated in f32 in k order, plus the lane's own C element. A
  wrong fragment index in a schedule therefore gives a wrong product here, as on the GPU.
  tf32 inputs (f32 buffers) drop their 13 low mantissa bits, as the hardware reads them.
* **LdMatrix**: staging stores each lane's row address; computing reads, for each element the
  lane receives, the row its source lane addressed (``fragments.ldmatrix_source``), through
  the ordinary (race-checked) shared-memory loads.
* **cp.async** copies at once (the race checker models when the data may be read); commit and
  wait have nothing to do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from sextant.codegen.scalar_math import I32, mem_type
from sextant.codegen.simt import LdmRead, LdmStage, MmaCompute, MmaStage
from sextant.graph.dtypes import DType
from sextant.kernel.fragments import WARP, MmaShape, ldmatrix_source, mma_shape
from sextant.kernel.ir import CpAsync

if TYPE_CHECKING:
    from sextant.codegen.llvm_cpu import _KernelLowering

_TF32_MASK = 0xFFFFE000 - (1 << 32)  # as a signed i32: keep sign, exponent and 10 mantissa bits


def _table(low: _KernelLowering, name: str, values: list[int]) -> ir.Value:
    """A constant ``i32`` array in the module (once per name)."""
    g = low.module.globals.get(name)
    if g is None:
        ty = ir.ArrayType(I32, len(values))
        g = ir.GlobalVariable(low.module, ty, name)
        g.initializer = ir.Constant(ty, values)
        g.global_constant = True
        g.linkage = "internal"
    return g


def _lookup(low: _KernelLowering, table: ir.Value, index: ir.Value) -> ir.Value:
    return low.b.load(low.b.gep(table, [low._i32(0), index], inbounds=True), typ=I32)


def _lane_warp(low: _KernelLowering) -> tuple[ir.Value, ir.Value]:
    b = low.b
    return b.and_(low.ltid, low._i32(WARP - 1)), b.lshr(low.ltid, low._i32(5))


def _shape(low: _KernelLowering, s: MmaStage | MmaCompute) -> MmaShape:
    shape = mma_shape(s.mma.shape, low.kernel.buffer(s.mma.a).dtype)
    assert shape is not None  # the planner checked it
    return shape


def _elem(low: _KernelLowering, buffer: str, base: ir.Value, i: int, store: bool) -> ir.Value:
    """A pointer to ``buffer[base + i]`` (through the checked index hooks)."""
    idx = low.b.add(base, low._i32(i)) if i else base
    idx = low._store_index(buffer, idx) if store else low._load_index(buffer, idx)
    return low._elem_ptr(buffer, idx)[1]


def mma_stage(low: _KernelLowering, s: MmaStage) -> None:
    b, shape = low.b, _shape(low, s)
    lane, warp = _lane_warp(low)
    dt = low.kernel.buffer(s.mma.a).dtype
    tag = f"sextant.frag.{shape.ptx}.{shape.kind}"
    for which, operand, slot, off, n, coord, cols, size in (
            ("a", s.mma.a, s.slot_a, s.mma.a_off, shape.a_elems, shape.a_coord, shape.k, shape.m * shape.k),
            ("b", s.mma.b, s.slot_b, s.mma.b_off, shape.b_elems, shape.b_coord, shape.n, shape.k * shape.n)):
        pos = _table(low, f"{tag}.{which}",
                     [r * cols + c for lane_ in range(WARP) for r, c in (coord(lane_, i) for i in range(n))])
        base = low._value(off)
        first = b.mul(lane, low._i32(n))
        origin = b.mul(warp, low._i32(size))
        for i in range(n):
            v = b.load(_elem(low, operand, base, i, False), typ=mem_type(dt))
            at = b.add(origin, _lookup(low, pos, b.add(first, low._i32(i))))
            b.store(v, low._elem_ptr(slot, at)[1])
    if low.checker is not None:
        low.checker.xchg_store(s.slot_a)


def mma_compute(low: _KernelLowering, s: MmaCompute) -> None:
    b, m, shape = low.b, low.math, _shape(low, s)
    lane, warp = _lane_warp(low)
    ab, acc_dt = low.kernel.buffer(s.mma.a).dtype, low.kernel.buffer(s.mma.c).dtype
    if low.checker is not None:
        low.checker.warp_converged(s.slot_a, f"mma {s.mma.d}")
    if low.counter is not None:
        low.counter.mma_issued()
    f32 = DType.f32
    tag = f"sextant.frag.{shape.ptx}.{shape.kind}.c"
    rows = _table(low, tag + ".row", [shape.c_coord(ln, i)[0] for ln in range(WARP) for i in range(shape.c_elems)])
    cols = _table(low, tag + ".col", [shape.c_coord(ln, i)[1] for ln in range(WARP) for i in range(shape.c_elems)])

    def operand(slot: str, index: ir.Value) -> ir.Value:
        v = m.from_mem(b.load(low._elem_ptr(slot, index)[1], typ=mem_type(ab)), ab)
        if ab == DType.f32:  # tf32: the hardware reads 19 bits
            return b.bitcast(b.and_(b.bitcast(v, I32), low._i32(_TF32_MASK)), ir.FloatType())
        return m.cast(v, ab, f32)

    c_base, d_base = low._value(s.mma.c_off), low._value(s.mma.d_off)
    first = b.mul(lane, low._i32(shape.c_elems))
    cs = [m.cast(m.from_mem(b.load(_elem(low, s.mma.c, c_base, i, False), typ=mem_type(acc_dt)), acc_dt), acc_dt, f32)
          for i in range(shape.c_elems)]  # C is read whole before D is written (they may be one fragment)
    a0, b0 = b.mul(warp, low._i32(shape.m * shape.k)), b.mul(warp, low._i32(shape.k * shape.n))
    outs = []
    for i in range(shape.c_elems):
        slot_i = b.add(first, low._i32(i))
        r, c = _lookup(low, rows, slot_i), _lookup(low, cols, slot_i)
        a_row = b.add(a0, b.mul(r, low._i32(shape.k)))
        b_col = b.add(b0, c)
        acc = cs[i]
        for k in range(shape.k):
            prod = m.binary("mul", operand(s.slot_a, b.add(a_row, low._i32(k))),
                            operand(s.slot_b, b.add(b_col, low._i32(k * shape.n))), f32)
            acc = m.binary("add", acc, prod, f32)
        outs.append(acc)
    for i, acc in enumerate(outs):
        b.store(m.to_mem(m.cast(acc, f32, acc_dt), acc_dt), _elem(low, s.mma.d, d_base, i, True))


def ldm_stage(low: _KernelLowering, s: LdmStage) -> None:
    b = low.b
    index = low._value(s.ldm.index)
    b.store(index, low._elem_ptr(s.slot, low.ltid)[1])
    if low.counter is not None:  # the hardware's access: one 16-byte row per addressing lane
        low.counter.record(s.ldm.src, index, store=False, nbytes=16, lanes=8 * s.ldm.count)
    if low.checker is not None:
        low.checker.xchg_store(s.slot)


def ldm_read(low: _KernelLowering, s: LdmRead) -> None:
    b, ldm = low.b, s.ldm
    if low.checker is not None:
        low.checker.warp_converged(s.slot, f"ldmatrix {ldm.dst}")
    lane, _ = _lane_warp(low)
    dt = low.kernel.buffer(ldm.src).dtype
    n = 2 * ldm.count
    tag = f"sextant.ldmatrix.x{ldm.count}{'.trans' if ldm.trans else ''}"
    src_lane = _table(low, tag + ".lane", [ldmatrix_source(ln, i // 2, i % 2, ldm.trans)[0]
                                           for ln in range(WARP) for i in range(n)])
    src_col = _table(low, tag + ".col", [ldmatrix_source(ln, i // 2, i % 2, ldm.trans)[1]
                                         for ln in range(WARP) for i in range(n)])
    if low.counter is not None:
        low.counter.paused = True  # the rows were counted as ldmatrix's 16-byte accesses
    warp_first = b.and_(low.ltid, low._i32(~(WARP - 1)))
    first = b.mul(lane, low._i32(n))
    dst = low._value(ldm.dst_off)
    for i in range(n):
        at = b.add(first, low._i32(i))
        row = b.load(low._elem_ptr(s.slot, b.add(warp_first, _lookup(low, src_lane, at)))[1], typ=I32)
        idx = low._load_index(ldm.src, b.add(row, _lookup(low, src_col, at)))
        v = b.load(low._elem_ptr(ldm.src, idx)[1], typ=mem_type(dt))
        b.store(v, _elem(low, ldm.dst, dst, i, True))
    if low.counter is not None:
        low.counter.paused = False


def cp_async(low: _KernelLowering, s: CpAsync) -> None:
    """The copy, done now (``pred`` false: zeros, nothing read)."""
    b = low.b
    dt = low.kernel.buffer(s.dst).dtype
    dst, src = low._value(s.dst_index), low._value(s.src_index)
    counter, nbytes = low.counter, s.count * dt.itemsize
    if counter is not None:  # counted as the hardware does it: one chunk written, one read (if pred)
        counter.record(s.dst, dst, store=True, nbytes=nbytes)
        counter.paused = True

    def put(i: int, v: ir.Value) -> None:
        idx = low._store_index(s.dst, b.add(dst, low._i32(i)) if i else dst)
        b.store(v, low._elem_ptr(s.dst, idx)[1])
        if low.checker is not None:
            low.checker.async_written(s.dst, idx)

    def copy() -> None:
        if counter is not None:
            counter.paused = False
            counter.record(s.src, src, store=False, nbytes=nbytes)
            counter.paused = True
        for i in range(s.count):
            put(i, b.load(_elem(low, s.src, src, i, False), typ=mem_type(dt)))

    if s.pred is None:
        copy()
        if counter is not None:
            counter.paused = False
        return
    with b.if_else(low._cond(s.pred)) as (then, orelse):
        with then:
            copy()
        with orelse:
            zero = low.math.to_mem(low.math.const(0, dt), dt)
            for i in range(s.count):
                put(i, zero)
    if counter is not None:
        counter.paused = False
