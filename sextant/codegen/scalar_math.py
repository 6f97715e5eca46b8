"""Scalar semantics of every graph-IR elementwise op, emitted as LLVM IR (CPU and NVPTX).

The oracle is ``sextant.graph.reference`` (torch on the CPU), so each op follows what torch's
CPU kernels compute, not what LLVM finds natural:

* f16/bf16 values are extended to f32, computed there and rounded back (torch's CPU kernels do
  the same per op). bf16 is kept as ``i16`` bits and converted with integer ops, because LLVM
  lowers ``fptrunc float to bfloat`` to a runtime-library call without AVX512-BF16 (and rounds
  NaN differently); f16 uses LLVM's ``half`` (F16C on x86).
* Integer division and remainder never trap: a zero divisor is replaced by 1 and ``x / -1`` is
  computed as ``-x`` (torch raises, or dies with SIGFPE, on those).
* ``maximum``/``minimum`` propagate NaN (``llvm.maximum``); ``round`` is half-to-even;
  ``remainder`` and ``floordiv`` follow torch's fmod-based formulas; shifts by a negative or
  too large amount give 0 (left) or the sign fill (right), as torch's do.
* float → int casts out of range (and NaN) give INT_MIN, as x86 ``cvttss2si`` does in torch.
* ``erfinv`` and ``digamma`` have no libm function: they are torch's own algorithms
  (ATen/native/Math.h), emitted as internal functions.

The semantics are target-independent; the C math functions they build on (``expf``, ``fmodf``,
...) come from a pluggable :class:`MathLibrary`: :data:`CPU_MATH` (inline vectorisable exp,
log, tanh, erf, ... from ``cpu_math``, LLVM intrinsics and libm) here, libdevice for NVPTX
(``sextant.codegen.libdevice``).
"""

from __future__ import annotations

import math
import struct

import numpy as np
from llvmlite import ir

from sextant.codegen.cpu_math import INLINE_FUNCTIONS, inline_function
from sextant.codegen.errors import CodegenError
from sextant.graph.dtypes import DType
from sextant.graph.ops import BINARY, BINARY_CMP, UNARY, UNARY_FLOAT

F32 = ir.FloatType()
F64 = ir.DoubleType()
F16 = ir.HalfType()
I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))



