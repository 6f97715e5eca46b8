"""ONNX ModelProto → sextant graph IR.

The second frontend: an ONNX model (a file, bytes, or a loaded ``ModelProto``) becomes the same
graph IR that ``sextant.capture`` produces from PyTorch, so every later stage serves both.
Initializers become ``param`` nodes, graph inputs ``input`` nodes (with static shapes: symbolic
dimensions must be given in ``input_shapes``), and each node is handed to its translation in
``ONNX_OPS``. Unsupported ops, attributes and element types are collected over the whole model
and raised together as one :class:`~sextant.errors.UnsupportedOpError`.
"""

from __future__ import annotations

import os
import re
from collections import ChainMap
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from sextant.errors import SextantError, UnsupportedOp, UnsupportedOpError
from sextant.frontend.lowerings import Unsupported
from sextant.frontend.onnx.dtypes import from_numpy, from_onnx, onnx_type_name, tensor_from_proto, unsupported_dtype
from sextant.frontend.onnx.registry import ONNX_OPS, NeedsValue, OnnxContext
from sextant.graph.builder import GraphBuilder
from sextant.graph.ir import Graph, InputLeaf, Node
from sextant.graph.ops import IRTypeError
from sextant.graph.verifier import verify

OnnxModel = Any  # onnx.ModelProto | str | os.PathLike | bytes
MIN_OPSET = 7  # older models predate the ops' current semantics; 13–23 is the range the issue asks for
HINT = "Support for an ONNX op is added as a translation in sextant/frontend/onnx/ (see docs/onnx.md)."


class OnnxImportError(SextantError, ValueError):
    """The ONNX model is malformed, or its inputs' shapes are not static and were not given."""


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - the dev extra installs it
        raise OnnxImportError("sextant's ONNX frontend needs the onnx package: pip install onnx") from e
    return onnx


def load(model: OnnxModel) -> Any:
    """A ModelProto from a path, bytes or a ModelProto, with model-local functions inlined."""
    onnx = _onnx()
    if isinstance(model, (str, os.PathLike)):
        try:
            model = onnx.load(os.fspath(model))
        except FileNotFoundError:
            raise OnnxImportError(f"ONNX file {os.fspath(model)!r} does not exist") from None
        except Exception as e:
            raise OnnxImportError(f"cannot read ONNX file {os.fspath(model)!r}: {type(e).__name__}: {e}") from e
    elif isinstance(model, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(model))
    elif not isinstance(model, onnx.ModelProto):
        raise TypeError(f"expected an ONNX ModelProto, a path or bytes, got {type(model).__name__}")
    if len(model.functions):
        from onnx import inliner

        model = inliner.inline_local_functions(model)
    return model


def opset_version(model: Any) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return int(_onnx().defs.onnx_opset_version())  # only other domains (ai.onnx.ml): their ops are reported


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    out = {}
    for a in node.attribute:
        if a.ref_attr_name:
            raise Unsupported(f"attribute {a.name!r} refers to a function attribute")
        v = a.t if a.type == a.TENSOR else helper.get_attribute_value(a)
        if isinstance(v, bytes):  # STRING attributes: translations see str
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [s.decode() for s in v]
        out[a.name] = v
    return out


def _input_shape(vi: Any, given: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
    if vi.name in given:
        return tuple(int(d) for d in given[vi.name])
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        raise OnnxImportError(f"input {vi.name!r} has no shape; pass input_shapes={{{vi.name!r}: [...]}}")
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:
            dims.append(int(d.dim_value))
        else:
            sym = d.dim_param or "?"
            raise OnnxImportError(
                f"input {vi.name!r} has a symbolic dimension {sym!r} (shape "
                f"[{', '.join(x.dim_param or str(x.dim_value) for x in tt.shape.dim)}]); sextant compiles static "
                f"shapes: pass input_shapes={{{vi.name!r}: [...]}}")
    return tuple(dims)


def graph_inputs(model: Any) -> list[Any]:
    """The model's real inputs (ValueInfoProtos, in order): ``graph.input`` minus the initializers
    older exporters list there too."""
    init = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in init]


def _graph_name(model: Any, name: str | None) -> str:
    return re.sub(r"\W", "_", name or model.graph.name or "onnx") or "onnx"


