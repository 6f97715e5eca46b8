"""Hopper statements on the CPU (cuda-sim): what each thread of a warpgroup would get.

* **Wgmma**: A and B are in shared memory, visible to every thread, so no exchange is needed
  (unlike ``mma.sync``'s register fragments): each thread computes its own ``N/2``
  accumulators at the statement — row and column from ``kernel.wgmma.d_coord``, each operand
  element read at the address its *descriptor* names (start + the canonical K- or MN-major
  layout, then the swizzle applied to the address), as the hardware reads it. A schedule whose
  descriptor, LBO/SBO or swizzle disagrees with how the tile was written gets wrong numbers
  here, as on the GPU. f16/bf16 products are exact in f32; they are added in k order.
  Computing at issue time equals the hardware's asynchronous result for programs that do not
  touch the operands or accumulators before the ``wgmma.wait`` (the verifier's and the race
  checker's business); fence, commit and wait have nothing to do.
* **TMA** copies the box at once: element ``(r, c)`` of the box goes to the swizzled address
  ``kernel.wgmma.tma_box_offset`` gives; elements outside the source matrix are zeros. Then the
  box's bytes complete the transaction count of its mbarrier.
* **mbarriers** are modelled in their own 8 bytes of shared memory: bits 0–19 the arrivals still
  pending in this phase, 20–39 the arrivals each phase expects, 40–61 the pending transaction
  bytes (biased by 2²¹, so copies that land before ``expect_tx`` is counted are fine), bit 63 the
  phase's parity. A phase completes — parity flips, pending arrivals reset — when arrivals and
  bytes both reach zero. ``simt.plan_kernel`` makes each ``MbarrierWait`` a phase boundary (every
  thread ran the code before it), so a wait only has to check that the awaited phase has
  completed; in the checked build one that has not is reported (on the GPU: a hang).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from llvmlite import ir

from sextant.codegen.scalar_math import I32, I64, mem_type
from sextant.graph.dtypes import DType
from sextant.kernel.ir import MbarrierArrive, MbarrierInit, MbarrierWait, RegMatrix, SmemMatrix, TmaLoad, Wgmma
from sextant.kernel.wgmma import CORE_BYTES, CORE_ROWS, WARPGROUP, WGMMA_M, a_coord, kmajor_offset, mnmajor_offset

if TYPE_CHECKING:
    from sextant.codegen.llvm_cpu import _KernelLowering
    from sextant.codegen.simt import WgmmaStage

COUNT_SHIFT, TX_SHIFT, PHASE_SHIFT = 20, 40, 63
FIELD = (1 << 20) - 1
TX_FIELD, TX_BIAS = (1 << 22) - 1, 1 << 21


def _c64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


# -- warpgroup MMA ---------------------------------------------------------------------------------
def _operand_index(low: _KernelLowering, m: SmemMatrix, start: ir.Value, row: ir.Value, k: int,
                   size: int) -> ir.Value:
    """The element of ``m.buffer`` holding operand element ``(row, k)`` (row: along M or N; ``start``
    in bytes), by ``kernel.wgmma``'s layouts: the K part is a constant, the row part computed."""
    b, i32 = low.b, low._i32
    if m.major == "k":
        group = b.mul(b.lshr(row, i32(3)), i32(m.sbo))
        inner = b.mul(b.and_(row, i32(CORE_ROWS - 1)), i32(m.swizzle or CORE_BYTES))
        fixed = kmajor_offset(0, k, size, m.swizzle, m.lbo, m.sbo)
    else:  # MN-major: the row runs along the contiguous 16-byte chunks (interleaved) or swizzle rows
        per = (m.swizzle or CORE_BYTES) // size
        shift = per.bit_length() - 1
        group = b.mul(b.lshr(row, i32(shift)), i32(m.lbo if m.swizzle else m.sbo))
        inner = b.mul(b.and_(row, i32(per - 1)), i32(size))
        fixed = mnmajor_offset(0, k, size, m.swizzle, m.lbo, m.sbo)
    addr = _swizzled(low, b.add(b.add(start, group), b.add(inner, i32(fixed))), m.swizzle)
    return b.lshr(addr, i32(size.bit_length() - 1))


