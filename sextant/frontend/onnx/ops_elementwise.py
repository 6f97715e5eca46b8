"""ONNX elementwise ops: arithmetic, math functions, activations, comparisons, logic, casts.

ONNX broadcasts numpy-style and never promotes types (both operands of Add have one type), so
most ops map straight onto sextant's ATen lowerings (one lowering for both frontends) or onto
the builder's broadcasting ops. The exceptions are spelled out where they occur: integer Div
truncates, Pow keeps the base's type, Mod's sign follows the divisor unless ``fmod=1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import reduce

import torch
from torch.ops import aten

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.onnx.dtypes import from_onnx, unsupported_dtype
from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

# ONNX op → the ATen op that has exactly its semantics for ONNX's (unpromoted) operand types.
_UNARY_ATEN = {
    "Neg": aten.neg.default, "Abs": aten.abs.default, "Sqrt": aten.sqrt.default, "Exp": aten.exp.default,
    "Log": aten.log.default, "Reciprocal": aten.reciprocal.default, "Floor": aten.floor.default,
    "Ceil": aten.ceil.default, "Round": aten.round.default, "Sign": aten.sign.default, "Sin": aten.sin.default,
    "Cos": aten.cos.default, "Tan": aten.tan.default, "Asin": aten.asin.default, "Acos": aten.acos.default,
    "Atan": aten.atan.default, "Sinh": aten.sinh.default, "Cosh": aten.cosh.default, "Tanh": aten.tanh.default,
    "Asinh": aten.asinh.default, "Acosh": aten.acosh.default, "Atanh": aten.atanh.default,
    "Erf": aten.erf.default, "Sigmoid": aten.sigmoid.default, "Relu": aten.relu.default,
    "Not": aten.logical_not.default, "IsNaN": aten.isnan.default, "BitwiseNot": aten.bitwise_not.default,
}
_BINARY_ATEN = {
    "Add": aten.add.Tensor, "Sub": aten.sub.Tensor, "Mul": aten.mul.Tensor,
    "Equal": aten.eq.Tensor, "Less": aten.lt.Tensor, "Greater": aten.gt.Tensor,
    "LessOrEqual": aten.le.Tensor, "GreaterOrEqual": aten.ge.Tensor,
    "And": aten.logical_and.default, "Or": aten.logical_or.default, "Xor": aten.logical_xor.default,
    "BitwiseAnd": aten.bitwise_and.Tensor, "BitwiseOr": aten.bitwise_or.Tensor,
    "BitwiseXor": aten.bitwise_xor.Tensor,
}
_VARIADIC_ATEN = {"Max": aten.maximum.default, "Min": aten.minimum.default, "Sum": aten.add.Tensor}


def _unary(op: torch._ops.OpOverload) -> Callable[..., Node]:
    def fn(ctx: OnnxContext, x: Node) -> Node:
        return ctx.aten(op, x)
    return fn


def _binary(op: torch._ops.OpOverload) -> Callable[..., Node]:
    def fn(ctx: OnnxContext, a: Node, b: Node) -> Node:
        return ctx.aten(op, a, b)
    return fn


def _variadic(op: torch._ops.OpOverload) -> Callable[..., Node]:
    """Max/Min/Sum of one or more inputs, broadcast together (a single input passes through)."""
    def fn(ctx: OnnxContext, *xs: Node | None) -> Node:
        nodes = [x for x in xs if x is not None]
        if not nodes:
            raise Unsupported(f"{ctx.op_type} needs at least one input")
        return reduce(lambda a, b: ctx.aten(op, a, b), nodes)
    return fn


for _name, _op in _UNARY_ATEN.items():
    onnx_op(_name)(_unary(_op))
for _name, _op in _BINARY_ATEN.items():
    onnx_op(_name)(_binary(_op))
for _name, _op in _VARIADIC_ATEN.items():
    onnx_op(_name)(_variadic(_op))



def _in_opmath(ctx: OnnxContext, x: Node, fn: Callable[[Node], Node]) -> Node:
    """Compute a composite activation of f16/bf16 in f32 and round once, as torch does."""
    y = ctx.b.cast(x, DType.f32) if x.dtype in (DType.f16, DType.bf16) else x
    return ctx.b.cast(fn(y), x.dtype)


# -- arithmetic ------------------------------------------------------------------------------
@onnx_op("Div")
def _div(ctx: OnnxContext, a: Node, b: Node) -> Node:
    return ctx.b.div(a, b)  # integer Div truncates toward zero (C semantics), as the graph IR's div does


@onnx_op("Mod")
def _mod(ctx: OnnxContext, a: Node, b: Node) -> Node:
    """fmod=1: C fmod (sign of the dividend); fmod=0: Python % (sign of the divisor). ONNX requires
    fmod=1 for floats; like onnx's reference, floats always get fmod."""
    if ctx.attr("fmod", 0) or a.dtype.is_float:
        return ctx.aten(aten.fmod.Tensor, a, b)
    return ctx.aten(aten.remainder.Tensor, a, b)