def import_onnx(model: OnnxModel, input_shapes: Mapping[str, Sequence[int]] | None = None, *,
                constant_inputs: Mapping[str, Any] | None = None, name: str | None = None) -> Graph:
    """Translate an ONNX model into a verified sextant graph (inputs in the model's input order).

    ``constant_inputs`` specialises the model on the values of some inputs (an ``axes``, a
    Resize's ``scales``: values that decide shapes, which a static-shape compiler must know): they
    become constants, recorded in ``graph.leaves`` so that calls must pass the same values.
    When such a value is needed but not given, the error's ``needs_values`` names the inputs."""
    model = load(model)
    opset = opset_version(model)
    g = model.graph
    given = dict(input_shapes or {})
    inputs = graph_inputs(model)
    fixed = {k: v.cpu() if isinstance(v, torch.Tensor) else from_numpy(v) for k, v in (constant_inputs or {}).items()}
    unknown = (set(given) | set(fixed)) - {vi.name for vi in inputs}
    if unknown:
        raise OnnxImportError(f"input_shapes/constant_inputs name {sorted(unknown)}, which are not inputs of the model "
                              f"(inputs: {[vi.name for vi in inputs]})")
    b = GraphBuilder(_graph_name(model, name))
    problems: list[UnsupportedOp] = []
    env: dict[str, Node | None] = {"": None}

    def problem(op: str, where: str, reason: str) -> None:
        _report(problems, opset, op, where, reason)

    for t in g.initializer:
        dtype = from_onnx(t.data_type)
        if dtype is None:
            problem("<initializer>", f"initializer {t.name!r}", unsupported_dtype(t.data_type))
            continue
        env[t.name] = b.param(t.name, tensor_from_proto(t))
    leaves = []
    for vi in inputs:
        if vi.type.WhichOneof("value") != "tensor_type":
            problem("<input>", f"input {vi.name!r}", f"a {vi.type.WhichOneof('value')} input (only tensors)")
            continue
        dtype = from_onnx(vi.type.tensor_type.elem_type)
        if dtype is None:
            problem("<input>", f"input {vi.name!r}", unsupported_dtype(vi.type.tensor_type.elem_type))
            continue
        if vi.name in fixed:
            value = fixed[vi.name].to(dtype.torch)
            env[vi.name] = b.param(vi.name, value)
            leaves.append(InputLeaf(vi.name, None, value))
            continue
        env[vi.name] = b.input(vi.name, _input_shape(vi, given), dtype)
        leaves.append(InputLeaf(vi.name, len(b.inputs) - 1))

    consts: dict[int, torch.Tensor] = {}
    needs: set[str] = set()
    translate_nodes(b, g.node, env, opset, consts, problems, needs)
    b.loc = None
    outputs = []
    for vi in g.output:
        if vi.name not in env or env[vi.name] is None:
            if not problems:
                raise OnnxImportError(f"graph output {vi.name!r} is produced by no node")
            continue
        node = env[vi.name]
        _check_output(vi, node, problem)
        outputs.append(node)
    if problems:
        err = UnsupportedOpError(problems, frontend="ONNX", hint=HINT)
        err.needs_values = sorted(needs)
        raise err
    graph = b.build(outputs, None, None, leaves)
    verify(graph, where="onnx import")
    return graph


def _check_output(vi: Any, node: Node, problem: Any) -> None:
    """A translation must produce the element type (and static shape) the model declares."""
    tt = vi.type.tensor_type
    if vi.type.WhichOneof("value") != "tensor_type":
        problem("<output>", f"output {vi.name!r}", "only tensor outputs are supported")
        return
    want = from_onnx(tt.elem_type) if tt.elem_type else node.dtype
    if want is None:
        problem("<output>", f"output {vi.name!r}", unsupported_dtype(tt.elem_type))
        return
    if want != node.dtype:
        raise OnnxImportError(f"output {vi.name!r}: the model declares {onnx_type_name(tt.elem_type)}, sextant's "
                              f"translation produced {node.dtype.value} (a translation bug)")
    if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
        shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        if shape != node.shape:
            raise OnnxImportError(f"output {vi.name!r}: the model declares shape {list(shape)}, sextant's "
                                  f"translation produced {list(node.shape)} (a translation bug)")


def _report(problems: list[UnsupportedOp], opset: int, op: str, where: str, reason: str) -> None:
    problems.append(UnsupportedOp(f"{op} (opset {opset})" if "::" in op else op, where, "", "", reason))


