"""Capture: nn.Module + example inputs → torch.export → Core ATen → sextant graph IR."""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from sextant.errors import ExportError, UnsupportedOp, UnsupportedOpError
from sextant.frontend.extern_calls import NotExtern, extern_refusal, lower_extern
from sextant.frontend.lowerings import KEPT_WHOLE, LoweringContext, NoNativeForm, Unsupported, lowering_for
from sextant.frontend.source import module_path, short_loc, user_frame
from sextant.frontend.symbols import TorchSymbols, declared_names
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, InputLeaf, Mutation, Node
from sextant.graph.symbolic import SymbolicShapeError
from sextant.graph.verifier import verify


def export(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None,
           dynamic_shapes: Any = None) -> ExportedProgram:
    """torch.export + Core ATen decompositions, with torch's failures explained. ``dynamic_shapes``
    is torch.export's (``{"ids": {1: Dim("seq", min=1, max=512)}}``): those sizes stay symbolic."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sextant.capture expects an nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        args = (args,)
    try:
        ep = torch.export.export(module, args, dict(kwargs or {}), strict=False, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # torch raises many types here; all mean "could not trace"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if first.startswith("Constraints violated"):  # dynamic_shapes: torch's explanation and fix matter
            detail = str(e).strip().split("\n\nThe error above occurred")[0]
            first = "\n".join(detail.splitlines()[:12])
        raise ExportError(
            f"torch.export could not capture {type(module).__name__}: {type(e).__name__}: {first}\n"
            "sextant needs a graph that torch.export can trace (no data-dependent Python control flow, "
            f"tensor or pytree outputs).{_aliasing_hint(module)} The original error is attached as __cause__."
        ) from e
    try:
        with warnings.catch_warnings():  # torch's own deepcopy of its treespecs trips its own deprecation
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
            return ep.run_decompositions(decomposition_table())
    except Exception as e:
        raise ExportError(f"Core ATen decomposition failed: {type(e).__name__}: {e}{_aliasing_hint(module)}") from e


def _aliasing_hint(module: torch.nn.Module) -> str:
    """A likely cause of torch's failure to capture: a buffer sharing storage with a parameter (or
    another buffer), which torch cannot trace when ``forward()`` updates it."""
    seen: dict[int, str] = {}
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            if t is None or t.numel() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen and kind == "buffer":
                return (f"\nThe buffer {name!r} shares its storage with {seen[ptr]}: if forward() updates it, "
                        "give it a tensor of its own (e.g. .clone()).")
            seen.setdefault(ptr, f"{kind} {name!r}")
    return ""


def decomposition_table() -> dict[torch._ops.OperatorBase, Callable[..., Any]]:
    """torch's Core ATen decompositions minus the ops sextant lowers whole (``KEPT_WHOLE``: attention)."""
    table = torch.export.default_decompositions()
    for op in KEPT_WHOLE:
        table.pop(op, None)
    return table


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _unsupported(node: torch.fx.Node, reason: str = "") -> UnsupportedOp:
    frame = user_frame(node)
    source = f"{frame[0]}:{frame[1]}" if frame else "<unknown source>"
    return UnsupportedOp(_op_name(node.target), source, frame[2] if frame else "", module_path(node), reason)


def find_unsupported(ep: ExportedProgram, strict: bool = True) -> list[UnsupportedOp]:
    """Every op occurrence with no lowering (all at once, so the user sees the whole list); unless
    ``strict``, only those that cannot run as extern calls either (with the reason)."""
    items = []
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem and lowering_for(node.target) is None:
            why = None if strict else extern_refusal(node)
            if strict or why is not None:
                items.append(_unsupported(node, why or ""))
    return items


def _check_dtype(node: torch.fx.Node, val: Any) -> list[UnsupportedOp]:
    vals = val if isinstance(val, (tuple, list)) else [val]
    bad = []
    for v in vals:
        if isinstance(v, torch.Tensor):
            try:
                DType.from_torch(v.dtype)
            except TypeError as e:
                bad.append(_unsupported(node, str(e)))
    return bad


