"""The verifier's rules for the Hopper statements (warpgroup MMA, TMA, mbarriers).

What the hardware requires and a schedule can get wrong without any other symptom than a hang
or garbage on an H100/H200: warpgroup-collective ``wgmma`` in full, convergent warpgroups with
uniform descriptors; operand buffers in shared memory of one 16-bit dtype; descriptor offsets
encodable (16-byte multiples below 2¹⁸); swizzled operands and TMA destinations at addresses
whose swizzle bits are the buffer's own (a multiple of the 1024-byte pattern); a TMA box whose
rows fill the swizzle span; mbarriers in shared ``i64`` buffers; waits outside thread-dependent
control flow (a thread that skips the wait reads an incomplete stage; one that waits alone
deadlocks). Bounds of the shared-memory operands are checked where they are read (the CPU
emulation's checked build), as they follow from the descriptor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sextant.graph.dtypes import DType
from sextant.kernel.divergence import UNIFORM, WARP_UNIFORM
from sextant.kernel.ir import (
    Assign,
    Binary,
    Const,
    Expr,
    For,
    If,
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    RegMatrix,
    SetMaxNReg,
    SmemMatrix,
    Stmt,
    TmaLoad,
    Var,
    WarpReduce,
    Wgmma,
    WgmmaWait,
    stmt_operands,
)
from sextant.kernel.wgmma import MAX_TMA_BOX, SWIZZLE_ALIGN, SWIZZLES, WARPGROUP, wgmma_n_ok

if TYPE_CHECKING:
    from sextant.kernel.verifier import _Control, _Verifier


MAX_TX = (1 << 20) - 1  # bytes one phase of an mbarrier can expect


def known_multiple(e: Expr, regs: Mapping[str, int] | None = None) -> int:
    """The largest number ``e`` is surely a multiple of (0 for the constant 0), from its form and
    what ``regs`` knows of the registers it reads."""
    if isinstance(e, Const):  # (a non-integer value, such as -inf, says nothing)
        return abs(int(e.value)) if e.dtype.is_int or float(e.value).is_integer() else 1
    if isinstance(e, Var) and regs is not None:
        return regs.get(e.name, 1)
    if isinstance(e, Binary):
        a, b = known_multiple(e.a, regs), known_multiple(e.b, regs)
        if e.op == "mul":
            return a * b
        if e.op in ("add", "sub"):
            return math.gcd(a, b)
        if e.op == "shl" and isinstance(e.b, Const):
            return a << int(e.b.value)
    return 1


def register_multiples(body: tuple[Stmt, ...]) -> dict[str, int]:
    """For each register, a number every value assigned to it is a multiple of (a loop variable: of
    its start and step): optimistic at first, lowered to the gcd of what is assigned until stable."""
    assigns: list[tuple[str, Expr | None, int]] = []

    def walk(stmts: tuple[Stmt, ...]) -> None:
        for s in stmts:
            if isinstance(s, Assign):
                assigns.append((s.var.name, s.value, 0))
            elif isinstance(s, WarpReduce):
                assigns.append((s.var.name, None, 1))
            elif isinstance(s, For):
                assigns.append((s.var.name, s.start, abs(s.step)))
                walk(s.body)
            elif isinstance(s, If):
                walk(s.then)
                walk(s.orelse)

    walk(body)
    regs: dict[str, int] = {name: 0 for name, _, _ in assigns}
    changed = True
    while changed:
        changed = False
        for name, value, step in assigns:
            m = math.gcd(regs[name], math.gcd(step, 1 if value is None else known_multiple(value, regs)))
            if m != regs[name]:
                regs[name], changed = m, True
    return regs


def _aligned(v: _Verifier, e: Expr, itemsize: int, align: int) -> bool:
    if v.register_multiples is None:
        v.register_multiples = register_multiples(v.k.body)
    m = known_multiple(e, v.register_multiples) * itemsize
    return m == 0 or m % align == 0


def check(v: _Verifier, s: Stmt, defined: set[str], control: tuple[_Control, ...]) -> None:
    """Check one Hopper statement (``verifier._Verifier.stmt`` hands them here)."""
    for e in stmt_operands(s):
        v.expr(e, s, defined)
        v.index(e, s)
    if isinstance(s, Wgmma):
        _wgmma(v, s, control)
    elif isinstance(s, WgmmaWait):
        if not isinstance(s.pending, int) or not 0 <= s.pending <= 7:
            v.fail(s, f"wgmma wait for {s.pending!r} pending groups (0 to 7)")
        for name in s.accs:
            b = v.buffers.get(name)
            if b is None or b.space != "local" or b.dtype not in (DType.f32, DType.i32):
                v.fail(s, f"wgmma wait names {name!r}, which is not a local f32 (accumulator) or i32 buffer")
    elif isinstance(s, MbarrierInit | MbarrierArrive | MbarrierWait):
        _bar(v, s, s.bar)
        if isinstance(s, MbarrierInit) and not (isinstance(s.count, int) and 1 <= s.count <= MAX_TX):
            v.fail(s, f"an mbarrier expects 1 to {MAX_TX} arrivals, not {s.count!r}")
        if isinstance(s, MbarrierArrive) and not (isinstance(s.tx, int) and 0 <= s.tx <= MAX_TX):
            v.fail(s, f"an mbarrier phase expects 0 to {MAX_TX} transaction bytes, not {s.tx!r}")
        # a wait under a thread-dependent branch is fine (a producer's thread waits alone; the CPU
        # emulation makes it a cut for the block and checks it in the threads that take the
        # branch), but not in a loop whose trip count differs between threads (no cut can follow)
        c = next((c for c in reversed(control) if c.level > UNIFORM and c.header.startswith("for")), None) \
            if isinstance(s, MbarrierWait) else None
        if c is not None:
            v.fail(s, f"mbarrier wait in a loop whose bounds differ between threads: `{c.header}` {c.reason}")
    elif isinstance(s, TmaLoad):
        _tma(v, s)
    elif isinstance(s, SetMaxNReg):
        if v.k.threads_per_block % WARPGROUP:
            v.fail(s, f"setmaxnreg needs full warpgroups of {WARPGROUP} threads, but the block has "
                      f"{v.k.threads_per_block}")
        if not (isinstance(s.count, int) and 24 <= s.count <= 256 and s.count % 8 == 0):
            v.fail(s, f"setmaxnreg to {s.count!r} registers (24 to 256, a multiple of 8)")
        c = v.varying(control, WARP_UNIFORM)
        if c is not None:
            v.fail(s, f"setmaxnreg under control flow that differs within a warp: `{c.header}` {c.reason}; "
                      "every thread of the warpgroup must execute it")


def _bar(v: _Verifier, s: Stmt, name: str) -> None:
    b = v.buffers.get(name)
    if b is None or b.space != "shared" or b.dtype != DType.i64:
        v.fail(s, f"mbarrier {name!r} must be a shared i64 buffer")


def _wgmma(v: _Verifier, s: Wgmma, control: tuple[_Control, ...]) -> None:
    assert v.div is not None
    if v.k.threads_per_block % WARPGROUP:
        v.fail(s, f"a wgmma needs full warpgroups of {WARPGROUP} threads, but the block has {v.k.threads_per_block}")
    c = v.varying(control, WARP_UNIFORM)
    if c is not None:
        v.fail(s, f"wgmma under control flow that differs within a warp: `{c.header}` {c.reason}; every "
                  "thread of the warpgroup must execute it")
    level, reason = v.div.level_of(s.d_off, s.a.offset, s.b.offset)
    if level > WARP_UNIFORM:  # (the divergence lattice has no warpgroup level: each warpgroup its own tile rows)
        v.fail(s, f"wgmma offsets must be the same in every thread of a warp(group), but they {reason}")
    if not wgmma_n_ok(s.n):
        v.fail(s, f"wgmma N={s.n!r} (a multiple of 8 from 8 to 256)")
    d = v.buffers.get(s.d)
    if d is None or d.space != "local" or d.dtype != DType.f32:
        v.fail(s, f"wgmma accumulates into an f32 local buffer, not {s.d!r}")
    ab = [_operand(v, s, which, m) for which, m in (("A", s.a), ("B", s.b))]
    if all(ab) and ab[0] != ab[1]:
        v.fail(s, f"wgmma A is {ab[0].value} but B is {ab[1].value}")


def _operand(v: _Verifier, s: Stmt, which: str, m: SmemMatrix | RegMatrix) -> DType | None:
    b = v.buffers.get(m.buffer)
    if isinstance(m, RegMatrix):
        if which != "A" or b is None or b.space != "local" or b.dtype not in (DType.f16, DType.bf16):
            v.fail(s, f"wgmma {which} in registers must be A in an f16 or bf16 local buffer, not {m.buffer!r}")
            return None
        return b.dtype
    if b is None or b.space != "shared" or b.dtype not in (DType.f16, DType.bf16):
        v.fail(s, f"wgmma {which} must be an f16 or bf16 shared buffer, not {m.buffer!r}")
        return None
    if m.major not in ("k", "mn"):
        v.fail(s, f"wgmma {which}: major {m.major!r} (\"k\" or \"mn\")")
    if m.swizzle not in SWIZZLES:
        v.fail(s, f"wgmma {which}: swizzle {m.swizzle!r} bytes (one of {SWIZZLES})")
    for name, val in (("lbo", m.lbo), ("sbo", m.sbo)):
        if not isinstance(val, int) or val < 0 or val % 16 or val >= 1 << 18:
            v.fail(s, f"wgmma {which}: {name}={val!r} is not a multiple of 16 below 2^18 (held >> 4)")
    if not _aligned(v, m.offset, b.dtype.itemsize, 16):
        v.fail(s, f"wgmma {which}: the descriptor's start (element {m.offset}) is not surely 16-byte aligned")
    return b.dtype


def _tma(v: _Verifier, s: TmaLoad) -> None:
    _bar(v, s, s.bar)
    dst, src = v.buffers.get(s.dst), v.buffers.get(s.src)
    if dst is None or src is None or dst.space != "shared" or src.space != "global":
        v.fail(s, f"TMA copies a global buffer to a shared one, not {s.src!r} to {s.dst!r}")
        return
    if dst.dtype != src.dtype:
        v.fail(s, f"TMA from {src.dtype.value} {src.name!r} to {dst.dtype.value} {dst.name!r}")
    size = dst.dtype.itemsize
    (br, bc), (rows, cols) = s.box, s.shape
    if not all(isinstance(x, int) and 1 <= x <= MAX_TMA_BOX for x in (br, bc)):
        v.fail(s, f"TMA box {s.box} (1 to {MAX_TMA_BOX} elements per dimension)")
        return
    if (bc * size) % 16:
        v.fail(s, f"TMA box rows of {bc * size} bytes (a multiple of 16)")
    if len(s.outer) != len(s.outer_dims) or len(s.outer) > 3:
        v.fail(s, f"TMA with {len(s.outer)} outer coordinates over {len(s.outer_dims)} outer dimensions (at most 3)")
    for n, k in s.outer_dims:
        if not (isinstance(n, int) and isinstance(k, int) and 1 <= n < 1 << 32 and k >= 1):
            v.fail(s, f"TMA outer dimension of size {n!r}, stride {k!r}")
        elif (k * size) % 16 or k * size >= 1 << 40:
            v.fail(s, f"TMA outer stride of {k * size} bytes (a multiple of 16 below 2^40)")
    if not (isinstance(rows, int) and isinstance(cols, int) and rows >= 1 and cols >= 1 and s.stride >= cols):
        v.fail(s, f"TMA source shape {s.shape} with row stride {s.stride}")
    elif (s.stride * size) % 16 or s.stride * size >= 1 << 40:
        v.fail(s, f"TMA source row stride of {s.stride * size} bytes (a multiple of 16, as the tensor map holds it)")
    if s.swizzle not in SWIZZLES:
        v.fail(s, f"TMA swizzle {s.swizzle!r} bytes (one of {SWIZZLES})")
    elif s.swizzle and bc * size != s.swizzle:
        v.fail(s, f"TMA box rows of {bc * size} bytes must fill the {s.swizzle}-byte swizzle span")
    align = SWIZZLE_ALIGN if s.swizzle else 128
    if not _aligned(v, s.dst_off, size, align):
        v.fail(s, f"TMA destination (element {s.dst_off}) is not surely {align}-byte aligned")
