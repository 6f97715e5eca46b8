"""Lowerings of elementwise ATen ops: arithmetic, comparisons, math functions, casts."""

from __future__ import annotations

import math

from torch.ops import aten

from sextant.frontend.lowerings.registry import LoweringContext, Unsupported, lower, lower_named, opmath
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

# ATen unary math op -> graph-IR op. Integer inputs of float functions are promoted first.
_UNARY = {
    aten.neg.default: "neg", aten.abs.default: "abs", aten.sign.default: "sign", aten.sgn.default: "sign",
    aten.floor.default: "floor", aten.ceil.default: "ceil", aten.round.default: "round",
    aten.trunc.default: "trunc", aten.exp.default: "exp", aten.exp2.default: "exp2",
    aten.expm1.default: "expm1", aten.log.default: "log", aten.log2.default: "log2",
    aten.log10.default: "log10", aten.log1p.default: "log1p", aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt", aten.reciprocal.default: "reciprocal", aten.sin.default: "sin",
    aten.cos.default: "cos", aten.tan.default: "tan", aten.asin.default: "asin", aten.acos.default: "acos",
    aten.atan.default: "atan", aten.sinh.default: "sinh", aten.cosh.default: "cosh",
    aten.tanh.default: "tanh", aten.asinh.default: "asinh", aten.acosh.default: "acosh",
    aten.atanh.default: "atanh", aten.erf.default: "erf", aten.erfc.default: "erfc",
    aten.erfinv.default: "erfinv", aten.sigmoid.default: "sigmoid", aten.lgamma.default: "lgamma",
    aten.digamma.default: "digamma",
}
_INT_IDENTITY = {"floor", "ceil", "round", "trunc"}


def _unary(op: str):
    def fn(ctx: LoweringContext, x: Node) -> Node:
        out = ctx.out_dtype()
        if op in _INT_IDENTITY and not x.dtype.is_float:
            return x
        if op == "abs" and x.dtype == DType.bool:
            return x
        return ctx.b.unary(op, ctx.b.cast(x, out))

    return fn


for _aten, _op in _UNARY.items():
    lower(_aten)(_unary(_op))


@lower(aten.logical_not.default)
def _logical_not(ctx: LoweringContext, x: Node) -> Node:
    return ctx.b.unary("logical_not", _truthy(ctx, x))


@lower(aten.bitwise_not.default)
def _bitwise_not(ctx: LoweringContext, x: Node) -> Node:
    return ctx.b.unary("bitwise_not", x)


@lower(aten.isnan.default)
def _isnan(ctx: LoweringContext, x: Node) -> Node:
    return ctx.b.unary("isnan", x) if x.dtype.is_float else ctx.b.full(False, x.shape, DType.bool)


@lower(aten.isinf.default)
def _isinf(ctx: LoweringContext, x: Node) -> Node:
    return ctx.b.unary("isinf", x) if x.dtype.is_float else ctx.b.full(False, x.shape, DType.bool)


def _truthy(ctx: LoweringContext, x: Node) -> Node:
    return x if x.dtype == DType.bool else ctx.b.binary("ne", x, 0)


# -- binary arithmetic -----------------------------------------------------------------------
_BOOL_ARITH = {"add": "bitwise_or", "mul": "bitwise_and"}  # torch's meaning of + and * on bools


def _arith(op: str):
    def fn(ctx: LoweringContext, a, b, *, alpha=None) -> Node:
        out = ctx.out_dtype()
        if out == DType.bool and op in _BOOL_ARITH:
            return ctx.b.binary(_BOOL_ARITH[op], a, b, dtype=out)
        if alpha is not None and alpha != 1:
            b = ctx.b.mul(b, alpha) if isinstance(b, Node) else b * alpha
            if isinstance(b, Node):
                b = ctx.b.cast(b, out)
        return ctx.b.binary(op, a, b, dtype=out)

    return fn


for _name, _op in [("add", "add"), ("sub", "sub"), ("mul", "mul")]:
    packet = getattr(aten, _name)
    lower(packet.Tensor, packet.Scalar)(_arith(_op))