def translate(ep: ExportedProgram, name: str = "main", dim_names: Mapping[str, str] | None = None,
              strict: bool = False) -> Graph:
    """Translate an exported (decomposed) program into a verified graph; symbolic sizes become
    ``SymDim``s, named after their declared ``Dim`` where ``dim_names`` (torch's symbol → name) says.
    An op with no lowering becomes an ``extern`` call (``frontend/extern_calls.py``) unless ``strict``."""
    problems = find_unsupported(ep, strict)
    for node in ep.graph.nodes:
        if node.op == "placeholder" or (node.op == "call_function" and lowering_for(node.target) is not None):
            problems += _check_dtype(node, node.meta.get("val"))
    if problems:
        raise UnsupportedOpError(problems)

    b = GraphBuilder(name)
    syms = TorchSymbols(ep, dim_names)
    env: dict[str, Any] = {}
    sig = ep.graph_signature
    tensors = {**ep.state_dict, **ep.constants}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    leaves: list[InputLeaf] = []
    mutated = {spec.target for spec in sig.output_specs if spec.kind in _STATE_MUTATIONS}
    state: list[tuple[str, Any]] = []  # updated buffers and parameters: inputs after the user's, in order
    for spec, ph in zip(sig.input_specs, placeholders):
        if spec.kind == InputKind.USER_INPUT:
            val = ph.meta.get("val")
            if not isinstance(spec.arg, TensorArgument) or not isinstance(val, torch.Tensor):
                value = getattr(spec.arg, "value", val)
                env[ph.name] = value  # a specialised non-tensor input (int, float, bool, None)
                leaves.append(InputLeaf(spec.arg.name, None, value))
                continue
            env[ph.name] = b.input(spec.arg.name, syms.shape(val.shape), DType.from_torch(val.dtype))
            leaves.append(InputLeaf(spec.arg.name, len(b.inputs) - 1))
        elif spec.kind in (InputKind.BUFFER, InputKind.PARAMETER) and spec.target in mutated:
            state.append((spec.target, ph))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            tensor = tensors[spec.target]
            b.loc = None
            env[ph.name] = b.param(spec.target, tensor)
        else:
            raise UnsupportedOpError([UnsupportedOp(f"<{spec.kind.name} input>", "<graph signature>", "", "",
                                                    "only user inputs, parameters, buffers and constants")])
    for target, ph in state:
        tensor = tensors[target]
        _check_state(target, tensor, tensors)
        env[ph.name] = b.input(target, syms.shape(tensor.shape), DType.from_torch(tensor.dtype))

    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
        if node.target is operator.getitem:
            env[node.name] = args[0][args[1]]
            continue
        b.loc = short_loc(node)
        try:
            try:
                lowering = lowering_for(node.target)
                if lowering is None:
                    raise NoNativeForm("no lowering")
                env[node.name] = lowering(LoweringContext(b, node, syms.dim), *args, **kwargs)
            except NoNativeForm:
                if strict:
                    raise
                env[node.name] = lower_extern(LoweringContext(b, node, syms.dim), args, kwargs)
        except (Unsupported, NotExtern) as e:
            raise UnsupportedOpError([_unsupported(node, str(e))]) from None
        except SymbolicShapeError as e:
            raise UnsupportedOpError([_unsupported(node, f"not with symbolic sizes yet: {e}")]) from None
        _check_result(node, env[node.name], syms)

    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    results = out_node.args[0]
    outputs, updates, constants = [], [], []
    for spec, r in zip(sig.output_specs, results):
        value = env[r.name] if isinstance(r, torch.fx.Node) else r
        if spec.kind in (*_STATE_MUTATIONS, OutputKind.USER_INPUT_MUTATION):
            updates.append((spec, value))
            continue
        if spec.kind != OutputKind.USER_OUTPUT:
            raise UnsupportedOpError([UnsupportedOp(f"<{spec.kind.name} output>", "<graph signature>", "", "",
                                                    "only returned tensors and updated buffers, parameters or "
                                                    "inputs")])
        if isinstance(value, (int, float, bool)) or value is None:  # a size torch.export computed: a constant
            constants.append((len(outputs) + len(constants), value))
            continue
        if not isinstance(value, Node):
            raise UnsupportedOpError([UnsupportedOp("<non-tensor output>", "<graph signature>", "", "",
                                                    f"output {value!r} is not a tensor")])
        outputs.append(value)
    mutations = _mutations(updates, b, leaves, len(outputs))
    graph = b.build(outputs + [v for _, v in updates], ep.call_spec.in_spec, ep.call_spec.out_spec, leaves,
                    mutations)
    if constants:
        graph = dataclasses.replace(graph, constant_outputs=tuple(constants))
    verify(graph, where="capture")
    return graph


