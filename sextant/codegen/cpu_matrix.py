"""The CPU's bf16 dot-product statement (:class:`~sextant.kernel.ir.PairDot`) as LLVM IR.

With AVX-512-BF16 a pair dot is one ``vdpbf16ps``: LLVM's ``llvm.x86.avx512bf16.dpbf16ps.{128,
256,512}`` intrinsic on ``<N x float>`` accumulators and ``<2N x bfloat>`` operands. llvmlite's
IR builder has no ``bfloat`` type (sextant keeps bf16 values as their ``i16`` bits), so the
operands are built as ``i16``/``i32`` vectors and bitcast to a ``bfloat`` vector type that only
prints its name — the textual IR is what LLVM parses. A's pair (``lo`` in the low half) is one
``i32`` broadcast to every lane, which LLVM folds into the instruction's ``{1toN}`` memory
operand when both values are adjacent loads.

Without the instruction — another CPU, or the checked and counting builds, which look at one
element at a time — the same sums are computed lane by lane in f32: each product of two bf16
values is exact in f32, so adding the high product and then the low one, each add rounded,
gives what ``vdpbf16ps`` gives (except for subnormals, which the instruction flushes to zero).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from sextant.codegen.scalar_math import F32, I32, NamedType
from sextant.graph.dtypes import DType
from sextant.host import host_cpu_features, host_pair_dot
from sextant.kernel.ir import PairDot

if TYPE_CHECKING:
    from sextant.codegen.llvm_cpu import _KernelLowering

I16 = ir.IntType(16)


BFLOAT = NamedType("bfloat")  # for the intrinsic's operand types only


def native_pair_dot(lanes: int) -> bool:
    """Whether this CPU runs a pair dot of ``lanes`` f32 lanes as one instruction."""
    return host_pair_dot() and (lanes == 16 or "avx512vl" in host_cpu_features())


def pair_dot(low: _KernelLowering, s: PairDot) -> None:
    if low.vector_lanes and native_pair_dot(s.lanes):
        _native(low, s)
    else:
        _lanes(low, s)


def _native(low: _KernelLowering, s: PairDot) -> None:
    b, n = low.b, s.lanes
    acc_t, pair_t = ir.VectorType(F32, n), ir.VectorType(BFLOAT, 2 * n)
    fn = low.math.declare(f"llvm.x86.avx512bf16.dpbf16ps.{32 * n}", acc_t, [acc_t, pair_t, pair_t])
    _, acc_ptr = low._elem_ptr(s.acc, low._value(s.acc_off))
    _, b_ptr = low._elem_ptr(s.b, low._value(s.b_off))
    lo, hi = low._value(s.a_lo), low._value(s.a_hi)
    pair = b.or_(b.zext(lo, I32), b.shl(b.zext(hi, I32), ir.Constant(I32, 16)))
    a = b.bitcast(b.splat(pair, n), pair_t)
    bv = b.bitcast(low._access(b.load(b_ptr, typ=ir.VectorType(I16, 2 * n), align=2), s.b), pair_t)
    acc = low._access(b.load(acc_ptr, typ=acc_t, align=4), s.acc)
    low._access(b.store(b.call(fn, [acc, a, bv]), acc_ptr, align=4), s.acc)


def _lanes(low: _KernelLowering, s: PairDot) -> None:
    """Lane by lane, through the lowering's checked index hooks: the checked build bounds-checks
    every element, and a CPU without the instruction gets the same rounding."""
    b, m = low.b, low.math
    lo, hi = m.to_f32(low._value(s.a_lo), DType.bf16), m.to_f32(low._value(s.a_hi), DType.bf16)
    acc0, b0 = low._value(s.acc_off), low._value(s.b_off)
    for lane in range(s.lanes):
        at = b.add(acc0, low._i32(lane)) if lane else acc0
        bl = b.add(b0, low._i32(2 * lane)) if lane else b0
        terms = []
        for k, a in ((1, hi), (0, lo)):
            _, ptr = low._elem_ptr(s.b, low._load_index(s.b, b.add(bl, low._i32(k)) if k else bl))
            terms.append(b.fmul(a, m.to_f32(low._access(b.load(ptr, typ=I16), s.b), DType.bf16)))
        _, ptr = low._elem_ptr(s.acc, low._load_index(s.acc, at))
        total = low._access(b.load(ptr, typ=F32), s.acc)
        for t in terms:
            total = b.fadd(total, t)
        _, ptr = low._elem_ptr(s.acc, low._store_index(s.acc, at))
        low._access(b.store(total, ptr), s.acc)