def _swizzled(low: _KernelLowering, addr: ir.Value, swizzle: int) -> ir.Value:
    """``kernel.wgmma.swizzle_address`` in LLVM IR: the 16-byte chunk bits XOR the row bits."""
    if not swizzle:
        return addr
    b, i32 = low.b, low._i32
    return b.xor(addr, b.shl(b.and_(b.lshr(addr, i32(7)), i32(swizzle // 16 - 1)), i32(4)))


def _a_slot_base(low: _KernelLowering) -> ir.Value:
    """Where this thread's warpgroup's 64×16 register-A matrix starts in an exchange slot."""
    return low.b.mul(low.b.lshr(low.ltid, low._i32(7)), low._i32(WGMMA_M * 16))


def wgmma_stage(low: _KernelLowering, s: WgmmaStage) -> None:
    """Publish this thread's 8 A elements at their ``kernel.wgmma.a_coord`` places."""
    b, i32 = low.b, low._i32
    a = s.wgmma.a
    dt = low.kernel.buffer(a.buffer).dtype
    thread = b.and_(low.ltid, i32(WARPGROUP - 1))
    warp, lane = b.lshr(thread, i32(5)), b.and_(thread, i32(31))
    g, t = b.lshr(lane, i32(2)), b.and_(lane, i32(3))
    origin = b.add(_a_slot_base(low), b.mul(b.add(b.mul(warp, i32(16)), g), i32(16)))
    base = low._value(a.offset)
    for i in range(8):
        row, k = a_coord(0, i)  # thread 0's: g = t = warp = 0
        at = b.add(origin, b.add(i32(row * 16 + k), b.shl(t, i32(1))))
        src = low._elem_ptr(a.buffer, low._load_index(a.buffer, b.add(base, i32(i))))[1]
        b.store(b.load(src, typ=mem_type(dt)), low._elem_ptr(s.slot, at)[1])
    if low.checker is not None:
        low.checker.xchg_store(s.slot)


def wgmma(low: _KernelLowering, s: Wgmma, a_slot: str | None = None) -> None:
    """This thread's accumulators; a register A is read from ``a_slot`` (its ``WgmmaStage``)."""
    b, m, i32 = low.b, low.math, low._i32
    ab = low.kernel.buffer(s.a.buffer).dtype
    size, f32 = ab.itemsize, DType.f32
    thread = b.and_(low.ltid, i32(WARPGROUP - 1))
    warp, lane = b.lshr(thread, i32(5)), b.and_(thread, i32(31))
    g, t = b.lshr(lane, i32(2)), b.and_(lane, i32(3))
    a_start = b.mul(low._value(s.a.offset), i32(size)) if isinstance(s.a, SmemMatrix) else _a_slot_base(low)
    b_start = b.mul(low._value(s.b.offset), i32(size))
    d_base = low._value(s.d_off)
    if a_slot is not None and low.checker is not None:
        low.checker.warp_converged(a_slot, f"wgmma {s.d}")

    def load(mat: SmemMatrix | RegMatrix, start: ir.Value, row: ir.Value, k: int) -> ir.Value:
        if isinstance(mat, RegMatrix):
            assert a_slot is not None, "a register A is read through its WgmmaStage's slot"
            ptr = low._elem_ptr(a_slot, b.add(start, b.add(b.mul(row, i32(16)), i32(k))))[1]
        else:
            index = _operand_index(low, mat, start, row, k, size)
            ptr = low._elem_ptr(mat.buffer, low._load_index(mat.buffer, index))[1]
        return m.cast(m.from_mem(b.load(ptr, typ=mem_type(ab)), ab), ab, f32)

    def element(i: ir.Value) -> None:
        row = b.add(b.add(b.mul(warp, i32(16)), g), b.shl(b.and_(b.lshr(i, i32(1)), i32(1)), i32(3)))
        col = b.add(b.add(b.shl(b.lshr(i, i32(2)), i32(3)), b.shl(t, i32(1))), b.and_(i, i32(1)))
        d_idx = b.add(d_base, i)
        acc = m.from_mem(b.load(low._elem_ptr(s.d, low._load_index(s.d, d_idx))[1], typ=mem_type(f32)), f32)
        for k in range(16):
            prod = m.binary("mul", load(s.a, a_start, row, k), load(s.b, b_start, col, k), f32)
            acc = m.binary("add", acc, prod, f32)
        b.store(m.to_mem(acc, f32), low._elem_ptr(s.d, low._store_index(s.d, d_idx))[1])

    low._loop(i32(0), i32(s.n // 2), 1, element, "wgmma")


# -- TMA -----------------------------------------------------------------------------------------
def tma_load(low: _KernelLowering, s: TmaLoad) -> None:
    b, i32 = low.b, low._i32
    dt = low.kernel.buffer(s.dst).dtype
    size = dt.itemsize
    (box_rows, box_cols), (rows, cols) = s.box, s.shape
    dst0, row0, col0 = low._value(s.dst_off), low._value(s.row), low._value(s.col)
    zero = low.math.to_mem(low.math.const(0, dt), dt)
    plane, plane_ok = i32(0), ir.Constant(ir.IntType(1), 1)  # the matrix the outer coordinates pick
    for x, (n, k) in zip(s.outer, s.outer_dims):
        v = low._value(x)
        plane_ok = b.and_(plane_ok, b.and_(b.icmp_signed(">=", v, i32(0)), b.icmp_signed("<", v, i32(n))))
        plane = b.add(plane, b.mul(v, i32(k)))

    def box_row(r: ir.Value) -> None:
        gr = b.add(row0, r)
        row_ok = b.and_(plane_ok, b.and_(b.icmp_signed(">=", gr, i32(0)), b.icmp_signed("<", gr, i32(rows))))

        def box_col(c: ir.Value) -> None:
            gc = b.add(col0, c)
            ok = b.and_(row_ok, b.and_(b.icmp_signed(">=", gc, i32(0)), b.icmp_signed("<", gc, i32(cols))))
            src = b.select(ok, b.add(plane, b.add(b.mul(gr, i32(s.stride)), gc)), i32(0))
            v = b.load(low._elem_ptr(s.src, low._load_index(s.src, src))[1], typ=mem_type(dt))
            addr = _swizzled(low, b.mul(b.add(b.mul(r, i32(box_cols)), c), i32(size)), s.swizzle)
            dst = b.add(dst0, b.lshr(addr, i32(size.bit_length() - 1)))
            b.store(b.select(ok, v, zero), low._elem_ptr(s.dst, low._store_index(s.dst, dst))[1])

        low._loop(i32(0), i32(box_cols), 1, box_col, "tma.col")

    low._loop(i32(0), i32(box_rows), 1, box_row, "tma.row")
    _update(low, s.bar, low._value(s.bar_index), lambda st: b.sub(st, _c64((box_rows * box_cols * size) << TX_SHIFT)))


# -- mbarriers -----------------------------------------------------------------------------------
def _state(low: _KernelLowering, bar: str, index: ir.Value) -> ir.Value:
    """A pointer to the barrier's state word (never race-checked: mbarrier operations are atomic)."""
    return low._elem_ptr(bar, index)[1]


def _settle(b: ir.IRBuilder, st: ir.Value) -> ir.Value:
    """``st`` with its phase completed if no arrival and no transaction byte is pending."""
    pending = b.and_(st, _c64(FIELD))
    tx = b.and_(b.lshr(st, _c64(TX_SHIFT)), _c64(TX_FIELD))
    done = b.and_(b.icmp_unsigned("==", pending, _c64(0)), b.icmp_unsigned("==", tx, _c64(TX_BIAS)))
    expected = b.and_(b.lshr(st, _c64(COUNT_SHIFT)), _c64(FIELD))
    flipped = b.or_(b.xor(st, _c64(-(1 << PHASE_SHIFT))), expected)
    return b.select(done, flipped, st)


def _update(low: _KernelLowering, bar: str, idx: ir.Value, change: Callable[[ir.Value], ir.Value]) -> None:
    b = low.b
    ptr = _state(low, bar, idx)
    b.store(_settle(b, change(b.load(ptr, typ=I64))), ptr)


def mbarrier(low: _KernelLowering, s: MbarrierInit | MbarrierArrive | MbarrierWait) -> None:
    b = low.b
    idx = low._value(s.index)
    if isinstance(s, MbarrierInit):
        b.store(_c64(s.count | (s.count << COUNT_SHIFT) | (TX_BIAS << TX_SHIFT)), _state(low, s.bar, idx))
    elif isinstance(s, MbarrierArrive):
        _update(low, s.bar, idx, lambda st: b.sub(b.add(st, _c64(s.tx << TX_SHIFT)), _c64(1)))
    elif low.checker is not None:
        phase = b.trunc(b.lshr(b.load(_state(low, s.bar, idx), typ=I64), _c64(PHASE_SHIFT)), I32)
        parity = b.and_(low._value(s.parity), low._i32(1))
        low.checker.mbarrier_wait(b.icmp_unsigned("!=", phase, parity), s.bar, idx, parity)
