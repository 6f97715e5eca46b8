"""Tensor-core and ``cp.async`` statements → NVVM intrinsics (``llvm_nvptx``'s helpers).

The intrinsics and their operand types are the ones LLVM 22's NVPTX selects for sm_80 and
sm_90 (see ``shared/notes/tensor-cores.md``): fragments are packed into the registers the
instruction takes — ``<2 x half>`` for f16, ``i32`` holding two bf16 (or one tf32) — and the
result struct is unpacked back into the ``local`` buffer, which SROA keeps in registers when
its indices are constants. An intrinsic NVPTX cannot select *aborts the process*, so every
statement checks the architecture first and raises a :class:`CodegenError` instead.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from llvmlite import ir

from sextant.codegen.scalar_math import I16, I32
from sextant.graph.dtypes import DType
from sextant.kernel.fragments import mma_shape
from sextant.kernel.ir import CpAsync, CpAsyncCommit, CpAsyncWait, LdMatrix, Mma

if TYPE_CHECKING:
    from sextant.codegen.llvm_nvptx import _Lowering

F32, F16 = ir.FloatType(), ir.HalfType()
H2 = ir.VectorType(F16, 2)
_MIN_SM = {Mma: 80, LdMatrix: 75, CpAsync: 80, CpAsyncCommit: 80, CpAsyncWait: 80}


def sm_version(arch: str) -> int:
    m = re.match(r"sm_(\d+)", arch)
    return int(m.group(1)) if m else 0


def check_arch(low: _Lowering, s: object) -> None:
    need = _MIN_SM[type(s)]
    if sm_version(low.arch) < need:
        raise low._fail(f"{type(s).__name__} needs sm_{need} or newer; this module is compiled for {low.arch}")


def call_intrinsic(low: _Lowering, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    """Call NVVM intrinsic ``name`` (declared on first use with the arguments' types)."""
    fn = low.module.globals.get(name)
    if fn is None:
        fn = ir.Function(low.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return low.b.call(fn, args)


def _local(low: _Lowering, name: str, base: ir.Value, i: int) -> tuple[ir.Value, DType]:
    buf, ptr = low._elem_ptr(name, low.b.add(base, low._i32(i)) if i else base)
    return ptr, buf.dtype


def pack_fragment(low: _Lowering, name: str, base: ir.Value, n: int, dt: DType) -> list[ir.Value]:
    """``n`` elements of a fragment as the instruction's registers."""
    b = low.b
    vals = [b.load(_local(low, name, base, i)[0], typ=_mem(dt)) for i in range(n)]
    if dt == DType.f32:  # tf32: one element per .b32 register (the hardware ignores 13 low bits)
        return [b.bitcast(v, I32) for v in vals]
    if dt == DType.f16:
        regs = []
        for i in range(0, n, 2):
            v = b.insert_element(ir.Constant(H2, ir.Undefined), vals[i], low._i32(0))
            regs.append(b.insert_element(v, vals[i + 1], low._i32(1)))
        return regs
    # bf16: two i16 bit patterns, element 0 in the low half
    return [b.or_(b.zext(vals[i], I32), b.shl(b.zext(vals[i + 1], I32), ir.Constant(I32, 16)))
            for i in range(0, n, 2)]


def _mem(dt: DType) -> ir.Type:
    return {DType.f16: F16, DType.bf16: I16, DType.f32: F32}[dt]


def mma(low: _Lowering, s: Mma) -> None:
    check_arch(low, s)
    ab, acc = low.kernel.buffer(s.a).dtype, low.kernel.buffer(s.c).dtype
    shape = mma_shape(s.shape, ab)
    if shape is None:
        raise low._fail(f"no mma.sync of shape {s.shape} with {ab.value} inputs")
    b = low.b
    a = pack_fragment(low, s.a, low._value(s.a_off), shape.a_elems, ab)
    bb = pack_fragment(low, s.b, low._value(s.b_off), shape.b_elems, ab)
    c_base, d_base = low._value(s.c_off), low._value(s.d_off)
    if acc == DType.f16:
        c = pack_fragment(low, s.c, c_base, shape.c_elems, DType.f16)
        sig, out = "f16.f16", [H2] * (shape.c_elems // 2)
    else:
        c = [b.load(_local(low, s.c, c_base, i)[0], typ=F32) for i in range(shape.c_elems)]
        sig, out = ("f32.f32" if ab == DType.f16 else shape.kind), [F32] * shape.c_elems
    name = f"llvm.nvvm.mma.{shape.ptx}.row.col.{sig}"
    res = call_intrinsic(low, name, ir.LiteralStructType(out), [*a, *bb, *c])
    for r in range(len(out)):
        v = b.extract_value(res, r)
        if acc == DType.f16:
            for e in range(2):
                b.store(b.extract_element(v, low._i32(e)), _local(low, s.d, d_base, 2 * r + e)[0])
        else:
            b.store(v, _local(low, s.d, d_base, r)[0])


def ldmatrix(low: _Lowering, s: LdMatrix) -> None:
    check_arch(low, s)
    b = low.b
    dt = low.kernel.buffer(s.src).dtype
    _, src = low._elem_ptr(s.src, low._value(s.index))
    name = f"llvm.nvvm.ldmatrix.sync.aligned.m8n8.x{s.count}{'.trans' if s.trans else ''}.b16"
    ret = I32 if s.count == 1 else ir.LiteralStructType([I32] * s.count)
    res = call_intrinsic(low, name, ret, [src])
    dst = low._value(s.dst_off)
    for j in range(s.count):
        word = res if s.count == 1 else b.extract_value(res, j)
        for e in range(2):
            half = b.trunc(b.lshr(word, ir.Constant(I32, 16)) if e else word, I16)
            b.store(b.bitcast(half, F16) if dt == DType.f16 else half, _local(low, s.dst, dst, 2 * j + e)[0])


def cp_async(low: _Lowering, s: CpAsync) -> None:
    """``cp.async.{ca,cg}.shared.global`` (cg, which bypasses L1, for 16-byte copies); a predicate
    becomes the ``src-size`` operand (0: zero-fill, nothing read) and the source index is
    clamped to 0 where it is false, so no address past the buffer is ever formed."""
    check_arch(low, s)
    b = low.b
    nbytes = s.count * low.kernel.buffer(s.dst).dtype.itemsize
    src_index = low._value(s.src_index)
    pred = low._cond(s.pred) if s.pred is not None else None
    if pred is not None:
        src_index = b.select(pred, src_index, ir.Constant(src_index.type, 0))
    _, dst = low._elem_ptr(s.dst, low._value(s.dst_index))
    _, src = low._elem_ptr(s.src, src_index)
    kind = "cg" if nbytes == 16 else "ca"
    if pred is None:
        call_intrinsic(low, f"llvm.nvvm.cp.async.{kind}.shared.global.{nbytes}", ir.VoidType(), [dst, src])
    else:
        size = b.select(pred, low._i32(nbytes), low._i32(0))
        call_intrinsic(low, f"llvm.nvvm.cp.async.{kind}.shared.global.{nbytes}.s", ir.VoidType(), [dst, src, size])


def cp_async_group(low: _Lowering, s: CpAsyncCommit | CpAsyncWait) -> None:
    check_arch(low, s)
    if isinstance(s, CpAsyncCommit):
        call_intrinsic(low, "llvm.nvvm.cp.async.commit.group", ir.VoidType(), [])
    else:
        call_intrinsic(low, "llvm.nvvm.cp.async.wait.group", ir.VoidType(), [low._i32(s.pending)])