for _aten, _op in [(aten.maximum.default, "maximum"), (aten.minimum.default, "minimum"),
                   (aten.fmod.Tensor, "fmod"), (aten.fmod.Scalar, "fmod"),
                   (aten.remainder.Tensor, "remainder"), (aten.remainder.Scalar, "remainder"),
                   (aten.atan2.default, "atan2"), (aten.bitwise_and.Tensor, "bitwise_and"),
                   (aten.bitwise_and.Scalar, "bitwise_and"), (aten.bitwise_or.Tensor, "bitwise_or"),
                   (aten.bitwise_or.Scalar, "bitwise_or"), (aten.bitwise_xor.Tensor, "bitwise_xor"),
                   (aten.bitwise_xor.Scalar, "bitwise_xor"),
                   (aten.bitwise_left_shift.Tensor, "shl"), (aten.bitwise_right_shift.Tensor, "shr")]:
    lower(_aten)(_arith(_op))


@lower(aten.div.Tensor, aten.div.Scalar)
def _div(ctx: LoweringContext, a, b) -> Node:
    return ctx.b.binary("div", a, b, dtype=ctx.out_dtype())


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(ctx: LoweringContext, a, b, *, rounding_mode=None) -> Node:
    out = ctx.out_dtype()
    if rounding_mode is None:
        return ctx.b.binary("div", a, b, dtype=out)
    if out.is_float:
        if rounding_mode == "floor":
            return ctx.b.binary("floordiv", a, b, dtype=out)
        return ctx.b.unary("trunc", ctx.b.binary("div", a, b, dtype=out))
    return ctx.b.binary("floordiv" if rounding_mode == "floor" else "div", a, b, dtype=out)


