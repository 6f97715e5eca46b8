"""torch.export's symbolic sizes as graph-IR dimensions.

torch.export names the symbols of a graph exported with ``dynamic_shapes`` by hash (``s27``,
``s77``) and records their ranges in ``range_constraints``. :class:`TorchSymbols` turns each size
torch recorded (an ``int`` or a ``torch.SymInt`` over those symbols) into an ``int`` or a
:class:`~sextant.graph.symbolic.SymDim`, renaming each symbol after the ``Dim`` the user declared
for it where that can be told (``Dim("seq")`` → ``seq``), so the IR reads ``f32[batch,seq,768]``.
A symbol without a finite upper bound gets ``INDEX_MAX``: sizes index with 32-bit integers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import sympy
import torch

from sextant.graph.symbolic import Dim, SymbolicShapeError, make_dim, sympy_symbol

INDEX_MAX = 2**31 - 1


class TorchSymbols:
    def __init__(self, ep: torch.export.ExportedProgram, names: Mapping[str, str] | None = None) -> None:
        names = dict(names or {})
        self.rename: dict[sympy.Symbol, sympy.Symbol] = {}
        self.bounds: dict[str, tuple[str, int, int]] = {}
        taken: set[str] = set()
        for sym, vr in ep.range_constraints.items():
            if not isinstance(sym, sympy.Symbol):
                continue
            name = names.get(sym.name, sym.name)
            if name in taken:
                name = sym.name
            taken.add(name)
            lo, hi = finite_bound(vr.lower, 0), finite_bound(vr.upper, INDEX_MAX)
            self.rename[sym] = sympy_symbol(name)
            self.bounds[sym.name] = (name, lo, min(hi, INDEX_MAX))

    def dim(self, d: Any) -> Dim:
        if isinstance(d, int):
            return d
        if not isinstance(d, torch.SymInt):
            raise TypeError(f"expected a size, got {type(d).__name__}")
        expr = d.node.expr
        if expr.is_Integer:
            return int(expr)
        unknown = [s.name for s in expr.free_symbols if s.name not in self.bounds]
        if unknown:
            raise SymbolicShapeError(f"size {expr} mentions {', '.join(unknown)}, which torch.export gave no range")
        bounds = tuple(sorted(self.bounds[s.name] for s in expr.free_symbols))
        return make_dim(_plain(expr).xreplace({s: self.rename[s] for s in expr.free_symbols}), bounds)

    def shape(self, shape: Any) -> tuple[Dim, ...]:
        return tuple(self.dim(d) for d in shape)


def _plain(expr: Any) -> Any:
    """``expr`` with torch's own integer functions (``FloorDiv``, ``CeilDiv``, ``ModularIndexing``,
    ``PythonMod``) written as plain sympy ``floor``/``ceiling``/``Mod``, so that a size torch computed
    (a convolution's output length, ``(L - 5)//2 + 1``) and the same size the graph IR derives are one
    polynomial form and compare equal."""
    for cls, fn in _torch_functions():
        expr = expr.replace(lambda e, cls=cls: isinstance(e, cls), lambda e, fn=fn: fn(*e.args))
    return expr


@functools.cache
def _torch_functions() -> tuple[tuple[type, Any], ...]:
    """(torch's sympy function class, its plain-sympy form) for those this torch version has."""
    from torch.utils._sympy import functions as tf

    forms = (("FloorDiv", lambda a, b: sympy.floor(a / b)), ("CeilDiv", lambda a, b: sympy.ceiling(a / b)),
             ("PythonMod", sympy.Mod), ("ModularIndexing", lambda x, d, m: sympy.Mod(sympy.floor(x / d), m)))
    return tuple((getattr(tf, name), fn) for name, fn in forms if hasattr(tf, name))


def finite_bound(v: Any, default: int) -> int:
    """A range end as an int; ``default`` for torch's infinities (``int_oo``, which ``int()`` fails on)."""
    if isinstance(v, int) or getattr(v, "is_Integer", False):
        return int(v)
    return default


def declared_names(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None,
                   dynamic_shapes: Any, ep: torch.export.ExportedProgram) -> dict[str, str]:
    """torch's symbol name → the name of the ``Dim`` declared for it (``seq``; for ``Dim.DYNAMIC`` or
    ``Dim.AUTO``, the argument and axis: ``x_dim1``), for tensor arguments given directly (not
    nested in lists or dicts); anything else keeps torch's name."""
    if dynamic_shapes is None:
        return {}
    try:
        sig = inspect.signature(module.forward)
        bound = sig.bind(*args, **dict(kwargs or {}))
    except (TypeError, ValueError):
        return {}
    pairs: list[tuple[str, Any, Any]] = []  # (argument's name, value, its spec), as torch.export pairs them
    for i, (name, value) in enumerate(bound.arguments.items()):
        if isinstance(dynamic_shapes, Mapping):
            spec = dynamic_shapes.get(name)
        else:
            spec = dynamic_shapes[i] if isinstance(dynamic_shapes, (tuple, list)) and i < len(dynamic_shapes) else None
        if sig.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL and isinstance(spec, (tuple, list)):
            pairs += [(f"{name}{j}", v, sp) for j, (v, sp) in enumerate(zip(value, spec))]
        else:
            pairs.append((name, value, spec))
    if not all(isinstance(value, torch.Tensor) for _, value, _ in pairs):
        return {}  # nested arguments: where each tensor lands among the flat inputs is not tracked here
    vals = [n.meta.get("val") for n, s in zip(ep.graph.nodes, ep.graph_signature.input_specs)
            if n.op == "placeholder" and s.kind.name == "USER_INPUT"]
    out: dict[str, str] = {}
    for (label, _, spec), val in zip(pairs, (v for v in vals if isinstance(v, torch.Tensor))):
        items = (spec.items() if isinstance(spec, Mapping)
                 else enumerate(spec) if isinstance(spec, (tuple, list)) else ())
        for axis, dim in items:
            if dim is None:
                continue
            # a Dim is named by its user; a hint (Dim.DYNAMIC, Dim.AUTO) after its argument and axis
            name = getattr(dim, "__name__", None) or f"{label}_dim{axis}"
            size = val.shape[axis] if axis < val.dim() else None
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and name.isidentifier():
                out.setdefault(size.node.expr.name, name)
    return out