class NamedType(ir.Type):
    """An LLVM type llvmlite's IR builder lacks (``bfloat``, ``x86_amx``): it only prints its name,
    which is all the textual IR LLVM parses needs. Never a sextant value's own type."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _to_string(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NamedType) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("named type", self.name))


_REG = {DType.f32: F32, DType.f16: F16, DType.bf16: I16, DType.i32: I32, DType.i64: I64, DType.bool: I1}


def reg_type(dt: DType) -> ir.Type:
    """How a value of ``dt`` is held in a register (bool as i1, bf16 as its i16 bits)."""
    return _REG[dt]


def mem_type(dt: DType) -> ir.Type:
    """How an element of ``dt`` is stored in memory (bool as one byte, 0 or 1)."""
    return I8 if dt == DType.bool else _REG[dt]


# unary float ops → the C math library function computing them in f32 (a MathLibrary maps the
# names onto an LLVM intrinsic, a libm symbol or a libdevice function)
_LIBM_1 = {
    "exp": "expf", "exp2": "exp2f", "log": "logf", "log2": "log2f", "log10": "log10f", "sqrt": "sqrtf",
    "sin": "sinf", "cos": "cosf", "abs": "fabsf", "floor": "floorf", "ceil": "ceilf", "trunc": "truncf",
    "round": "roundevenf",
} | {op: op + "f" for op in (
    "expm1", "log1p", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "erf", "erfc", "lgamma",
)}
_LIBM_2 = {"fmod": "fmodf", "maximum": "fmaximumf", "minimum": "fminimumf", "pow": "powf", "atan2": "atan2f"}
# every C math function ScalarMath may ask its MathLibrary for (lets a library prepare them at once)
LIBM_FUNCTIONS = frozenset({*_LIBM_1.values(), *_LIBM_2.values(), "copysignf", "trunc", "tan"})
_FCMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_INT_BITS = {DType.i32: 32, DType.i64: 64}


def _f32(v: float) -> float:
    return float(np.float32(v))


def _scalar(t: ir.Type) -> ir.Type:
    return t.element if isinstance(t, ir.VectorType) else t


class MathLibrary:
    """Where C math functions (``expf``, ``fmodf``, ``tan``, ...) come from on a target.

    The op semantics in :class:`ScalarMath` are target-independent; only how a function such as
    ``expf`` is reached differs: an LLVM intrinsic or libm on the CPU, libdevice or NVVM on
    NVPTX (where most LLVM math intrinsics have no lowering and abort the process). Names are
    C99 libm names (``f`` suffix: f32, none: f64), plus C23's NaN-propagating ``fmaximumf`` /
    ``fminimumf`` and ``roundevenf``."""

    def call(self, m: ScalarMath, name: str, args: list[ir.Value]) -> ir.Value:
        raise NotImplementedError

    def round_bf16(self, m: ScalarMath, x: ir.Value) -> ir.Value | None:
        """f32 → bf16 bits (round to nearest even) in one instruction where the target has one;
        None: the portable integer sequence of :meth:`ScalarMath.from_f32`."""
        return None


# C names the CPU reaches through LLVM intrinsics (the rest are libm symbols)
_CPU_INTRINSICS = {
    "expf": "llvm.exp.f32", "exp2f": "llvm.exp2.f32", "logf": "llvm.log.f32", "log2f": "llvm.log2.f32",
    "log10f": "llvm.log10.f32", "sqrtf": "llvm.sqrt.f32", "sinf": "llvm.sin.f32", "cosf": "llvm.cos.f32",
    "fabsf": "llvm.fabs.f32", "floorf": "llvm.floor.f32", "ceilf": "llvm.ceil.f32", "truncf": "llvm.trunc.f32",
    "roundevenf": "llvm.roundeven.f32", "copysignf": "llvm.copysign.f32", "powf": "llvm.pow.f32",
    "fmaximumf": "llvm.maximum.f32", "fminimumf": "llvm.minimum.f32", "trunc": "llvm.trunc.f64",
}


class CpuMath(MathLibrary):
    """The host: inline vectorisable f32 exp/expm1/log/log1p/tanh/erf (``cpu_math``: libm's and
    ``llvm.exp``'s calls would keep every loop using them scalar), LLVM intrinsics where LLVM
    has them, else libm."""

    def call(self, m: ScalarMath, name: str, args: list[ir.Value]) -> ir.Value:
        if name in INLINE_FUNCTIONS:
            width = args[0].type.count if isinstance(args[0].type, ir.VectorType) else 0
            return m.b.call(inline_function(m.module, name, width), args)
        if name == "fmodf":
            return m.b.frem(*args)
        return m.call(_CPU_INTRINSICS.get(name, name), args[0].type, args)


CPU_MATH = CpuMath()


class ScalarMath:
    """Emits one op at a time at the builder's current position."""

    def __init__(self, module: ir.Module, builder: ir.IRBuilder, lib: MathLibrary = CPU_MATH):
        self.module = module
        self.b = builder
        self.lib = lib

    # -- helpers -----------------------------------------------------------------------------
    def declare(self, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ret, args), name)
        return fn

    def call(self, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
        """Call the scalar function ``name``; with vector arguments the builder (a
        :class:`~sextant.codegen.lane_builder.LaneBuilder`) widens the call."""
        return self.b.call(self.declare(name, _scalar(ret), [_scalar(a.type) for a in args]), args)

    def libm(self, name: str, *args: ir.Value) -> ir.Value:
        """The C math function ``name`` (e.g. ``expf``) from this target's math library."""
        return self.lib.call(self, name, list(args))

    def f32(self, v: float) -> ir.Constant:
        return ir.Constant(F32, _f32(v))

    def const(self, value: int | float | bool, dt: DType) -> ir.Constant:
        """A constant of ``dt`` (floats round via f32, as torch's ``full`` does; ints wrap)."""
        if dt == DType.bool:
            return ir.Constant(I1, int(bool(value)))
        if dt.is_int:
            bits = _INT_BITS[dt]
            v = int(value) & ((1 << bits) - 1)
            return ir.Constant(reg_type(dt), v - (1 << bits) if v >> (bits - 1) else v)
        f = _f32(float(value))
        if dt == DType.f32:
            return ir.Constant(F32, f)
        if dt == DType.f16:
            return ir.Constant(F16, float(np.float16(np.float32(f))))
        return ir.Constant(I16, bf16_bits(f))

    def from_mem(self, x: ir.Value, dt: DType) -> ir.Value:
        return self.b.icmp_unsigned("!=", x, ir.Constant(I8, 0)) if dt == DType.bool else x

    def to_mem(self, x: ir.Value, dt: DType) -> ir.Value:
        return self.b.zext(x, I8) if dt == DType.bool else x

    def to_f32(self, x: ir.Value, dt: DType) -> ir.Value:
        if dt == DType.f32:
            return x
        if dt == DType.f16:
            return self.b.fpext(x, F32)
        if dt == DType.bf16:
            return self.b.bitcast(self.b.shl(self.b.zext(x, I32), ir.Constant(I32, 16)), F32)
        raise AssertionError(dt)

    def from_f32(self, x: ir.Value, dt: DType) -> ir.Value:
        if dt == DType.f32:
            return x
        if dt == DType.f16:
            return self.b.fptrunc(x, F16)
        if dt == DType.bf16:  # c10::round_to_nearest_even: NaN -> 0x7FC0, else add the rounding bias
            native = self.lib.round_bf16(self, x)
            if native is not None:
                return native
            b = self.b
            u = b.bitcast(x, I32)
            bias = b.add(b.and_(b.lshr(u, ir.Constant(I32, 16)), ir.Constant(I32, 1)), ir.Constant(I32, 0x7FFF))
            r = b.trunc(b.lshr(b.add(u, bias), ir.Constant(I32, 16)), I16)
            return b.select(b.fcmp_unordered("uno", x, x), ir.Constant(I16, 0x7FC0), r)
        raise AssertionError(dt)

    def select(self, c: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(c, a, b)

    # -- unary ------------------------------------------------------------------------------
    def unary(self, op: str, x: ir.Value, dt: DType) -> ir.Value:
        """``op(x)`` for an operand of dtype ``dt``; the result is bool for the predicates."""
        if op not in UNARY:
            raise CodegenError(f"unknown unary op {op!r}")
        if op in ("isnan", "isinf") and not dt.is_float:
            return ir.Constant(I1, 0)
        if dt == DType.bool:
            if op in ("logical_not", "bitwise_not"):
                return self.b.not_(x)
            raise CodegenError(f"op {op} does not take bool operands")
        if dt.is_int:
            return self._unary_int(op, x, dt)
        y = self._unary_f32(op, self.to_f32(x, dt))
        return y if y.type == I1 else self.from_f32(y, dt)

    def _unary_int(self, op: str, x: ir.Value, dt: DType) -> ir.Value:
        b, zero = self.b, ir.Constant(x.type, 0)
        if op in UNARY_FLOAT:
            raise CodegenError(f"op {op} needs a float operand, got {dt.value}")
        if op == "neg":
            return b.sub(zero, x)
        if op == "abs":
            return b.select(b.icmp_signed("<", x, zero), b.sub(zero, x), x)
        if op == "sign":
            return b.sub(b.zext(b.icmp_signed(">", x, zero), x.type), b.zext(b.icmp_signed("<", x, zero), x.type))
        if op in ("floor", "ceil", "round", "trunc"):
            return x
        if op == "bitwise_not":
            return b.not_(x)
        if op == "logical_not":
            return b.icmp_signed("==", x, zero)
        raise CodegenError(f"op {op} is not supported for {dt.value} by the CPU code generator")

    def _unary_f32(self, op: str, x: ir.Value) -> ir.Value:
        b, one = self.b, self.f32(1.0)
        if op in _LIBM_1:
            return self.libm(_LIBM_1[op], x)
        if op == "neg":
            return b.fneg(x)
        if op == "sign":  # (0 < x) - (x < 0): NaN and -0 give +0, as torch
            pos = b.uitofp(b.fcmp_ordered(">", x, self.f32(0.0)), F32)
            return b.fsub(pos, b.uitofp(b.fcmp_ordered("<", x, self.f32(0.0)), F32))
        if op == "rsqrt":
            return b.fdiv(one, self.libm("sqrtf", x))
        if op == "reciprocal":
            return b.fdiv(one, x)
        if op == "sigmoid":
            return b.fdiv(one, b.fadd(one, self.libm("expf", b.fneg(x))))
        if op == "erfinv":
            return b.call(self._erfinv(), [x])
        if op == "digamma":
            return b.call(self._digamma(), [x])
        if op == "isnan":
            return b.fcmp_unordered("uno", x, x)
        if op == "isinf":
            return b.fcmp_ordered("==", self.libm("fabsf", x), self.f32(math.inf))
        if op == "logical_not":
            return b.fcmp_ordered("==", x, self.f32(0.0))
        raise CodegenError(f"op {op} is not supported for floats by the CPU code generator")

    # -- binary ------------------------------------------------------------------------------
    def binary(self, op: str, x: ir.Value, y: ir.Value, dt: DType) -> ir.Value:
        """``op(x, y)`` for operands of dtype ``dt`` (comparisons give bool)."""
        if op not in BINARY:
            raise CodegenError(f"unknown binary op {op!r}")
        if dt == DType.bool:
            return self._binary_bool(op, x, y)
        if dt.is_int:
            return self._binary_int(op, x, y, dt)
        if op in BINARY_CMP:
            return self.b.fcmp_unordered("!=", self.to_f32(x, dt), self.to_f32(y, dt)) if op == "ne" else \
                self.b.fcmp_ordered(_FCMP[op], self.to_f32(x, dt), self.to_f32(y, dt))
        return self.from_f32(self._binary_f32(op, self.to_f32(x, dt), self.to_f32(y, dt)), dt)

    def _binary_bool(self, op: str, x: ir.Value, y: ir.Value) -> ir.Value:
        b = self.b
        if op in BINARY_CMP:
            return b.icmp_unsigned(_FCMP[op], x, y)
        if op in ("bitwise_and", "minimum"):
            return b.and_(x, y)
        if op in ("bitwise_or", "maximum"):
            return b.or_(x, y)
        if op == "bitwise_xor":
            return b.xor(x, y)
        raise CodegenError(f"op {op} does not take bool operands")

    def _binary_f32(self, op: str, x: ir.Value, y: ir.Value) -> ir.Value:
        b = self.b
        if op in ("add", "sub", "mul"):
            # 'contract' lets LLVM fuse a*b+c into one FMA (one rounding instead of two), as
            # torch's own vectorised CPU kernels and every GPU do: matmul inner loops need it.
            return {"add": b.fadd, "sub": b.fsub, "mul": b.fmul}[op](x, y, flags=("contract",))
        if op == "div":
            return b.fdiv(x, y)
        if op in _LIBM_2:
            return self.libm(_LIBM_2[op], x, y)
        if op == "remainder":
            mod = self.libm("fmodf", x, y)
            return b.select(self._sign_differs(mod, y), b.fadd(mod, y), mod)
        if op == "floordiv":
            return self._floordiv_f32(x, y)
        raise CodegenError(f"op {op} is not supported for floats by the CPU code generator")

    def _sign_differs(self, mod: ir.Value, y: ir.Value) -> ir.Value:
        """``mod != 0 && (y < 0) != (mod < 0)`` (the fix-up of torch's remainder and floordiv)."""
        b, zero = self.b, self.f32(0.0)
        differ = b.xor(b.fcmp_ordered("<", y, zero), b.fcmp_ordered("<", mod, zero))
        return b.and_(b.fcmp_unordered("!=", mod, zero), differ)

    def _floordiv_f32(self, x: ir.Value, y: ir.Value) -> ir.Value:
        """c10's div_floor_floating: exact floor of x / y through fmod."""
        b, zero, one = self.b, self.f32(0.0), self.f32(1.0)
        mod = self.libm("fmodf", x, y)
        div = b.fdiv(b.fsub(x, mod), y)
        div = b.select(self._sign_differs(mod, y), b.fsub(div, one), div)
        fl = self.libm("floorf", div)
        fl = b.select(b.fcmp_ordered(">", b.fsub(div, fl), self.f32(0.5)), b.fadd(fl, one), fl)
        q = b.fdiv(x, y)
        signed_zero = self.libm("copysignf", zero, q)
        res = b.select(b.fcmp_unordered("!=", div, zero), fl, signed_zero)
        return b.select(b.fcmp_ordered("==", y, zero), q, res)

    def _binary_int(self, op: str, x: ir.Value, y: ir.Value, dt: DType) -> ir.Value:
        b, ty = self.b, x.type
        bits = _INT_BITS[dt]
        zero, one = ir.Constant(ty, 0), ir.Constant(ty, 1)
        simple = {"add": b.add, "sub": b.sub, "mul": b.mul, "bitwise_and": b.and_,
                  "bitwise_or": b.or_, "bitwise_xor": b.xor}
        if op in ("add", "sub", "mul") and dt == DType.i32:
            # i32 is the kernel IR's index type: index arithmetic never wraps, and saying so
            # (nsw) lets LLVM see that neighbouring elements are neighbouring addresses, which
            # vectorisation needs. (Wrapping i32 *data* arithmetic becomes undefined here.)
            return simple[op](x, y, flags=["nsw"])
        if op in simple:
            return simple[op](x, y)
        if op in BINARY_CMP:
            return b.icmp_signed(_FCMP[op], x, y)
        if op == "maximum":
            return b.select(b.icmp_signed(">", x, y), x, y)
        if op == "minimum":
            return b.select(b.icmp_signed("<", x, y), x, y)
        if op in ("div", "floordiv", "fmod", "remainder"):
            # y == 0 or y == -1 divide by 1 instead (no trap); x / -1 is -x and x % -1 is 0
            minus1 = b.icmp_signed("==", y, ir.Constant(ty, -1))
            safe = b.select(b.or_(b.icmp_signed("==", y, zero), minus1), one, y)
            q = b.select(minus1, b.sub(zero, x), b.sdiv(x, safe))
            r = b.srem(x, safe)
            if op == "div":
                return q
            if op == "fmod":
                return r
            fix = b.and_(b.icmp_signed("!=", r, zero), b.icmp_signed("<", b.xor(r, y), zero))
            if op == "floordiv":
                return b.select(fix, b.sub(q, one), q)
            return b.select(fix, b.add(r, y), r)
        if op == "shl":  # torch: a negative or >= bits shift gives 0
            in_range = b.icmp_unsigned("<", y, ir.Constant(ty, bits))
            return b.select(in_range, b.shl(x, b.and_(y, ir.Constant(ty, bits - 1))), zero)
        if op == "shr":  # ... and the sign fill for a right shift
            in_range = b.icmp_unsigned("<", y, ir.Constant(ty, bits))
            return b.ashr(x, b.select(in_range, y, ir.Constant(ty, bits - 1)))
        if op == "pow":
            return b.call(self._powi(ty), [x, y])
        raise CodegenError(f"op {op} is not supported for {dt.value} by the CPU code generator")

    # -- casts -------------------------------------------------------------------------------
    def cast(self, x: ir.Value, src: DType, dst: DType) -> ir.Value:
        """``x.to(dst)`` with torch's CPU semantics (int → half goes through f32, as c10 does)."""
        b = self.b
        if src == dst:
            return x
        if dst == DType.bool:
            if src.is_float:
                return b.fcmp_unordered("!=", self.to_f32(x, src), self.f32(0.0))
            return b.icmp_signed("!=", x, ir.Constant(x.type, 0))
        if src == DType.bool:
            return b.zext(x, reg_type(dst)) if dst.is_int else self.from_f32(b.uitofp(x, F32), dst)
        if src.is_int and dst.is_int:
            return b.sext(x, I64) if dst == DType.i64 else b.trunc(x, I32)
        if src.is_int:
            return self.from_f32(b.sitofp(x, F32), dst)
        f = self.to_f32(x, src)
        if dst.is_float:
            return self.from_f32(f, dst)
        bits = _INT_BITS[dst]
        ty = reg_type(dst)
        lo, hi = self.f32(-(2.0 ** (bits - 1))), self.f32(2.0 ** (bits - 1))
        ok = b.and_(b.fcmp_ordered(">=", f, lo), b.fcmp_ordered("<", f, hi))
        return b.select(ok, b.fptosi(f, ty), ir.Constant(ty, -(1 << (bits - 1))))

    # -- internal helper functions -----------------------------------------------------------
    def _helper(self, name: str, ret: ir.Type, args: list[ir.Type]) -> tuple[ir.Function, ir.IRBuilder | None]:
        """An internal function of the module; a builder when it still needs a body."""
        fn = self.module.globals.get(name)
        if fn is not None:
            return fn, None
        fn = ir.Function(self.module, ir.FunctionType(ret, args), name)
        fn.linkage = "internal"
        return fn, ir.IRBuilder(fn.append_basic_block("entry"))

    def _powi(self, ty: ir.IntType) -> ir.Function:
        """torch's integer pow: square-and-multiply (wrapping); negative exponents give 0 unless
        the base is ±1."""
        fn, b = self._helper(f"sx.powi.i{ty.width}", ty, [ty, ty])
        if b is None:
            return fn
        fn.attributes.add("alwaysinline")
        a, e = fn.args
        zero, one, minus1 = ir.Constant(ty, 0), ir.Constant(ty, 1), ir.Constant(ty, -1)
        neg_bb, loop_bb, done_bb = (fn.append_basic_block(n) for n in ("neg", "loop", "done"))
        entry = b.block
        b.cbranch(b.icmp_signed("<", e, zero), neg_bb, loop_bb)
        b.position_at_end(neg_bb)
        odd = b.trunc(e, I1)
        r_neg = b.select(b.icmp_signed("==", a, one), one,
                         b.select(b.icmp_signed("==", a, minus1), b.select(odd, minus1, one), zero))
        b.ret(r_neg)
        b.position_at_end(loop_bb)
        res = b.phi(ty)
        base = b.phi(ty)
        exp = b.phi(ty)
        res.add_incoming(one, entry)
        base.add_incoming(a, entry)
        exp.add_incoming(e, entry)
        done = b.icmp_signed("==", exp, zero)
        body_bb = fn.append_basic_block("body")
        b.cbranch(done, done_bb, body_bb)
        b.position_at_end(body_bb)
        res2 = b.select(b.trunc(exp, I1), b.mul(res, base), res)
        res.add_incoming(res2, body_bb)
        base.add_incoming(b.mul(base, base), body_bb)
        exp.add_incoming(b.lshr(exp, one), body_bb)
        b.branch(loop_bb)
        b.position_at_end(done_bb)
        b.ret(res)
        return fn

    def _erfinv(self) -> ir.Function:
        """ATen's calc_erfinv in f32: a rational first guess and two Newton steps."""
        fn, b = self._helper("sx.erfinv", F32, [F32])
        if b is None:
            return fn
        sub = ScalarMath(self.module, b, self.lib)
        (y,) = fn.args
        c = sub.f32

        def poly(z: ir.Value, coeffs: list[float]) -> ir.Value:  # ((c[n]*z + c[n-1])*z + ...) + c[0]
            acc = c(coeffs[-1])
            for k in reversed(coeffs[:-1]):
                acc = b.fadd(b.fmul(acc, z), c(k))
            return acc

        fabs = lambda v: sub.libm("fabsf", v)
        copysign = lambda m, s: sub.libm("copysignf", m, s)
        ya = fabs(y)
        z = b.fmul(y, y)
        num = poly(z, [0.886226899, -1.645349621, 0.914624893, -0.140543331])
        dem = b.fadd(b.fmul(poly(z, [-2.118377725, 1.442710462, -0.329097515, 0.012229801]), z), c(1.0))
        central = b.fdiv(b.fmul(y, num), dem)
        z = sub.libm("sqrtf", b.fneg(sub.libm("logf", b.fdiv(b.fsub(c(1.0), ya), c(2.0)))))
        num = poly(z, [-1.970840454, -1.624906493, 3.429567803, 1.641345311])
        dem = b.fadd(b.fmul(b.fadd(b.fmul(c(1.637067800), z), c(3.543889200)), z), c(1.0))
        tail = b.fdiv(copysign(num, y), dem)
        x = b.select(b.fcmp_ordered("<=", ya, c(0.7)), central, tail)
        two_over_sqrt_pi = _f32(2.0 * _f32(1.0 / math.sqrt(math.pi)))
        for _ in range(2):
            err = b.fsub(sub.libm("erff", x), y)
            slope = b.fmul(c(two_over_sqrt_pi), sub.libm("expf", b.fmul(b.fneg(x), x)))
            x = b.fsub(x, b.fdiv(err, slope))
        x = b.select(b.fcmp_ordered("==", ya, c(1.0)), copysign(c(math.inf), y), x)
        b.ret(b.select(b.fcmp_ordered(">", ya, c(1.0)), c(math.nan), x))
        return fn

    def _digamma(self) -> ir.Function:
        """ATen's calc_digamma(float) (Cephes): reflection for x < 0, recurrence up to 10, then
        the asymptotic series."""
        fn, b = self._helper("sx.digamma", F32, [F32])
        if b is None:
            return fn
        sub = ScalarMath(self.module, b, self.lib)
        c = sub.f32
        (x,) = fn.args
        pos = self._digamma_positive()
        zero_bb, neg_bb, negint_bb, posx_bb = (fn.append_basic_block(n) for n in ("zero", "neg", "negint", "pos"))
        b.cbranch(b.fcmp_ordered("==", x, c(0.0)), zero_bb, neg_bb)
        b.position_at_end(zero_bb)
        b.ret(sub.libm("copysignf", c(math.inf), b.fneg(x)))
        b.position_at_end(neg_bb)
        is_neg = b.fcmp_ordered("<", x, c(0.0))
        tx = sub.libm("truncf", x)
        reflect_bb = fn.append_basic_block("reflect")
        b.cbranch(is_neg, negint_bb, posx_bb)
        b.position_at_end(negint_bb)
        b.cbranch(b.fcmp_ordered("==", x, tx), fn.append_basic_block("nan"), reflect_bb)
        b.position_at_end(fn.blocks[-1])
        b.ret(c(math.nan))
        b.position_at_end(reflect_bb)
        xd = b.fpext(x, F64)
        r = b.fsub(xd, sub.libm("trunc", xd))
        pi = ir.Constant(F64, math.pi)
        pi_over_tan = b.fptrunc(b.fdiv(pi, sub.libm("tan", b.fmul(pi, r))), F32)
        b.ret(b.fsub(b.call(pos, [b.fsub(c(1.0), x)]), pi_over_tan))
        b.position_at_end(posx_bb)
        b.ret(b.call(pos, [x]))
        return fn

    def _digamma_positive(self) -> ir.Function:
        fn, b = self._helper("sx.digamma.pos", F32, [F32])
        if b is None:
            return fn
        sub = ScalarMath(self.module, b, self.lib)
        c = sub.f32
        (x0,) = fn.args
        entry = b.block
        loop_bb, body_bb, after_bb = (fn.append_basic_block(n) for n in ("loop", "body", "after"))
        b.branch(loop_bb)
        b.position_at_end(loop_bb)
        x = b.phi(F32)
        res = b.phi(F32)
        x.add_incoming(x0, entry)
        res.add_incoming(c(0.0), entry)
        b.cbranch(b.fcmp_ordered("<", x, c(10.0)), body_bb, after_bb)
        b.position_at_end(body_bb)
        res.add_incoming(b.fsub(res, b.fdiv(c(1.0), x)), body_bb)
        x.add_incoming(b.fadd(x, c(1.0)), body_bb)
        b.branch(loop_bb)
        b.position_at_end(after_bb)
        coeffs = [8.33333333333333333333e-2, -2.10927960927960927961e-2, 7.57575757575757575758e-3,
                  -4.16666666666666666667e-3, 3.96825396825396825397e-3, -8.33333333333333333333e-3,
                  8.33333333333333333333e-2]
        z = b.fdiv(c(1.0), b.fmul(x, x))
        acc = c(0.0)
        for k in coeffs:  # polevl
            acc = b.fadd(b.fmul(acc, z), c(k))
        y = b.select(b.fcmp_ordered("<", x, c(1.0e17)), b.fmul(z, acc), c(0.0))
        series = b.fsub(b.fsub(b.fadd(res, sub.libm("logf", x)), b.fdiv(c(0.5), x)), y)
        b.ret(b.select(b.fcmp_ordered("==", x, c(10.0)), b.fadd(res, c(2.25175258906672110764)), series))
        return fn


def bf16_bits(f: float) -> int:
    """The bf16 bit pattern of an f32 value, rounded to nearest even as c10 does."""
    if math.isnan(f):
        return 0x7FC0
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16) & 0xFFFF