@onnx_op("Pow")
def _pow(ctx: OnnxContext, x: Node, y: Node) -> Node:
    """The exponent may have another type (opset 12+); the result has the base's type, computed in
    the promoted type (int base ** float exponent in float, then truncated, like numpy's astype)."""
    return ctx.b.cast(ctx.aten(aten.pow.Tensor_Tensor, x, y), x.dtype)


@onnx_op("Mean")
def _mean(ctx: OnnxContext, *xs: Node | None) -> Node:
    nodes = [x for x in xs if x is not None]
    total = _variadic(aten.add.Tensor)(ctx, *nodes)
    return total if len(nodes) == 1 else ctx.b.div(total, float(len(nodes)))


@onnx_op("BitShift")
def _bitshift(ctx: OnnxContext, x: Node, y: Node) -> Node:
    """ONNX defines BitShift on unsigned types only, which sextant lacks; on i32/i64 RIGHT is arithmetic."""
    direction = ctx.attr("direction", "")
    if direction not in ("LEFT", "RIGHT"):
        raise Unsupported(f"BitShift: direction must be LEFT or RIGHT, got {direction!r}")
    op = aten.bitwise_left_shift.Tensor if direction == "LEFT" else aten.bitwise_right_shift.Tensor
    return ctx.aten(op, x, y)


# -- classification --------------------------------------------------------------------------
@onnx_op("IsInf")
def _isinf(ctx: OnnxContext, x: Node) -> Node:
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    if not x.dtype.is_float or not (pos or neg):
        return ctx.b.full(False, x.shape, DType.bool)
    if pos and neg:
        return ctx.aten(aten.isinf.default, x)
    return ctx.b.binary("eq", x, math.inf if pos else -math.inf)


@onnx_op("Where")
def _where(ctx: OnnxContext, cond: Node, x: Node, y: Node) -> Node:
    return ctx.aten(aten.where.self, cond, x, y)


# -- casts -----------------------------------------------------------------------------------
@onnx_op("Cast")
def _cast(ctx: OnnxContext, x: Node) -> Node:
    """``saturate``/``round_mode`` only concern float8/float4 targets, which sextant lacks anyway."""
    to = ctx.attr("to")
    dtype = from_onnx(int(to)) if to is not None else None
    if dtype is None:
        raise Unsupported(f"Cast: target {unsupported_dtype(int(to))}" if to is not None
                          else "Cast: the 'to' attribute is missing")
    return ctx.b.cast(x, dtype)


@onnx_op("CastLike")
def _cast_like(ctx: OnnxContext, x: Node, like: Node) -> Node:
    return ctx.b.cast(x, like.dtype)


@onnx_op("Dropout")
def _dropout(ctx: OnnxContext, x: Node, ratio: Node | None = None, training: Node | None = None) -> list[Node]:
    """Inference is the identity (the mask all true). Training mode (opset 12+) is random unless the
    ratio is 0, so only that case is accepted."""
    if training is not None and not ctx.is_const(training):
        raise Unsupported("Dropout: training_mode is a graph input; sextant compiles inference, so it "
                          "must be a constant (false, or true with ratio 0)")
    if training is not None and bool(ctx.const(training).reshape(-1)[0]):
        r = 0.5 if ratio is None else float(ctx.const(ratio, "ratio").reshape(-1)[0])
        if r != 0:
            raise Unsupported(f"Dropout: training_mode=true with ratio {r} draws random numbers; sextant "
                              "compiles inference (export the model in eval mode)")
    if ctx.num_outputs < 2 or not ctx.node.output[1]:
        return [x]
    mask_dtype = DType.bool if ctx.opset >= 10 else x.dtype  # opset 7–9: the mask has the input's type
    return [x, ctx.b.full(True, x.shape, mask_dtype)]


# -- activations -----------------------------------------------------------------------------
@onnx_op("LeakyRelu")
def _leaky_relu(ctx: OnnxContext, x: Node) -> Node:
    return ctx.aten(aten.leaky_relu.default, x, float(ctx.attr("alpha", 0.01)))


@onnx_op("PRelu")
def _prelu(ctx: OnnxContext, x: Node, slope: Node) -> Node:
    """The slope broadcasts to x (unidirectionally: per-channel slopes come shaped [C, 1, 1])."""
    b = ctx.b
    return b.where(b.binary("lt", x, 0), b.mul(x, slope), x)


