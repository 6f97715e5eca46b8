"""The primitive op set of the graph IR and the typing rule of each op.

Every supported ATen op lowers onto these (see ``sextant/frontend/lowerings``). Elementwise
ops require their operands to have identical shapes and dtypes: broadcasting and type
promotion are explicit ``expand`` and ``cast`` nodes, so later stages never guess.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sextant.graph.dtypes import DType
from sextant.graph.symbolic import Dim, SymDim, is_dim

Shape = tuple[Dim, ...]  # ints, or symbolic sizes (sextant/graph/symbolic.py)


@dataclass(frozen=True, slots=True)
class TensorType:
    """Shape and element type of a value; a dimension is an ``int`` or a :class:`SymDim`."""

    shape: Shape
    dtype: DType

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(map(str, self.shape))}]"


class IRTypeError(TypeError):
    """An op was given operands or attributes its typing rule rejects."""


# fmt: off
UNARY_FLOAT = frozenset({
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh",
    "erf", "erfc", "erfinv", "sigmoid", "lgamma", "digamma",
})
UNARY_ANY = frozenset({"neg", "abs", "sign", "floor", "ceil", "round", "trunc", "bitwise_not"})
UNARY = UNARY_FLOAT | UNARY_ANY | {"logical_not", "isnan", "isinf"}
BINARY_ARITH = frozenset({"add", "sub", "mul", "div", "floordiv", "fmod", "remainder",
                          "maximum", "minimum", "pow", "atan2", "bitwise_and", "bitwise_or",
                          "bitwise_xor", "shl", "shr"})
BINARY_CMP = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
BINARY = BINARY_ARITH | BINARY_CMP
REDUCE_FNS = frozenset({"sum", "prod", "max", "min"})
MOVEMENT = frozenset({"reshape", "permute", "expand", "slice", "pad", "concat", "gather"})
SOURCES = frozenset({"input", "param", "full", "iota"})
ALL_OPS = (UNARY | BINARY | MOVEMENT | SOURCES
           | {"where", "cast", "copy", "reduce", "matmul", "conv", "extern", "scatter", "random", "collective",
              "wait"})
# fmt: on

_FLOAT_ONLY_BINARY = frozenset({"atan2"})
_INT_ONLY = frozenset({"bitwise_and", "bitwise_or", "bitwise_xor", "shl", "shr", "bitwise_not"})


def is_elementwise(op: str) -> bool:
    return op in UNARY or op in BINARY or op in ("where", "cast", "copy")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise IRTypeError(msg)


def _ints(v: Any, what: str) -> tuple[Dim, ...]:
    _check(isinstance(v, tuple) and all(is_dim(i) for i in v), f"{what} must be a tuple of sizes, got {v!r}")
    return v


def infer_type(op: str, ins: Sequence[TensorType], attrs: dict[str, Any]) -> TensorType:
    """Return the result type of ``op`` applied to operands of types ``ins``.

    Raises IRTypeError naming the rule that is violated. Used both when nodes are built and
    by the verifier, so a graph can never hold a node its own rules reject.
    """
    n = len(ins)
    if op in SOURCES:
        _check(n == 0, f"{op} takes no operands")
        shape = _ints(attrs.get("shape"), f"{op}.shape")
        _check(all(d >= 0 for d in shape), f"{op}: negative dimension in {shape}")
        dtype = attrs.get("dtype")
        _check(isinstance(dtype, DType), f"{op}.dtype must be a DType")
        if op == "iota":
            _check(0 <= attrs.get("axis", -1) < len(shape), f"iota axis {attrs.get('axis')} out of range")
            _check(dtype != DType.bool, "iota cannot be bool")
        if op in ("input", "param"):
            _check(isinstance(attrs.get("name"), str), f"{op} needs a name")
        if op == "full":
            value = attrs.get("value")
            _check(isinstance(value, (int, float, bool)) or (isinstance(value, SymDim) and dtype.is_int),
                   "full.value must be a number (or a size, for an integer fill)")
        return TensorType(shape, dtype)

    if op == "random":  # Philox numbers keyed by the call's seed (graph/philox.py)
        _check(n == 1 and ins[0].dtype == DType.i64 and ins[0].rank == 0, "random takes one operand, the i64[] seed")
        shape = _ints(attrs.get("shape"), "random.shape")
        _check(isinstance(attrs.get("dtype"), DType) and attrs["dtype"].is_float, "random.dtype must be a float type")
        _check(attrs.get("dist") in ("uniform", "normal"), "random.dist must be 'uniform' or 'normal'")
        _check(isinstance(attrs.get("stream"), int) and attrs["stream"] >= 0, "random.stream must be an index")
        return TensorType(shape, attrs["dtype"])

    if op == "extern":  # an op called as itself (sextant/graph/extern.py): its type is what torch recorded
        _check(all(isinstance(attrs.get(k), str) for k in ("fn", "args", "kwargs")),
               "extern needs fn, args and kwargs (strings)")
        _check(isinstance(attrs.get("result"), int) and attrs["result"] >= 0, "extern.result must be an index")
        shape = _ints(attrs.get("shape"), "extern.shape")
        _check(isinstance(attrs.get("dtype"), DType), "extern.dtype must be a DType")
        return TensorType(shape, attrs["dtype"])

    if op == "collective":  # a transfer between ranks, started (graph/collectives.py)
        from sextant.graph.collectives import check_attrs, result_shape

        _check(n == 1, f"collective takes 1 operand, got {n}")
        why = check_attrs(attrs.get("kind"), attrs)
        _check(why is None, why or "")
        try:
            return TensorType(result_shape(attrs["kind"], ins[0].shape, attrs), ins[0].dtype)
        except ValueError as e:
            raise IRTypeError(str(e)) from None

    if op == "wait":  # a collective's value once it has arrived
        _check(n == 1, f"wait takes 1 operand, got {n}")
        return ins[0]

    if op in UNARY:
        _check(n == 1, f"{op} takes 1 operand, got {n}")
        (t,) = ins
        if op in UNARY_FLOAT:
            _check(t.dtype.is_float, f"{op} needs a float operand, got {t.dtype.value}")
        if op in _INT_ONLY:
            _check(not t.dtype.is_float, f"{op} needs an integer or bool operand, got {t.dtype.value}")
        if op in ("logical_not", "isnan", "isinf"):
            return TensorType(t.shape, DType.bool)
        _check(t.dtype != DType.bool or op in ("bitwise_not",), f"{op} does not take bool operands")
        return t

    if op in BINARY:
        _check(n == 2, f"{op} takes 2 operands, got {n}")
        a, b = ins
        _check(a == b, f"{op} operands must have identical types, got {a} and {b}")
        if op in _FLOAT_ONLY_BINARY:
            _check(a.dtype.is_float, f"{op} needs float operands")
        if op in _INT_ONLY:
            _check(not a.dtype.is_float, f"{op} needs integer or bool operands")
        if op in BINARY_CMP:
            return TensorType(a.shape, DType.bool)
        if a.dtype == DType.bool:
            _check(op in ("bitwise_and", "bitwise_or", "bitwise_xor", "maximum", "minimum"),
                   f"{op} does not take bool operands")
        return a

    if op == "where":
        _check(n == 3, "where takes 3 operands")
        c, a, b = ins
        _check(c.dtype == DType.bool, f"where condition must be bool, got {c.dtype.value}")
        _check(a == b and c.shape == a.shape, f"where operands must match: {c}, {a}, {b}")
        return a

    if op == "copy":  # the value itself, in a buffer of its own (what an update in place may overwrite)
        _check(n == 1, "copy takes 1 operand")
        return ins[0]

    if op == "scatter":  # ``x`` with ``src``'s slices along ``axis`` written (``reduce="add"``: added) at ``index``
        _check(n == 3, "scatter takes 3 operands (x, index, src)")
        x, index, src = ins
        axis = attrs.get("axis")
        _check(isinstance(axis, int) and 0 <= axis < x.rank, f"scatter axis {axis!r} out of range for {x}")
        reduce = attrs.get("reduce")
        _check(reduce in (None, "add"), f"scatter reduce must be absent or \"add\", got {reduce!r}")
        _check(reduce is None or x.dtype != DType.bool, "scatter reduce=\"add\" does not take a bool tensor")
        _check(index.rank == 1 and not index.dtype.is_float and index.dtype != DType.bool,
               f"scatter index must be a 1-D integer tensor, got {index}")
        want = x.shape[:axis] + (index.shape[0],) + x.shape[axis + 1:]
        _check(src.dtype == x.dtype and src.shape == want,
               f"scatter source must be {x.dtype.value}[{','.join(map(str, want))}], got {src}")
        return x

    if op == "cast":
        _check(n == 1, "cast takes 1 operand")
        dtype = attrs.get("dtype")
        _check(isinstance(dtype, DType), "cast.dtype must be a DType")
        return TensorType(ins[0].shape, dtype)

    if op == "reduce":
        _check(n == 1, "reduce takes 1 operand")
        (t,) = ins
        fn = attrs.get("fn")
        _check(fn in REDUCE_FNS, f"unknown reduction {fn!r}")
        axes = _ints(attrs.get("axes"), "reduce.axes")
        _check(len(set(axes)) == len(axes) and all(0 <= a < t.rank for a in axes),
               f"reduce axes {axes} invalid for rank {t.rank}")
        _check(t.dtype != DType.bool or fn in ("max", "min"), f"reduce {fn} does not take bool")
        return TensorType(tuple(1 if i in axes else d for i, d in enumerate(t.shape)), t.dtype)

    if op == "reshape":
        _check(n == 1, "reshape takes 1 operand")
        shape = _ints(attrs.get("shape"), "reshape.shape")
        _check(math.prod(shape) == ins[0].numel, f"cannot reshape {ins[0]} to {list(shape)}")
        return TensorType(shape, ins[0].dtype)

    if op == "permute":
        _check(n == 1, "permute takes 1 operand")
        perm = _ints(attrs.get("perm"), "permute.perm")
        t = ins[0]
        _check(sorted(perm) == list(range(t.rank)), f"permute {perm} is not a permutation of rank {t.rank}")
        return TensorType(tuple(t.shape[p] for p in perm), t.dtype)

    if op == "expand":
        _check(n == 1, "expand takes 1 operand")
        shape = _ints(attrs.get("shape"), "expand.shape")
        t = ins[0]
        _check(len(shape) == t.rank and all(s == d or d == 1 for s, d in zip(shape, t.shape)),
               f"cannot expand {t} to {list(shape)} (only size-1 dims expand, rank must match)")
        return TensorType(shape, t.dtype)

    if op == "slice":
        _check(n == 1, "slice takes 1 operand")
        t = ins[0]
        start, step, size = (_ints(attrs.get(k), f"slice.{k}") for k in ("start", "step", "size"))
        _check(len(start) == len(step) == len(size) == t.rank, "slice start/step/size must have one entry per dim")
        for d, (s, st, sz) in enumerate(zip(start, step, size)):
            _check(st != 0 and sz >= 0, f"slice dim {d}: step must be non-zero and size >= 0")
            if sz > 0:
                last = s + (sz - 1) * st
                _check(0 <= s < t.shape[d] and 0 <= last < t.shape[d],
                       f"slice dim {d} reads indices {s}..{last} of a dim of size {t.shape[d]}")
        return TensorType(size, t.dtype)

    if op == "pad":
        _check(n == 1, "pad takes 1 operand")
        t = ins[0]
        low, high = _ints(attrs.get("low"), "pad.low"), _ints(attrs.get("high"), "pad.high")
        _check(len(low) == len(high) == t.rank and min(low + high, default=0) >= 0,
               "pad low/high need one non-negative entry per dim")
        _check(isinstance(attrs.get("value"), (int, float, bool)), "pad.value must be a number")
        return TensorType(tuple(d + lo + hi for d, lo, hi in zip(t.shape, low, high)), t.dtype)

    if op == "concat":
        _check(n >= 1, "concat takes at least 1 operand")
        axis = attrs.get("axis")
        t0 = ins[0]
        _check(isinstance(axis, int) and 0 <= axis < t0.rank, f"concat axis {axis} invalid")
        for t in ins[1:]:
            _check(t.dtype == t0.dtype and t.rank == t0.rank
                   and all(a == b for i, (a, b) in enumerate(zip(t.shape, t0.shape)) if i != axis),
                   f"concat operands disagree: {t0} vs {t} along axis {axis}")
        shape = list(t0.shape)
        shape[axis] = sum(t.shape[axis] for t in ins)
        return TensorType(tuple(shape), t0.dtype)

    if op == "gather":
        _check(n == 2, "gather takes 2 operands (source, index)")
        x, idx = ins
        axis = attrs.get("axis")
        _check(idx.dtype.is_int, f"gather index must be i32/i64, got {idx.dtype.value}")
        _check(x.rank == idx.rank, f"gather index rank {idx.rank} must equal source rank {x.rank}")
        _check(isinstance(axis, int) and 0 <= axis < x.rank, f"gather axis {axis} invalid")
        _check(all(i <= s for d, (i, s) in enumerate(zip(idx.shape, x.shape)) if d != axis),
               f"gather index {idx} larger than source {x} outside axis {axis}")
        return TensorType(idx.shape, x.dtype)

    if op == "matmul":
        _check(n == 2, "matmul takes 2 operands")
        a, b = ins
        _check(a.dtype == b.dtype and a.dtype != DType.bool, f"matmul dtypes {a.dtype.value}, {b.dtype.value}")
        _check(a.rank >= 2 and a.rank == b.rank and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2],
               f"matmul shapes do not line up: {a} @ {b} (batch dims must be equal, inner dims must match)")
        out = attrs.get("out_dtype", a.dtype)  # f16/bf16 x f16/bf16 -> f32: a tensor core's own product
        _check(out == a.dtype or (out == DType.f32 and a.dtype in (DType.f16, DType.bf16)),
               f"matmul out_dtype {getattr(out, 'value', out)} must be f32 or the operands' {a.dtype.value}")
        return TensorType(a.shape[:-1] + (b.shape[-1],), out)

    if op == "conv":
        _check(n == 2, "conv takes 2 operands (input, weight); bias is a separate add")
        x, w = ins
        _check(x.dtype == w.dtype and x.dtype.is_float, "conv needs float operands of one dtype")
        nsp = x.rank - 2
        _check(1 <= nsp <= 3 and w.rank == x.rank, f"conv needs rank 3..5 input and same-rank weight, got {x}, {w}")
        stride, padding, dilation = (_ints(attrs.get(k), f"conv.{k}") for k in ("stride", "padding", "dilation"))
        groups = attrs.get("groups")
        _check(len(stride) == len(padding) == len(dilation) == nsp, "conv stride/padding/dilation per spatial dim")
        _check(isinstance(groups, int) and groups >= 1 and x.shape[1] % groups == 0 and w.shape[0] % groups == 0
               and w.shape[1] * groups == x.shape[1], f"conv channels/groups mismatch: {x}, {w}, groups={groups}")
        out = [x.shape[0], w.shape[0]]
        for i in range(nsp):
            eff = dilation[i] * (w.shape[2 + i] - 1) + 1
            o = (x.shape[2 + i] + 2 * padding[i] - eff) // stride[i] + 1
            _check(o >= 1, f"conv output spatial dim {i} would be {o}")
            out.append(o)
        return TensorType(tuple(out), x.dtype)

    raise IRTypeError(f"unknown op {op!r}")
