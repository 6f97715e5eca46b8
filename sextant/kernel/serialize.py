"""Kernel IR ⇄ JSON: so a compiled program's kernels can be stored and rebuilt exactly.

The kernel IR is a tree of small frozen dataclasses, so one generic encoder covers it: each
node becomes a JSON object tagged with its class name (``"_": "Binary"``) holding its fields.
Decoding is driven by the dataclass fields themselves, which is why no per-class code exists
and a new field or node class needs no change here (only new *kinds* of leaf value would).

Why JSON rather than the printer's text: the printed form is for people and has no parser;
JSON is readable enough to inspect, unambiguous, and needs nothing beyond the standard library.
Values JSON cannot hold exactly are tagged: non-finite floats (``{"float": "inf"}``) — finite
floats are written with ``repr`` precision, so they round-trip bit for bit (``-0.0`` included).
``DType`` fields are written as their names (``"f32"``) and restored from the field's type;
tuples (the IR's only sequence type) are written as lists and read back as tuples.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable
from typing import Any

from sextant.errors import SextantError
from sextant.graph.dtypes import DType
from sextant.kernel import ir

FORMAT = "sextant-kernel-ir"
VERSION = 1

_NODE_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (ir.Const, ir.Var, ir.Special, ir.Unary, ir.Binary, ir.Select, ir.Cast, ir.Load, ir.Assign, ir.Store,
                ir.AtomicAdd, ir.For, ir.If, ir.Barrier, ir.WarpReduce, ir.Mma, ir.LdMatrix, ir.CpAsync,
                ir.CpAsyncCommit, ir.CpAsyncWait, ir.PairDot, ir.TileMatmul, ir.SmemMatrix, ir.RegMatrix, ir.Wgmma,
                ir.WgmmaFence, ir.WgmmaCommit, ir.WgmmaWait, ir.MbarrierInit, ir.MbarrierArrive, ir.MbarrierWait,
                ir.TmaLoad, ir.SetMaxNReg, ir.Buffer, ir.Kernel)
}


class KernelSerializeError(SextantError, ValueError):
    """A kernel (or its JSON form) holds something the kernel IR serializer does not know."""


def _dtype_fields(cls: type) -> frozenset[str]:
    hints = typing.get_type_hints(cls, vars(ir))
    return frozenset(name for name, hint in hints.items() if hint is DType)


_DTYPE_FIELDS = {name: _dtype_fields(cls) for name, cls in _NODE_CLASSES.items()}


# -- encoding -----------------------------------------------------------------------------------
def encode_value(v: Any, where: str = "kernel") -> Any:
    """A JSON-compatible form of a kernel IR node or leaf value (``where`` names it in errors)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, DType):
        return v.value
    if isinstance(v, tuple | list):
        return [encode_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise KernelSerializeError(f"{where}: only string-keyed dicts can be serialized")
        return {"dict": {k: encode_value(x, f"{where}.{k}") for k, x in v.items()}}
    cls = type(v)
    if _NODE_CLASSES.get(cls.__name__) is cls:
        out: dict[str, Any] = {"_": cls.__name__}
        for f in dataclasses.fields(v):
            out[f.name] = encode_value(getattr(v, f.name), f"{where}.{f.name}")
        return out
    raise KernelSerializeError(f"{where}: cannot serialize a {cls.__name__} ({v!r:.80})")


def kernel_to_json(k: ir.Kernel) -> dict[str, Any]:
    return encode_value(k, f"kernel {k.name}")


def kernels_to_json(kernels: Iterable[ir.Kernel]) -> dict[str, Any]:
    """The document ``kernels.json`` holds: a format tag, a version, and the kernels in order."""
    return {"format": FORMAT, "version": VERSION, "kernels": [kernel_to_json(k) for k in kernels]}


# -- decoding -----------------------------------------------------------------------------------
def decode_value(v: Any, where: str = "kernel") -> Any:
    """Inverse of :func:`encode_value` (lists become tuples, tagged objects become IR nodes)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return tuple(decode_value(x, f"{where}[{i}]") for i, x in enumerate(v))
    if not isinstance(v, dict):
        raise KernelSerializeError(f"{where}: unexpected JSON value {v!r:.80}")
    if set(v) == {"float"}:
        try:
            return float(v["float"])
        except (TypeError, ValueError):
            raise KernelSerializeError(f"{where}: bad float {v['float']!r}") from None
    if set(v) == {"dict"} and isinstance(v["dict"], dict):
        return {k: decode_value(x, f"{where}.{k}") for k, x in v["dict"].items()}
    tag = v.get("_")
    cls = _NODE_CLASSES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise KernelSerializeError(f"{where}: unknown kernel IR node {tag!r} (known: {', '.join(_NODE_CLASSES)})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(v) - names - {"_"}
    if unknown:
        raise KernelSerializeError(f"{where}: {tag} has no field(s) {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, raw in v.items():
        if name == "_":
            continue
        sub = f"{where}.{name}"
        if name in _DTYPE_FIELDS[tag]:
            try:
                kwargs[name] = DType(raw)
            except ValueError:
                raise KernelSerializeError(f"{sub}: unknown dtype {raw!r}") from None
        else:
            kwargs[name] = decode_value(raw, sub)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise KernelSerializeError(f"{where}: cannot build {tag}: {e}") from None


def kernel_from_json(data: Any) -> ir.Kernel:
    k = decode_value(data)
    if not isinstance(k, ir.Kernel):
        raise KernelSerializeError(f"expected a Kernel, got {type(k).__name__}")
    return k


def kernels_from_json(doc: Any) -> list[ir.Kernel]:
    """Kernels from a :func:`kernels_to_json` document; rejects other formats and versions."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KernelSerializeError(f"not a kernel IR document (expected format {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise KernelSerializeError(f"kernel IR format version {doc.get('version')!r} is not supported "
                                   f"(this sextant reads version {VERSION})")
    if not isinstance(doc.get("kernels"), list):
        raise KernelSerializeError("kernel IR document has no 'kernels' list")
    return [kernel_from_json(k) for k in doc["kernels"]]