@onnx_op("Elu")
def _elu(ctx: OnnxContext, x: Node) -> Node:
    return ctx.aten(aten.elu.default, x, float(ctx.attr("alpha", 1.0)))


@onnx_op("Selu")
def _selu(ctx: OnnxContext, x: Node) -> Node:
    alpha = float(ctx.attr("alpha", 1.67326319217681884765625))
    gamma = float(ctx.attr("gamma", 1.05070102214813232421875))
    return ctx.aten(aten.elu.default, x, alpha, gamma)


@onnx_op("Celu")
def _celu(ctx: OnnxContext, x: Node) -> Node:
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1)): an ELU with input scale 1/alpha."""
    alpha = float(ctx.attr("alpha", 1.0))
    return ctx.aten(aten.elu.default, x, alpha, 1.0, 1.0 / alpha)


def _hard_sigmoid(ctx: OnnxContext, x: Node, alpha: float, beta: float) -> Node:
    return ctx.b.minimum(ctx.b.maximum(ctx.b.add(ctx.b.mul(x, alpha), beta), 0.0), 1.0)


@onnx_op("HardSigmoid")
def _hardsigmoid(ctx: OnnxContext, x: Node) -> Node:
    return _hard_sigmoid(ctx, x, float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5)))


@onnx_op("HardSwish")
def _hardswish(ctx: OnnxContext, x: Node) -> Node:
    return _in_opmath(ctx, x, lambda y: ctx.b.mul(y, _hard_sigmoid(ctx, y, 1.0 / 6.0, 0.5)))


def _softplus_of(ctx: OnnxContext, x: Node) -> Node:
    """log(1 + exp(x)) written as max(x, 0) + log1p(exp(-|x|)), which cannot overflow."""
    b = ctx.b
    return b.add(b.maximum(x, 0.0), b.unary("log1p", b.unary("exp", b.unary("neg", b.unary("abs", x)))))


@onnx_op("Softplus")
def _softplus(ctx: OnnxContext, x: Node) -> Node:
    return _in_opmath(ctx, x, lambda y: _softplus_of(ctx, y))


@onnx_op("Softsign")
def _softsign(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    return _in_opmath(ctx, x, lambda y: b.div(y, b.add(b.unary("abs", y), 1.0)))


@onnx_op("Mish")
def _mish(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    return _in_opmath(ctx, x, lambda y: b.mul(y, b.unary("tanh", _softplus_of(ctx, y))))


@onnx_op("Gelu")
def _gelu(ctx: OnnxContext, x: Node) -> Node:
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise Unsupported(f"Gelu: approximate={approximate!r} (only 'none' and 'tanh')")
    return ctx.aten(aten.gelu.default, x, approximate=approximate)


@onnx_op("Swish")
def _swish(ctx: OnnxContext, x: Node) -> Node:
    alpha = float(ctx.attr("alpha", 1.0))
    if alpha == 1.0:
        return ctx.aten(aten.silu.default, x)
    b = ctx.b
    return _in_opmath(ctx, x, lambda y: b.mul(y, b.unary("sigmoid", b.mul(y, alpha))))


@onnx_op("ThresholdedRelu")
def _thresholded_relu(ctx: OnnxContext, x: Node) -> Node:
    b = ctx.b
    return b.where(b.binary("gt", x, float(ctx.attr("alpha", 1.0))), x, 0.0)


@onnx_op("Shrink")
def _shrink(ctx: OnnxContext, x: Node) -> Node:
    """x + bias below -lambd, x - bias above lambd, else 0. Integer inputs compare and shift in f32
    (lambd and bias are floats) and truncate back, like onnx's reference."""
    b = ctx.b
    lambd, bias = float(ctx.attr("lambd", 0.5)), float(ctx.attr("bias", 0.0))
    y = x if x.dtype.is_float else b.cast(x, DType.f32)
    out = b.where(b.binary("lt", y, -lambd), b.add(y, bias),
                  b.where(b.binary("gt", y, lambd), b.sub(y, bias), 0.0))
    return b.cast(out, x.dtype)


@onnx_op("Clip")
def _clip(ctx: OnnxContext, x: Node, lo: Node | None = None, hi: Node | None = None) -> Node:
    """Bounds are attributes before opset 11 and optional (possibly dynamic) scalar inputs since.
    min > max yields max everywhere, as max(min(.)) composes."""
    if ctx.opset < 11:
        lo_v, hi_v = ctx.attr("min"), ctx.attr("max")
        if lo_v is None and hi_v is None:
            return x
        return ctx.aten(aten.clamp.default, x, lo_v, hi_v)
    if lo is None and hi is None:
        return x
    return ctx.aten(aten.clamp.Tensor, x, lo, hi)
