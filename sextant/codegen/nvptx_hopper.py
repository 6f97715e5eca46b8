"""Hopper statements → NVVM intrinsics and inline PTX (``llvm_nvptx``'s helpers), for sm_90a.

What LLVM 22 selects (``shared/notes/tensor-cores.md`` §2): wgmma fence / commit_group, mbarrier
init / arrive.expect_tx / try_wait.parity, fence.proxy.async and the TMA tile loads (2-D to 5-D) have
intrinsics; ``wgmma.mma_async`` has none, so it is inline PTX. Two rules keep ptxas from
serialising the warpgroup MMAs or LLVM from moving accumulator reads:

* each ``wgmma.mma_async`` is one ``asm sideeffect`` whose ``N/2`` f32 accumulators are outputs
  tied to the same inputs (``=f`` … ``0`` …): the registers flow through the instruction;
* an A in registers (``RegMatrix``) is four ``.b32`` inputs of f16/bf16 pairs in the same asm;
* ``wgmma.wait_group`` is also inline asm with every accumulator of the buffers it names tied
  through it (Triton's form): nothing that reads them can be scheduled above the wait.

Descriptors are computed at run time from the shared buffer's 32-bit ``.shared`` address
(``kernel.wgmma.descriptor``'s bit layout: start >> 4, LBO >> 4 << 16, SBO >> 4 << 32, swizzle
mode << 62). A tensor map is a ``byval [128 x i8]`` kernel parameter marked
``"nvvm.grid_constant"`` — llvmlite cannot spell that attribute, so the parameter gets a
recognisable name and :func:`grid_constant_params` rewrites the ``define`` line of the IR text.
Without the attribute LLVM copies the map to local memory and TMA would read a local address.

Every statement checks the architecture first: NVPTX *aborts the process* on an intrinsic it
cannot select (the wgmma ones on sm_90 without the ``a``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from llvmlite import ir

from sextant.codegen.nvptx_tensor_core import call_intrinsic, pack_fragment
from sextant.codegen.scalar_math import I1, I16, I32, I64
from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    RegMatrix,
    SetMaxNReg,
    SmemMatrix,
    TmaLoad,
    Wgmma,
    WgmmaCommit,
    WgmmaFence,
    WgmmaWait,
)
from sextant.kernel.wgmma import descriptor, tensor_map_of

if TYPE_CHECKING:
    from sextant.codegen.llvm_nvptx import _Lowering

F32 = ir.FloatType()
SHARED_PTR = ir.PointerType(addrspace=3)
TMAP_PREFIX = "sextant.tmap."
_DEFINE_TMAP = re.compile(r'ptr (%"' + re.escape(TMAP_PREFIX) + r'\d+")')


def _check(low: _Lowering, s: object) -> None:
    """wgmma needs sm_90a; TMA and mbarriers sm_90."""
    arch = low.arch
    specific = Wgmma | WgmmaFence | WgmmaCommit | WgmmaWait | SetMaxNReg
    if low.sm < 90 or (isinstance(s, specific) and not arch.endswith("a")):
        need = "sm_90a (the architecture-specific Hopper target)" if isinstance(s, specific) else "sm_90 or newer"
        raise low._fail(f"{type(s).__name__} needs {need}; this module is compiled for {arch}")


def _shared(low: _Lowering, name: str, index: ir.Value) -> ir.Value:
    """An ``addrspace(3)`` pointer to ``name[index]``."""
    return low._elem_ptr(name, index)[1]


# -- wgmma ---------------------------------------------------------------------------------------
def _descriptor(low: _Lowering, m: SmemMatrix) -> ir.Value:
    b = low.b
    addr = b.ptrtoint(_shared(low, m.buffer, low._value(m.offset)), I64)
    start = b.lshr(b.and_(addr, ir.Constant(I64, 0x3FFFF)), ir.Constant(I64, 4))
    fixed = descriptor(0, m.swizzle, m.lbo, m.sbo)  # every field but the start address
    return b.or_(start, ir.Constant(I64, fixed - (1 << 64) if fixed >= 1 << 63 else fixed))


def _acc_ptrs(low: _Lowering, name: str, base: ir.Value, count: int) -> list[ir.Value]:
    return [low._elem_ptr(name, low.b.add(base, low._i32(i)) if i else base)[1] for i in range(count)]


def wgmma(low: _Lowering, s: Wgmma) -> None:
    _check(low, s)
    b = low.b
    ab = low.kernel.buffer(s.a.buffer).dtype
    kind = {DType.f16: "f16", DType.bf16: "bf16"}[ab]
    n = s.n // 2
    ptrs = _acc_ptrs(low, s.d, low._value(s.d_off), n)
    accs = [b.load(p, typ=F32) for p in ptrs]
    db = _descriptor(low, s.b)
    regs = ", ".join(f"${i}" for i in range(n))
    if isinstance(s.a, RegMatrix):  # four .b32 registers of f16/bf16 pairs; no transpose-A immediate
        a_vals = [v if v.type == I32 else b.bitcast(v, I32)
                  for v in pack_fragment(low, s.a.buffer, low._value(s.a.offset), 8, ab)]
        a_ops = "{" + ", ".join(f"${2 * n + i}" for i in range(4)) + "}"
        a_cons, a_types, trans = ["r"] * 4, [I32] * 4, ""
    else:
        a_vals = [_descriptor(low, s.a)]
        a_ops, a_cons, a_types, trans = f"${2 * n}", ["l"], [I64], f"{int(s.a.major == 'mn')}, "
    nb = 2 * n + len(a_vals)  # B's operand number; scale-d follows it
    # scale-d is a predicate (1: D += A·B); the immediates: scale A, scale B, [transpose A,] transpose B
    asm = (f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${nb + 1}, 0;\n"
           f"wgmma.mma_async.sync.aligned.m64n{s.n}k16.f32.{kind}.{kind} {{{regs}}}, {a_ops}, ${nb}, "
           f"p, 1, 1, {trans}{int(s.b.major == 'mn')};\n}}")
    cons = ",".join(["=f"] * n + [str(i) for i in range(n)] + a_cons + ["l", "r"])
    fnty = ir.FunctionType(ir.LiteralStructType([F32] * n), [F32] * n + a_types + [I64, I32])
    res = b.call(ir.InlineAsm(fnty, asm, cons, side_effect=True), [*accs, *a_vals, db, low._i32(1)])
    for i, p in enumerate(ptrs):
        b.store(b.extract_value(res, i), p)


def wgmma_sync(low: _Lowering, s: WgmmaFence | WgmmaCommit | WgmmaWait) -> None:
    _check(low, s)
    if isinstance(s, WgmmaFence):
        call_intrinsic(low, "llvm.nvvm.wgmma.fence.sync.aligned", ir.VoidType(), [])
        return
    if isinstance(s, WgmmaCommit):
        call_intrinsic(low, "llvm.nvvm.wgmma.commit_group.sync.aligned", ir.VoidType(), [])
        return
    b = low.b
    # every register of the named buffers (f32 accumulators; an i32 one holds a value whose uses
    # must stay below the wait, e.g. a persistent GEMM's tile index) passes through the wait, tied
    ptrs: list[tuple[ir.Value, ir.Type, str]] = []
    for name in s.accs:
        buf = low.kernel.buffer(name)
        typ, letter = (F32, "f") if buf.dtype == DType.f32 else (I32, "r")
        ptrs += [(p, typ, letter) for p in _acc_ptrs(low, name, low._i32(0), buf.size)]
    if not ptrs:
        call_intrinsic(low, "llvm.nvvm.wgmma.wait_group.sync.aligned", ir.VoidType(), [ir.Constant(I64, s.pending)])
        return
    n = len(ptrs)
    fnty = ir.FunctionType(ir.LiteralStructType([t for _, t, _ in ptrs]), [t for _, t, _ in ptrs])
    cons = ",".join([f"={letter}" for _, _, letter in ptrs] + [str(i) for i in range(n)])
    asm = ir.InlineAsm(fnty, f"wgmma.wait_group.sync.aligned {s.pending};", cons, side_effect=True)
    res = b.call(asm, [b.load(p, typ=t) for p, t, _ in ptrs])
    for i, (p, _, _) in enumerate(ptrs):
        b.store(b.extract_value(res, i), p)


def set_max_nreg(low: _Lowering, s: SetMaxNReg) -> None:
    _check(low, s)
    name = f"llvm.nvvm.setmaxnreg.{'inc' if s.inc else 'dec'}.sync.aligned.u32"
    call_intrinsic(low, name, ir.VoidType(), [low._i32(s.count)])


# -- mbarriers -----------------------------------------------------------------------------------
def mbarrier(low: _Lowering, s: MbarrierInit | MbarrierArrive | MbarrierWait) -> None:
    _check(low, s)
    b = low.b
    bar = _shared(low, s.bar, low._value(s.index))
    if isinstance(s, MbarrierInit):
        call_intrinsic(low, "llvm.nvvm.mbarrier.init.shared", ir.VoidType(), [bar, low._i32(s.count)])
        call_intrinsic(low, "llvm.nvvm.fence.proxy.async.shared_cta", ir.VoidType(), [])  # TMA (async proxy) sees it
        return
    if isinstance(s, MbarrierArrive):
        call_intrinsic(low, "llvm.nvvm.mbarrier.arrive.expect.tx.scope.cta.space.cta", I64, [bar, low._i32(s.tx)])
        return
    parity = b.and_(low._value(s.parity), low._i32(1))
    wait = low.fn.append_basic_block("mbar.wait")
    done = low.fn.append_basic_block("mbar.done")
    b.branch(wait)
    b.position_at_end(wait)
    ok = call_intrinsic(low, "llvm.nvvm.mbarrier.try.wait.parity.scope.cta.space.cta", I1, [bar, parity])
    b.cbranch(ok, done, wait)
    b.position_at_end(done)


# -- TMA -----------------------------------------------------------------------------------------
def tma_load(low: _Lowering, s: TmaLoad) -> None:
    _check(low, s)
    b = low.b
    tmap = low.tensor_maps[tensor_map_of(s)]
    dst = b.addrspacecast(_shared(low, s.dst, low._value(s.dst_off)), ir.PointerType(addrspace=7))
    bar = _shared(low, s.bar, low._value(s.bar_index))
    coords = [low._value(x) for x in (s.col, s.row, *reversed(s.outer))]  # innermost dimension first
    args = [dst, bar, tmap, *coords, ir.Constant(I16, 0), ir.Constant(I64, 0),
            ir.Constant(I1, 0), ir.Constant(I1, 0), low._i32(0)]
    call_intrinsic(low, f"llvm.nvvm.cp.async.bulk.tensor.g2s.tile.{len(coords)}d", ir.VoidType(), args)


def tensor_map_param(index: int) -> str:
    """The name of a kernel's ``index``-th tensor-map parameter."""
    return f"{TMAP_PREFIX}{index}"


def grid_constant_params(text: str) -> str:
    """The IR text with every tensor-map parameter of a ``define`` passed by value as a grid
    constant (``ptr byval([128 x i8]) align 64 "nvvm.grid_constant"``)."""
    if TMAP_PREFIX not in text:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("define"):
            lines[i] = _DEFINE_TMAP.sub(r'ptr byval([128 x i8]) align 64 "nvvm.grid_constant" \1', line)
    return "\n".join(lines)
