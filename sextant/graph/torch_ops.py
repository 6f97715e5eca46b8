"""The graph IR's elementwise ops as torch functions: the one definition of what each op computes.

The reference executor (``sextant.graph.reference``) applies them to tensors, the kernel
evaluator (:mod:`sextant.kernel.evaluate`) to scalars of the exact dtype, so the oracle and the
verifier's concrete runs agree by construction. It is a public module of the graph layer (which
the kernel layer builds on: dtypes, op sets, sizes), so neither reaches into the other's private
tables and the graph layer imports nothing from the kernel layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round, "trunc": torch.trunc, "bitwise_not": torch.bitwise_not,
    "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log, "log2": torch.log2,
    "log10": torch.log10, "log1p": torch.log1p, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos, "tan": torch.tan,
    "asin": torch.asin, "acos": torch.acos, "atan": torch.atan, "sinh": torch.sinh, "cosh": torch.cosh,
    "tanh": torch.tanh, "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh,
    "erf": torch.erf, "erfc": torch.erfc, "erfinv": torch.erfinv, "sigmoid": torch.sigmoid,
    "lgamma": torch.lgamma, "digamma": torch.digamma,
    "logical_not": torch.logical_not, "isnan": torch.isnan, "isinf": torch.isinf,
}


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype.is_floating_point:
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": _div,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "fmod": torch.fmod, "remainder": torch.remainder, "maximum": torch.maximum, "minimum": torch.minimum,
    "pow": torch.pow, "atan2": torch.atan2, "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor, "shl": torch.bitwise_left_shift, "shr": torch.bitwise_right_shift,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
}
