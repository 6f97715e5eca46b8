"""What the CPU and NVPTX lowerings of kernel IR share: loops and expressions → LLVM IR.

The two targets differ in how a kernel's threads, storage and synchronisation become LLVM
(phases and thread loops on the CPU; the hardware's own threads, address spaces and shuffles on
the GPU), but not in how a loop or an expression is lowered: that lives here, once.
A subclass provides ``kernel``, ``fn``, ``b`` (the IRBuilder), ``math`` (a
:class:`~sextant.codegen.scalar_math.ScalarMath`), ``memo``, and the storage hooks
``read_var``/``write_var``/``_elem_ptr``/``_special``/``_stmts``; it may override
``_load_index`` (e.g. to bounds-check) and ``_bounds``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llvmlite import ir

from sextant.codegen.errors import CodegenError
from sextant.codegen.scalar_math import I32, ScalarMath, mem_type
from sextant.codegen.simt import expr_loads
from sextant.graph.dtypes import DType
from sextant.graph.ops import IRTypeError, TensorType, infer_type
from sextant.kernel.ir import (
    Assign,
    AtomicAdd,
    Binary,
    Buffer,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    Select,
    Special,
    Store,
    Unary,
    Var,
)

MAX_UNROLL = 512  # For(unroll=True) with constant bounds is unrolled up to this many iterations


class LoweringBase:
    kernel: Kernel
    fn: ir.Function
    b: ir.IRBuilder
    math: ScalarMath
    memo: dict[int, tuple[Expr, ir.Value]]

    # -- provided by the target ---------------------------------------------------------------
    def read_var(self, v: Var) -> ir.Value:
        raise NotImplementedError

    def write_var(self, v: Var, value: ir.Value) -> None:
        raise NotImplementedError

    def _elem_ptr(self, name: str, index: ir.Value) -> tuple[Buffer, ir.Value]:
        raise NotImplementedError

    def _special(self, e: Special) -> ir.Value:
        raise NotImplementedError

    def _stmts(self, stmts: Sequence[Any]) -> None:
        raise NotImplementedError

    def _load_index(self, buffer: str, index: ir.Value) -> ir.Value:
        """The index a load uses (the race-checking CPU lowering checks it here)."""
        return index

    def _store_index(self, buffer: str, index: ir.Value) -> ir.Value:
        return index

    def _access(self, inst: ir.Instruction, buffer: str) -> ir.Instruction:
        """Called with every load and store of a buffer (the CPU tags them with alias scopes)."""
        return inst

    # -- shared -------------------------------------------------------------------------------
    def _fail(self, msg: str) -> CodegenError:
        return CodegenError(f"kernel {self.kernel.name}: {msg}")

    @staticmethod
    def _i32(v: int) -> ir.Constant:
        return ir.Constant(I32, v)

    def _loop(self, start: ir.Value, stop: ir.Value, step: int, body: Callable[[ir.Value], None], name: str) -> None:
        """``for iv in range(start, stop, step): body(iv)`` as a header/body/latch loop."""
        if step == 0:
            raise self._fail(f"loop {name} has step 0")
        b = self.b
        pre = b.block
        head, body_bb, done = (self.fn.append_basic_block(f"{name}.{s}") for s in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        iv = b.phi(start.type, name=name)
        iv.add_incoming(start, pre)
        b.cbranch(b.icmp_signed("<" if step > 0 else ">", iv, stop), body_bb, done)
        b.position_at_end(body_bb)
        body(iv)
        iv.add_incoming(b.add(iv, ir.Constant(start.type, step), flags=["nsw"]), b.block)
        b.branch(head)
        b.position_at_end(done)

    def _bounds(self, s: For) -> tuple[ir.Value, ir.Value]:
        if not (s.var.dtype.is_int and s.start.dtype == s.var.dtype == s.stop.dtype):
            raise self._fail(f"loop over {s.var.name} ({s.var.dtype.value}) needs integer bounds of its type, "
                             f"got {s.start.dtype.value} and {s.stop.dtype.value}")
        return self._value(s.start), self._value(s.stop)

    def _for(self, s: For) -> None:
        """A loop; unrolled when asked and its bounds are constants (``MAX_UNROLL`` at most), so
        indices into ``local`` arrays become constants and the arrays registers."""
        start, stop = self._bounds(s)
        if s.unroll and isinstance(start, ir.Constant) and isinstance(stop, ir.Constant):
            values = range(int(start.constant), int(stop.constant), s.step)
            if len(values) <= MAX_UNROLL:
                for v in values:
                    self.write_var(s.var, ir.Constant(start.type, v))
                    self._stmts(s.body)
                return

        def body(iv: ir.Value) -> None:
            self.write_var(s.var, iv)
            self._stmts(s.body)

        self._loop(start, stop, s.step, body, s.var.name)

    def _structured_stmt(self, s: object) -> bool:
        """Lower an ``Assign``, ``Store``, ``For`` or ``If`` (the statements both targets lower
        alike); False for any other statement, which the target lowers itself."""
        b = self.b
        if isinstance(s, Assign):
            if s.value.dtype != s.var.dtype:
                raise self._fail(f"assigning a {s.value.dtype.value} value to register {s.var.name} "
                                 f"({s.var.dtype.value})")
            self.write_var(s.var, self._value(s.value))
        elif isinstance(s, Store):
            idx, val = self._value(s.index), self._value(s.value)  # the value's loads are checked first
            buf, ptr = self._elem_ptr(s.buffer, self._store_index(s.buffer, idx))
            if buf.dtype != s.value.dtype:
                raise self._fail(f"storing a {s.value.dtype.value} value into {buf.name} ({buf.dtype.value})")
            self._access(b.store(self.math.to_mem(val, buf.dtype), ptr), s.buffer)
        elif isinstance(s, AtomicAdd):
            self._atomic_add(s)
        elif isinstance(s, For):
            self._for(s)
        elif isinstance(s, If):
            cond = self._cond(s.cond)
            if s.orelse:
                with b.if_else(cond) as (then, orelse):
                    with then:
                        self._stmts(s.then)
                    with orelse:
                        self._stmts(s.orelse)
            else:
                with b.if_then(cond):
                    self._stmts(s.then)
        else:
            return False
        return True

    def _atomic_add(self, s: AtomicAdd) -> None:
        """``atomicrmw add``/``fadd`` (relaxed: only the sum must be whole, nothing is ordered by it);
        PTX gets ``red.global.add``, x86 a ``lock`` add or a compare-exchange loop. bf16 values are
        held as their i16 bits (no ``bfloat`` type in llvmlite), so their sum is a compare-exchange
        loop on those bits, rounded through f32 as every bf16 add is."""
        b = self.b
        idx, val = self._value(s.index), self._value(s.value)
        buf, ptr = self._elem_ptr(s.buffer, self._store_index(s.buffer, idx))
        if buf.dtype != s.value.dtype or buf.dtype == DType.bool:
            raise self._fail(f"atomic add of a {s.value.dtype.value} value to {buf.name} ({buf.dtype.value})")
        if buf.dtype != DType.bf16:
            b.atomic_rmw("fadd" if buf.dtype.is_float else "add", ptr, val, "monotonic")
            return
        m, pre = self.math, b.block
        old0 = b.load_atomic(ptr, "monotonic", 2, typ=mem_type(DType.bf16))
        loop, done = self.fn.append_basic_block("atomic.cas"), self.fn.append_basic_block("atomic.done")
        b.branch(loop)
        b.position_at_end(loop)
        old = b.phi(old0.type)
        old.add_incoming(old0, pre)
        new = m.from_f32(b.fadd(m.to_f32(old, DType.bf16), m.to_f32(val, DType.bf16)), DType.bf16)
        res = b.cmpxchg(ptr, old, new, "monotonic", "monotonic")
        old.add_incoming(b.extract_value(res, 0), b.block)
        b.cbranch(b.extract_value(res, 1), done, loop)
        b.position_at_end(done)

    def _cond(self, e: Expr) -> ir.Value:
        if e.dtype != DType.bool:
            raise self._fail(f"an If condition must be bool, got {e.dtype.value}: {e!r}")
        return self._value(e)

    # -- expressions --------------------------------------------------------------------------
    def _value(self, e: Expr) -> ir.Value:
        hit = self.memo.get(id(e))
        if hit is not None:
            return hit[1]
        v = self._expr(e)
        self.memo[id(e)] = (e, v)  # the expression is kept alive so its id is not reused
        return v

    def _expr(self, e: Expr) -> ir.Value:
        m = self.math
        if isinstance(e, Const):
            return m.const(e.value, e.dtype)
        if isinstance(e, Var):
            return self.read_var(e)
        if isinstance(e, Special):
            return self._special(e)
        if isinstance(e, Load):
            buf, ptr = self._elem_ptr(e.buffer, self._load_index(e.buffer, self._value(e.index)))
            if buf.dtype != e.dtype:
                raise self._fail(f"load of {e.dtype.value} from {buf.name} ({buf.dtype.value})")
            return m.from_mem(self._access(self.b.load(ptr, typ=mem_type(buf.dtype)), e.buffer), buf.dtype)
        op = self._op(e, self._value)
        if op is not None:
            return op
        if isinstance(e, Select):
            self._check_type("where", [e.cond.dtype, e.a.dtype, e.b.dtype], e.dtype)
            return self._select(e)
        raise self._fail(f"unknown expression {e!r}")

    def _op(self, e: Expr, operand: Callable[[Expr], ir.Value]) -> ir.Value | None:
        """A ``Unary``, ``Binary`` or ``Cast`` of its operands' values (``operand``: scalar, or the
        CPU's vector lanes); None for any other expression."""
        m = self.math
        if isinstance(e, Unary):
            self._check_type(e.op, [e.a.dtype], e.dtype)
            return m.unary(e.op, operand(e.a), e.a.dtype)
        if isinstance(e, Binary):
            self._check_type(e.op, [e.a.dtype, e.b.dtype], e.dtype)
            return m.binary(e.op, operand(e.a), operand(e.b), e.a.dtype)
        if isinstance(e, Cast):
            return m.cast(operand(e.a), e.a.dtype, e.dtype)
        return None

    def _select(self, e: Select) -> ir.Value:
        """A ``select``; but when an arm loads memory, only the chosen arm is evaluated (the
        condition often guards the load's index)."""
        cond = self._value(e.cond)
        if not (expr_loads(e.a) or expr_loads(e.b)):
            return self.math.select(cond, self._value(e.a), self._value(e.b))
        return self._branch(cond, lambda: self._value(e.a), lambda: self._value(e.b))

    def _memos(self) -> tuple[dict, ...]:
        """The memo tables an arm of a branch may fill (forgotten when the arm ends)."""
        return (self.memo,)

    def _set_memos(self, memos: tuple[dict, ...]) -> None:
        (self.memo,) = memos

    def _branch(self, cond: ir.Value, then: Callable[[], ir.Value], orelse: Callable[[], ir.Value]) -> ir.Value:
        """``then() if cond else orelse()`` with only the chosen arm evaluated: an if/else whose
        two values meet in a phi; what either arm memoised is forgotten after it."""
        b = self.b
        saved = self._memos()
        self._set_memos(tuple(dict(m) for m in saved))
        with b.if_else(cond) as (then_bb, orelse_bb):
            with then_bb:
                va, ba = then(), b.block
            self._set_memos(tuple(dict(m) for m in saved))
            with orelse_bb:
                vb, bb = orelse(), b.block
        self._set_memos(saved)
        phi = b.phi(va.type)
        phi.add_incoming(va, ba)
        phi.add_incoming(vb, bb)
        return phi

    def _check_type(self, op: str, ins: list[DType], out: DType) -> None:
        try:
            t = infer_type(op, [TensorType((), d) for d in ins], {})
        except IRTypeError as err:
            raise self._fail(str(err)) from None
        if t.dtype != out:
            raise self._fail(f"{op} of {', '.join(d.value for d in ins)} gives {t.dtype.value}, "
                             f"but the expression says {out.value}")