@lower(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(ctx: LoweringContext, a, b) -> Node:
    return ctx.b.binary("floordiv", a, b, dtype=ctx.out_dtype())


@lower(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def _pow(ctx: LoweringContext, a, b) -> Node:
    out = ctx.out_dtype()
    if isinstance(b, (int, float)) and not isinstance(b, bool) and out.is_float:
        if b == 1:
            return ctx.b.cast(a, out)
        # the exponents torch's own CPU kernel computes without pow (and so to its bits); ``pow`` is a
        # libm call the vectoriser cannot widen (GPT-2's GELU cubes its input in a GEMM's epilogue)
        x = ctx.b.cast(a, out)
        if b == 2:
            return ctx.b.mul(x, x)
        if b == 3:
            return ctx.b.mul(ctx.b.mul(x, x), x)
        if b == 0.5:
            return ctx.b.unary("sqrt", x)
        if b == -0.5:
            return ctx.b.unary("rsqrt", x)
        if b == -1:
            return ctx.b.unary("reciprocal", x)
        if b == -2:
            return ctx.b.unary("reciprocal", ctx.b.mul(x, x))
    return ctx.b.binary("pow", a, b, dtype=out)


# -- comparisons and logic -------------------------------------------------------------------
def _compare(op: str):
    def fn(ctx: LoweringContext, a, b) -> Node:
        return ctx.b.binary(op, a, b, dtype=ctx.promote(a, b))

    return fn


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    packet = getattr(aten, _name)
    lower(packet.Tensor, packet.Scalar)(_compare(_name))


def _logical(op: str):
    def fn(ctx: LoweringContext, a: Node, b: Node) -> Node:
        return ctx.b.binary(op, _truthy(ctx, a), _truthy(ctx, b))

    return fn


lower(aten.logical_and.default)(_logical("bitwise_and"))
lower(aten.logical_or.default)(_logical("bitwise_or"))
lower(aten.logical_xor.default)(_logical("bitwise_xor"))


@lower(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(ctx: LoweringContext, cond: Node, a, b) -> Node:
    return ctx.b.where(cond, a, b, dtype=ctx.out_dtype())


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(ctx: LoweringContext, x: Node, mask: Node, value) -> Node:
    out = ctx.out_dtype()
    x = ctx.b.broadcast_to(x, ctx.out_shape())
    return ctx.b.where(mask, value, x, dtype=out)


@lower(aten.clamp.default, aten.clamp.Tensor)
def _clamp(ctx: LoweringContext, x: Node, lo=None, hi=None) -> Node:
    out = ctx.out_dtype()
    y = ctx.b.cast(x, out)
    if lo is not None:
        y = ctx.b.binary("maximum", y, lo, dtype=out)
    if hi is not None:
        y = ctx.b.binary("minimum", y, hi, dtype=out)
    return ctx.b.broadcast_to(y, ctx.out_shape())


@lower(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(ctx: LoweringContext, x: Node, lo) -> Node:
    return _clamp(ctx, x, lo, None)


@lower(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(ctx: LoweringContext, x: Node, hi) -> Node:
    return _clamp(ctx, x, None, hi)


# -- activations -------------------------------------------------------------------------------
@lower(aten.relu.default)
def _relu(ctx: LoweringContext, x: Node) -> Node:
    if x.dtype == DType.bool:
        raise Unsupported("relu of a bool tensor")
    return ctx.b.maximum(x, 0)


@lower(aten.gelu.default)
def _gelu(ctx: LoweringContext, x: Node, approximate: str = "none") -> Node:
    b = ctx.b
    y = b.cast(x, opmath(x.dtype))
    if approximate == "tanh":
        inner = b.mul(b.add(y, b.mul(b.mul(b.mul(y, y), y), 0.044715)), math.sqrt(2.0 / math.pi))
        out = b.mul(b.mul(y, 0.5), b.add(b.unary("tanh", inner), 1.0))
    else:
        out = b.mul(b.mul(y, 0.5), b.add(b.unary("erf", b.mul(y, 1.0 / math.sqrt(2.0))), 1.0))
    return b.cast(out, x.dtype)


@lower(aten.silu.default)
def _silu(ctx: LoweringContext, x: Node) -> Node:
    y = ctx.b.cast(x, opmath(x.dtype))
    return ctx.b.cast(ctx.b.mul(y, ctx.b.unary("sigmoid", y)), x.dtype)


@lower(aten.hardtanh.default)
def _hardtanh(ctx: LoweringContext, x: Node, lo: float = -1.0, hi: float = 1.0) -> Node:
    return ctx.b.minimum(ctx.b.maximum(x, lo), hi)


@lower(aten.leaky_relu.default)
def _leaky_relu(ctx: LoweringContext, x: Node, slope: float = 0.01) -> Node:
    return ctx.b.where(ctx.b.binary("gt", x, 0), x, ctx.b.mul(x, slope))


@lower(aten.logit.default)
def _logit(ctx: LoweringContext, x: Node, eps=None) -> Node:
    b = ctx.b
    y = b.cast(x, ctx.out_dtype())
    if eps is not None:
        y = b.minimum(b.maximum(y, eps), 1.0 - eps)
    return b.unary("log", b.div(y, b.sub(b.full(1.0, y.shape, y.dtype), y)))


@lower(aten.frac.default)
def _frac(ctx: LoweringContext, x: Node) -> Node:
    return ctx.b.sub(x, ctx.b.unary("trunc", x))


@lower(aten.hypot.default)
def _hypot(ctx: LoweringContext, a: Node, b: Node) -> Node:
    out = ctx.out_dtype()
    x, y = ctx.b.cast(a, out), ctx.b.cast(b, out)
    return ctx.b.unary("sqrt", ctx.b.add(ctx.b.mul(x, x), ctx.b.mul(y, y)))


@lower_named("prims.fma.default")
def _fma(ctx: LoweringContext, a, b, c) -> Node:
    """``a * b + c``: Inductor's decompositions (registered once ``torch._inductor`` is imported)
    leave it, in ``lerp`` — AdamW's moment update. The kernels' ``contract`` flag lets LLVM fuse the
    pair into one FMA again where the target has one."""
    out = ctx.out_dtype()
    a, b, c = (ctx.b.cast(v, out) if isinstance(v, Node) else ctx.b.full(v, ctx.out_shape(), out) for v in (a, b, c))
    return ctx.b.add(ctx.b.mul(a, b), c)


@lower(aten.copysign.Tensor, aten.copysign.Scalar)
def _copysign(ctx: LoweringContext, a, b) -> Node:
    out = ctx.out_dtype()
    mag = ctx.b.unary("abs", ctx.b.cast(a, out)) if isinstance(a, Node) else abs(a)
    bn = ctx.b.cast(b, out) if isinstance(b, Node) else ctx.b.full(b, ctx.out_shape(), out)
    # signbit(b): b < 0, or b is -0.0 (1/b < 0).
    neg = ctx.b.binary("bitwise_or", ctx.b.binary("lt", bn, 0.0),
                       ctx.b.binary("lt", ctx.b.unary("reciprocal", bn), 0.0))
    if not isinstance(mag, Node):
        mag = ctx.b.full(mag, ctx.out_shape(), out)
    return ctx.b.where(neg, ctx.b.unary("neg", mag), mag)


@lower(aten.nan_to_num.default)
def _nan_to_num(ctx: LoweringContext, x: Node, nan=None, posinf=None, neginf=None) -> Node:
    b = ctx.b
    if not x.dtype.is_float:
        return x
    big = {DType.f32: 3.4028234663852886e38, DType.f16: 65504.0, DType.bf16: 3.3895313892515355e38}[x.dtype]
    y = b.where(b.unary("isnan", x), 0.0 if nan is None else nan, x)
    y = b.where(b.binary("eq", y, math.inf), big if posinf is None else posinf, y)
    return b.where(b.binary("eq", y, -math.inf), -big if neginf is None else neginf, y)


@lower(aten.round.decimals)
def _round_decimals(ctx: LoweringContext, x: Node, *, decimals: int = 0) -> Node:
    """torch: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for negative d."""
    b = ctx.b
    scale = float(10.0 ** abs(decimals))
    if decimals >= 0:
        return b.div(b.unary("round", b.mul(x, scale)), scale)
    return b.mul(b.unary("round", b.div(x, scale)), scale)


@lower(aten.elu.default)
def _elu(ctx: LoweringContext, x: Node, alpha=1, scale=1, input_scale=1) -> Node:
    b = ctx.b
    neg = b.mul(b.unary("expm1", b.mul(x, float(input_scale))), float(alpha) * float(scale))
    return b.where(b.binary("gt", x, 0), b.mul(x, float(scale)), neg)


def _nan_ignoring(op: str):
    """fmax/fmin: like maximum/minimum, but a NaN loses against a number."""

    def fn(ctx: LoweringContext, a: Node, other: Node) -> Node:
        b, out = ctx.b, ctx.out_dtype()
        x, y = b.cast(a, out), b.cast(other, out)
        m = b.binary(op, x, y)
        if not out.is_float:
            return m
        x, y = b.broadcast(x, y)
        return b.where(b.unary("isnan", x), y, b.where(b.unary("isnan", y), x, m))

    return fn


lower(aten.fmax.default)(_nan_ignoring("maximum"))
lower(aten.fmin.default)(_nan_ignoring("minimum"))


@lower(aten.ldexp.Tensor)
def _ldexp(ctx: LoweringContext, x: Node, e: Node) -> Node:
    out = ctx.out_dtype()
    two = ctx.b.full(2.0, e.shape, out)
    return ctx.b.mul(ctx.b.cast(x, out), ctx.b.binary("pow", two, ctx.b.cast(e, out)))


def _sign_bit(ctx: LoweringContext, x: Node) -> Node:
    """x < 0, counting -0.0 (1/x < 0) as negative."""
    b = ctx.b
    neg = b.binary("lt", x, 0)
    if not x.dtype.is_float:
        return neg
    return b.binary("bitwise_or", neg, b.binary("lt", b.unary("reciprocal", x), 0.0))


@lower(aten.signbit.default)
def _signbit(ctx: LoweringContext, x: Node) -> Node:
    return ctx.b.full(False, x.shape, DType.bool) if x.dtype == DType.bool else _sign_bit(ctx, x)


@lower(aten.angle.default)
def _angle(ctx: LoweringContext, x: Node) -> Node:
    """Real inputs: pi for negatives, 0 otherwise, NaN stays NaN."""
    b, out = ctx.b, ctx.out_dtype()
    y = b.cast(x, out)
    return b.where(b.unary("isnan", y), y, b.where(b.binary("lt", y, 0), math.pi, b.full(0.0, y.shape, out)))


@lower(aten.polygamma.default)
def _polygamma(ctx: LoweringContext, n: int, x: Node) -> Node:
    if n != 0:
        raise Unsupported("polygamma of order n > 0 (only order 0, digamma, has a primitive)")
    return ctx.b.unary("digamma", ctx.b.cast(x, ctx.out_dtype()))


# -- casts and identities ----------------------------------------------------------------------
@lower(aten._to_copy.default)
def _to_copy(ctx: LoweringContext, x: Node, **kwargs) -> Node:
    return ctx.b.cast(x, ctx.out_dtype())


@lower(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default,
       aten.contiguous.default, aten.positive.default)
def _identity(ctx: LoweringContext, x: Node, *args, **kwargs) -> Node:
    return x


@lower(aten.copy.default)
def _copy(ctx: LoweringContext, dst: Node, src: Node, non_blocking: bool = False) -> Node:
    return ctx.b.broadcast_to(ctx.b.cast(src, dst.dtype), dst.shape)


@lower(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
       aten.sym_constrain_range_for_size.default, aten._assert_async.msg)
def _no_op(ctx: LoweringContext, *args, **kwargs) -> None:
    return None
