"""ONNX compute ops: MatMul, Gemm, Conv, ConvTranspose, pooling, Resize."""

from __future__ import annotations

from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.ir import Node


@onnx_op("MatMul")
def _matmul(ctx: OnnxContext, a: Node, b: Node) -> Node:
    return ctx.b.matmul(a, b)
