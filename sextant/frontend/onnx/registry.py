"""The table from ONNX op types to translation functions, and the context a translation sees.

A translation receives an :class:`OnnxContext` and the node's inputs as graph-IR nodes (``None``
for an omitted optional input); it returns a node or a list of nodes (one per ONNX output).
Attributes are read through ``ctx.attr``; inputs that ONNX passes as tensors but that must be
known at compile time (a Reshape's shape, a Slice's starts) through ``ctx.ints``/``ctx.const``,
which evaluate constant subgraphs (Shape → Gather → Concat chains) with the reference executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from sextant.frontend.lowerings import LOWERINGS, LoweringContext, Unsupported
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node, topo_sort
from sextant.graph.reference import constant_value

Translation = Callable[..., Any]


class NeedsValue(Unsupported):
    """A shape-determining value depends on graph inputs: the model compiles once they are specialised."""

    def __init__(self, message: str, inputs: tuple[str, ...]) -> None:
        super().__init__(message)
        self.inputs = inputs

ONNX_OPS: dict[str, Translation] = {}


def onnx_op(*op_types: str) -> Callable[[Translation], Translation]:
    """Register ``fn`` as the translation of each ONNX op type (domain ai.onnx)."""

    def deco(fn: Translation) -> Translation:
        for t in op_types:
            ONNX_OPS[t] = fn
        return fn

    return deco


@dataclass
class OnnxContext:
    """What a translation may look at besides its inputs: the builder, the node, the opset."""

    b: GraphBuilder
    node: Any  # onnx.NodeProto
    opset: int  # the model's ai.onnx opset version
    attrs: dict[str, Any] = field(default_factory=dict)
    _consts: dict[int, torch.Tensor] = field(default_factory=dict)  # shared memo: node id → value
    _subgraph: Callable[[Any, Sequence[Node | None]], list[Node]] | None = None  # set by the importer

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def num_outputs(self) -> int:
        return len(self.node.output)

    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute's value (STRING attributes already decoded to str), or ``default``."""
        return self.attrs.get(name, default)

    def subgraph(self, graph: Any, inputs: Sequence[Node | None]) -> list[Node]:
        """Inline a GRAPH attribute (a branch, a loop body) with its formal inputs bound to ``inputs``
        and the enclosing scope visible; its output nodes. Each call emits a fresh copy (unrolling)."""
        if self._subgraph is None:
            raise Unsupported(f"{self.op_type}: subgraphs need the ONNX importer")
        return self._subgraph(graph, inputs)

    # -- compile-time values ----------------------------------------------------------------
    def const(self, x: Node | None, what: str = "input", why: str = "sextant compiles static shapes") -> torch.Tensor:
        """The value of ``x`` when it does not depend on a graph input, else :class:`Unsupported`."""
        if x is None:
            raise Unsupported(f"{self.op_type}: {what} is missing")
        value = constant_value(x, self.b.params, self._consts)
        if value is None:
            names = tuple(sorted(n.attr("name") for n in topo_sort([x]) if n.op == "input"))
            raise NeedsValue(f"{self.op_type}: {what} must be known at compile time ({why}), but it depends on "
                             f"graph input(s) {', '.join(map(repr, names))}: pass "
                             "constant_inputs={name: value} to specialise the model on their values", names)
        return value

    def ints(self, x: Node | None, what: str = "input") -> list[int]:
        return [int(v) for v in self.const(x, what).reshape(-1).tolist()]

    def is_const(self, x: Node | None) -> bool:
        return x is not None and constant_value(x, self.b.params, self._consts) is not None

    def tensor(self, value: torch.Tensor | np.ndarray, name: str = "const") -> Node:
        """A constant tensor as a graph node (a ``full`` when all elements are equal, else a ``param``)."""
        t = torch.as_tensor(value)
        dtype = DType.from_torch(t.dtype)
        flat = t.reshape(-1)
        if t.numel() == 0:
            return self.b.full(0, tuple(t.shape), dtype)
        if t.numel() == 1 or bool((flat == flat[0]).all()):
            return self.b.full(flat[0].item(), tuple(t.shape), dtype)
        return self.b.param(f"onnx.{self.node.name or self.op_type}.{name}", t)

    # -- reuse of the ATen lowerings -----------------------------------------------------------
    def aten(self, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
        """Lower ``op(*args, **kwargs)`` with sextant's ATen lowering (one table for both frontends):
        torch's meta kernel supplies the result's shape and dtype the lowering may ask for."""
        def meta(v: Any) -> Any:
            if isinstance(v, Node):
                return torch.empty(v.shape, dtype=v.dtype.torch, device="meta")
            if isinstance(v, (list, tuple)):
                return type(v)(meta(i) for i in v)
            return v

        def result() -> Any:
            try:
                return op(*meta(args), **{k: meta(v) for k, v in kwargs.items()})
            except Exception as e:
                raise Unsupported(f"{self.op_type}: {op} rejects these arguments: {e}") from None

        fake = SimpleNamespace(target=op, meta=_LazyMeta(result),
                               args=[SimpleNamespace(meta={"val": meta(a)}) for a in args])
        return LOWERINGS[op](LoweringContext(self.b, fake), *args, **kwargs)  # type: ignore[arg-type]


class _LazyMeta:
    """An FX node's ``meta`` whose ``"val"`` is computed on first use: most lowerings never ask, and
    the meta kernels of ops written as Python references import torch._dynamo (seconds) on first call."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute = compute
        self._val: Any = None
        self._done = False

    def get(self, key: str, default: Any = None) -> Any:
        if key != "val":
            return default
        if not self._done:
            self._val, self._done = self._compute(), True
        return self._val


def axis(ctx: OnnxContext, x: Node, name: str = "axis", default: int = 0) -> int:
    """An attribute naming an axis of ``x``, normalised to be non-negative and checked."""
    a = int(ctx.attr(name, default))
    rank = max(x.type.rank, 1)
    if not -rank <= a < rank:
        raise Unsupported(f"{ctx.op_type}: {name}={a} out of range for rank {x.type.rank}")
    return a % rank


def norm_axes(axes: Sequence[int], rank: int, what: str = "axes") -> list[int]:
    out = []
    for a in axes:
        if not -rank <= a < max(rank, 1):
            raise Unsupported(f"{what} {list(axes)} out of range for rank {rank}")
        out.append(a % max(rank, 1))
    return out
