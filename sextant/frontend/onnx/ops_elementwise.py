"""ONNX elementwise ops: arithmetic, math functions, activations, comparisons, logic, casts.

ONNX broadcasts numpy-style and never promotes types (both operands of Add have one type), so
most ops map straight onto the builder's broadcasting binary/unary ops.
"""

from __future__ import annotations

from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.ir import Node

_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Max": "maximum", "Min": "minimum"}
_UNARY = {"Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Neg": "neg", "Abs": "abs", "Tanh": "tanh",
          "Sigmoid": "sigmoid", "Reciprocal": "reciprocal", "Floor": "floor", "Ceil": "ceil", "Erf": "erf",
          "Sin": "sin", "Cos": "cos"}


def _binary(op: str):
    def fn(ctx: OnnxContext, a: Node, b: Node) -> Node:
        return ctx.b.binary(op, a, b)
    return fn


def _unary(op: str):
    def fn(ctx: OnnxContext, x: Node) -> Node:
        return ctx.b.unary(op, x)
    return fn


for _name, _op in _BINARY.items():
    onnx_op(_name)(_binary(_op))
for _name, _op in _UNARY.items():
    onnx_op(_name)(_unary(_op))


@onnx_op("Div")
def _div(ctx: OnnxContext, a: Node, b: Node) -> Node:
    return ctx.b.div(a, b)  # integer Div truncates (C semantics), as the graph IR's div does


@onnx_op("Relu")
def _relu(ctx: OnnxContext, x: Node) -> Node:
    return ctx.b.maximum(x, 0)