_STATE_MUTATIONS = (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)


def _check_state(target: str, tensor: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """A buffer updated in ``forward()`` must own its storage: one that shares memory with a parameter
    or another buffer would see the update through both names, which sextant does not model."""
    ptr = tensor.untyped_storage().data_ptr()
    for name, other in tensors.items():
        if name != target and isinstance(other, torch.Tensor) and other.untyped_storage().data_ptr() == ptr \
                and tensor.numel() and other.numel():
            raise UnsupportedOpError([UnsupportedOp("<BUFFER_MUTATION output>", "<graph signature>", "", target,
                                                    f"the updated buffer {target!r} shares its storage with "
                                                    f"{name!r}; give it a tensor of its own")])


def _mutations(updates: list, b: GraphBuilder, leaves: list[InputLeaf], returned: int) -> list[Mutation]:
    """The graph's ``Mutation`` records for torch.export's BUFFER_MUTATION, PARAMETER_MUTATION (an
    optimizer step updating the weights: module state like a buffer, ``kind="buffer"``) and
    USER_INPUT_MUTATION outputs."""
    by_name = {n.attr("name"): n for n in b.inputs}
    leaf_of = {leaf.name: leaf for leaf in leaves}
    out = []
    for k, (spec, value) in enumerate(updates):
        target = spec.target
        if spec.kind in _STATE_MUTATIONS:
            node, kind = by_name[target], "buffer"
        else:
            leaf = leaf_of.get(target)
            if leaf is None or leaf.input_index is None:
                raise UnsupportedOpError([UnsupportedOp("<USER_INPUT_MUTATION output>", "<graph signature>", "",
                                                        target, "the updated argument is not a tensor input")])
            node, kind = b.inputs[leaf.input_index], "input"
        if not isinstance(value, Node) or value.type != node.type:
            raise UnsupportedOpError([UnsupportedOp(f"<{spec.kind.name} output>", "<graph signature>", "", target,
                                                    f"the new value of {target!r} does not match the tensor")])
        out.append(Mutation(returned + k, node.attr("index"), target, kind))
    return out


def _check_result(node: torch.fx.Node, value: Any, syms: TorchSymbols) -> None:
    """A lowering must produce exactly the shapes and dtypes torch recorded (catches lowering bugs early)."""
    val = node.meta.get("val")
    pairs = list(zip(value, val)) if isinstance(value, (tuple, list)) else [(value, val)]
    for got, want in pairs:
        if isinstance(got, Node) and isinstance(want, torch.Tensor):
            exp = (syms.shape(want.shape), DType.from_torch(want.dtype))
            if (got.shape, got.dtype) != exp:
                raise AssertionError(
                    f"lowering of {_op_name(node.target)} produced {got.type}, torch says "
                    f"{exp[1].value}{list(exp[0])} (at {short_loc(node)})"
                )


def capture(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None, *,
            name: str | None = None, dynamic_shapes: Any = None, strict: bool = False) -> Graph:
    """Capture ``module(*args, **kwargs)`` as sextant graph IR (parameters become named constants);
    with ``dynamic_shapes`` (torch.export's), the sizes it names are symbolic in the graph. Ops with no
    lowering become extern calls, or (``strict``) the reason for an :class:`UnsupportedOpError`."""
    ep = export(module, args, kwargs, dynamic_shapes)
    names = declared_names(module, args if isinstance(args, tuple) else (args,), kwargs, dynamic_shapes, ep)
    return translate(ep, name or _graph_name(module), names, strict)


def _graph_name(module: torch.nn.Module) -> str:
    import re

    return re.sub(r"\W", "_", type(module).__name__) or "main"