def translate_nodes(b: GraphBuilder, nodes: Sequence[Any], env: MutableMapping[str, Node | None], opset: int,
                    consts: dict[int, torch.Tensor], problems: list[UnsupportedOp], needs: set[str],
                    prefix: str = "") -> None:
    """Translate ``nodes`` in order, binding their outputs in ``env``; failures go to ``problems``
    (and the inputs whose values would help to ``needs``) so that one import reports them all."""
    for i, node in enumerate(nodes):
        label = f"node {node.name!r}" if node.name else f"node #{i} (unnamed)"
        op_name = f"{node.domain or 'ai.onnx'}::{node.op_type}"
        missing = [x for x in node.input if x not in env]
        if missing:  # an input failed earlier (already reported) or is produced nowhere
            if not problems:
                raise OnnxImportError(f"{node.op_type} {label} reads {missing[0]!r}, which no earlier node, input or "
                                      "initializer defines (is the graph topologically sorted?)")
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in ONNX_OPS:
            reason = f"custom domain {node.domain!r}" if node.domain not in ("", "ai.onnx") else \
                "no translation for this op"
            _report(problems, opset, op_name, label, reason)
            continue
        b.loc = prefix + (node.name or f"{node.op_type}#{i}")

        def subgraph(graph: Any, inputs: Sequence[Node | None], scope: Mapping[str, Node | None] = env,
                     loc: str = b.loc) -> list[Node]:
            return translate_subgraph(b, graph, inputs, scope, opset, consts, loc + "/")

        try:
            ctx = OnnxContext(b, node, opset, _attrs(node), consts, subgraph)
            result = ONNX_OPS[node.op_type](ctx, *(env[x] for x in node.input))
        except Unsupported as e:
            _report(problems, opset, op_name, label, str(e))
            needs.update(getattr(e, "inputs", ()))
            continue
        except (IRTypeError, ValueError) as e:
            _report(problems, opset, op_name, label, f"{type(e).__name__}: {e}")
            continue
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        for k, out in enumerate(node.output):
            if not out:
                continue
            if k >= len(results) or results[k] is None:
                _report(problems, opset, op_name, label,
                        f"output {k} ({out!r}) is not produced by sextant's translation")
                break
            env[out] = results[k]
    b.loc = None


def translate_subgraph(b: GraphBuilder, graph: Any, inputs: Sequence[Node | None], outer: Mapping[str, Node | None],
                       opset: int, consts: dict[int, torch.Tensor], prefix: str = "") -> list[Node]:
    """Inline a GRAPH attribute (If branch, Loop/Scan body) into ``b``: its formal inputs bound to
    ``inputs``, names of the enclosing scope visible (ONNX lets bodies capture them); its outputs.
    Failures inside become one :class:`Unsupported` of the enclosing node (a NeedsValue when
    specialising graph inputs would help), since the graph IR cannot keep the body as a region."""
    if len(inputs) != len(graph.input):
        raise Unsupported(f"body {graph.name!r} takes {len(graph.input)} inputs, got {len(inputs)}")
    local: dict[str, Node | None] = dict(zip((vi.name for vi in graph.input), inputs))
    for t in graph.initializer:
        if from_onnx(t.data_type) is None:
            raise Unsupported(f"body {graph.name!r}: initializer {t.name!r}: {unsupported_dtype(t.data_type)}")
        local[t.name] = b.param(f"{prefix}{t.name}", tensor_from_proto(t))  # unrolled copies get .1, .2, ...
    env: ChainMap[str, Node | None] = ChainMap(local, outer)  # type: ignore[arg-type]
    problems: list[UnsupportedOp] = []
    needs: set[str] = set()
    loc = b.loc
    try:
        translate_nodes(b, graph.node, env, opset, consts, problems, needs, prefix)
    finally:
        b.loc = loc
    missing = [vi.name for vi in graph.output if env.get(vi.name) is None]
    if problems or missing:
        why = "; ".join(f"{p.source} ({p.op.split(' (')[0]}): {p.reason}" for p in problems) or \
            f"outputs {missing} are produced by no node"
        message = f"in body {graph.name!r}: {why}"
        raise NeedsValue(message, tuple(sorted(needs))) if needs else Unsupported(message)
    return [env[vi.name] for vi in graph.output]  # type: ignore[misc]
