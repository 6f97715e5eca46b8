"""CompiledModule: the callable that ``sextant.compile`` returns, the same for every target.

It owns the graph and its executor, checks each call against the example inputs the model
was compiled for, and rebuilds the module's output structure (tuples, dicts, ModelOutputs).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from sextant.errors import InputError
from sextant.graph.bind import is_symbolic_graph
from sextant.graph.ir import Graph
from sextant.graph.philox import draw_seed
from sextant.graph.position_checks import position_checks

Executor = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


class CompiledModule:
    """Behaves like the compiled ``nn.Module`` for inputs of the example shapes and dtypes."""

    def __init__(self, graph: Graph, target: str, executor: Executor, *, stages: dict[str, Any] | None = None,
                 device: str = "cpu"):
        self.graph = graph
        self.target = target
        self.device = device  # torch device type the inputs must be on (and the outputs are returned on)
        self._executor = executor
        self.stages = stages or {}  # per-stage artifacts (e.g. the graph after each pass), for inspection
        # the common call — positional tensors only — is checked without flattening a pytree
        g = graph
        # mutated buffers are inputs after the user's: the module's live tensors (bind_state); then
        # the seed of the graph's random ops, drawn from torch's generator at each call
        self._seeded = g.seed is not None
        self._n_state = sum(m.kind == "buffer" for m in g.mutations)
        self._user_inputs = len(g.inputs) - self._n_state - self._seeded
        self._state: list[torch.Tensor] = []
        self.full_write_backs = 0  # updates stored back by a copy, not written in place by the program
        # one check per argument and bound (a decoder's every layer writes its caches at the same positions)
        self._position_checks = list({(c.input, c.size, c.negative): c for c in reversed(position_checks(g))}
                                     .values())[::-1]
        self._positional = g.in_spec is not None and len(g.leaves) == self._user_inputs and all(
            leaf.input_index == i for i, leaf in enumerate(g.leaves)) and g.in_spec == pytree.tree_structure(
            (tuple(range(len(g.leaves))), {}))
        self._expected = [(tuple(n.shape), n.dtype.torch) for n in g.inputs[:self._user_inputs]]
        # symbolic sizes: the shapes are checked when the executor solves the symbols (graph/bind.py)
        self._symbolic = is_symbolic_graph(g)
        if any(n.op == "collective" for n in g.nodes):  # before any rank issues one: all compiled the same
            from sextant.runtime.collectives import check_ranks_agree

            check_ranks_agree(self.stages.get("program"), g)

    def __repr__(self) -> str:
        program = self.stages.get("program")
        kernels = f", {len(program.launches)} kernels" if program is not None else ""
        return (f"CompiledModule(@{self.graph.name}, target={self.target!r}, "
                f"{len(self.graph.inputs)} inputs, {len(self.graph.nodes)} graph nodes{kernels})")

    @property
    def planned_peak_bytes(self) -> int | None:
        """Memory the compiled module plans for one call: intermediates (one arena, reused by
        liveness) plus outputs; inputs and weights excluded. None for the reference target."""
        program = self.stages.get("program")
        return None if program is None else program.peak_bytes

    def save(self, path: str | os.PathLike) -> Path:
        """Write this module to the directory ``path`` (kernels, PTX/cubin, manifest, safetensors weights;
        no pickle) for :func:`sextant.load`; see :mod:`sextant.runtime.artifact`."""
        from sextant.errors import ArtifactError
        from sextant.runtime.artifact import save

        if self.graph.mutations:
            raise ArtifactError("a module that updates buffers or arguments in forward() cannot be saved yet "
                                "(an artifact holds weights, not live state)")
        if self._symbolic:
            raise ArtifactError("a module with symbolic sizes cannot be saved yet (an artifact holds one "
                                "static program); compile it without dynamic_shapes to save it")
        return save(self, path)

    def flat_inputs(self, args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Validate a call and return the tensors for the graph inputs, in order."""
        expected = self._expected
        if self._positional and not kwargs and len(args) == len(expected):
            # a loop, and is_cpu rather than device.type (which builds a device object): ~0.7 µs a call, not 1.4
            cpu = self.device == "cpu"
            for a, (s, d) in zip(args, expected):
                if type(a) is not torch.Tensor or a.shape != s or a.dtype != d or not (
                        a.is_cpu if cpu else a.device.type == self.device):
                    break
            else:
                return list(args)
        g = self.graph
        if g.in_spec is None:
            leaves, spec = list(args) + list(kwargs.values()), None
        else:
            keys = _dict_keys(g.in_spec)
            unknown = set(kwargs) - set(keys)
            if unknown:
                raise InputError(f"unexpected keyword argument(s) {sorted(unknown)}; the model was compiled "
                                 f"with keyword arguments {keys}")
            missing = [k for k in keys if k not in kwargs]
            if missing:
                raise InputError(f"missing keyword argument(s) {missing} (the model was compiled with them)")
            leaves, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in keys}))
            if spec != g.in_spec:
                raise InputError(self._structure_mismatch(args, kwargs))
        if len(leaves) != len(g.leaves):
            raise InputError(f"expected {len(g.leaves)} argument value(s), got {len(leaves)}")
        tensors: list[torch.Tensor] = [None] * len(g.inputs)  # type: ignore[list-item]
        for leaf, value in zip(g.leaves, leaves):
            if leaf.input_index is None:
                if not _same_const(value, leaf.value):
                    raise InputError(f"argument {leaf.name!r} was {leaf.value!r} when the model was compiled, "
                                     f"got {value!r}; non-tensor arguments are baked into the compiled graph")
                continue
            node = g.inputs[leaf.input_index]
            if not isinstance(value, torch.Tensor):
                raise InputError(f"argument {leaf.name!r}: expected a tensor {node.type}, got {type(value).__name__}")
            if not self._symbolic and tuple(value.shape) != node.shape:
                raise InputError(f"argument {leaf.name!r}: expected shape {list(node.shape)}, got {list(value.shape)}")
            if value.dtype != node.dtype.torch:
                raise InputError(f"argument {leaf.name!r}: expected dtype {node.dtype.torch}, got {value.dtype}")
            if value.device.type != self.device:
                raise InputError(f"argument {leaf.name!r}: target {self.target!r} takes {self.device.upper()} "
                                 f"tensors, got a tensor on {value.device}")
            tensors[leaf.input_index] = value
        return tensors

    def _structure_mismatch(self, args: tuple, kwargs: dict[str, Any]) -> str:
        """Name the first argument whose nesting differs from the example inputs."""
        expected_pos = _children(_children(self.graph.in_spec)[0])
        if len(args) != len(expected_pos):
            return f"expected {len(expected_pos)} positional argument(s), got {len(args)}"
        names = iter(leaf.name for leaf in self.graph.leaves)
        given = list(args) + [kwargs[k] for k in _dict_keys(self.graph.in_spec)]
        expected = list(expected_pos) + _children(_children(self.graph.in_spec)[1])
        for value, want in zip(given, expected):
            got = pytree.tree_structure(value)
            label = next(names) if want.is_leaf() else "an argument"
            for _ in range(max(want.num_leaves - 1, 0)):
                next(names, None)
            if got != want:
                if want.is_leaf():
                    return f"argument {label!r}: expected a tensor, got {type(value).__name__}"
                return f"{label}: expected structure {want}, got {got}"
        return "the arguments' structure differs from the example inputs"

    def bind_state(self, tensors: Sequence[torch.Tensor]) -> None:
        """The tensors behind the graph's updated buffers (``Mutation.kind == "buffer"``), in input
        order: the module's own buffers, read and updated by every call as eager ``forward()`` does."""
        g = self.graph
        nodes = g.inputs[self._user_inputs:self._user_inputs + self._n_state]
        if len(tensors) != len(nodes):
            raise InputError(f"expected {len(nodes)} state tensor(s), got {len(tensors)}")
        for t, node in zip(tensors, nodes):
            if tuple(t.shape) != node.shape or t.dtype != node.dtype.torch or t.device.type != self.device:
                raise InputError(f"buffer {node.attr('name')!r}: expected a {self.device} tensor {node.type}, got "
                                 f"{t.dtype} {list(t.shape)} on {t.device}")
        self._state = list(tensors)

    def check_positions(self, inputs: Sequence[torch.Tensor]) -> None:
        """Refuse positions outside the tensor a scatter updates (``graph/position_checks.py``);
        positions on a GPU are not read back (a sync per call): their kernels drop such writes."""
        for chk in self._position_checks:
            pos = inputs[chk.input]
            if pos.numel() == 0 or pos.device.type != "cpu":
                continue
            if pos.numel() <= 64:  # a decode step's one position: a list is ~1 µs, min() and max() ~8
                flat = pos.view(-1).tolist() if pos.is_contiguous() else pos.reshape(-1).tolist()
                lo, hi = min(flat), max(flat)
            else:
                lo, hi = int(pos.min()), int(pos.max())
            low = -chk.size if chk.negative else 0
            if lo < low or hi >= chk.size:
                bad = lo if lo < low else hi
                raise InputError(f"argument {chk.name!r}: position {bad} is outside {chk.what}, which has "
                                 f"{chk.size} positions along the updated dim (allowed: {low}..{chk.size - 1})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        g = self.graph
        if not g.mutations and not self._position_checks and not self._seeded:
            return self._unflatten(self._executor(self.flat_inputs(args, kwargs)))
        if len(self._state) != self._n_state:
            raise InputError("this module updates buffers in forward(), and has none bound (bind_state)")
        inputs = self.flat_inputs(args, kwargs)[:self._user_inputs] + self._state
        if self._seeded:
            inputs.append(draw_seed(self.device))
        self.check_positions(inputs)
        outs = self._executor(inputs)
        for m in g.mutations:  # a value the program wrote into the tensor's own storage needs no copy
            new, dst = outs[m.output], inputs[m.input]
            if new is not dst and (new.data_ptr() != dst.data_ptr() or new.stride() != dst.stride()):
                with torch.no_grad():
                    dst.copy_(new)
                self.full_write_backs += 1
        return self._unflatten(outs[:len(outs) - len(g.mutations)])

    def _unflatten(self, outs: list[torch.Tensor]) -> Any:
        if self.graph.constant_outputs:  # values torch.export computed from the static sizes
            outs = list(outs)
            for pos, value in self.graph.constant_outputs:
                outs.insert(pos, value)
        if self.graph.out_spec is None:
            return outs[0] if len(outs) == 1 else tuple(outs)
        return pytree.tree_unflatten(outs, self.graph.out_spec)


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """Child specs (``children()`` in newer torch, ``children_specs`` before)."""
    return list(spec.children()) if hasattr(spec, "child") else list(spec.children_specs)


def _dict_keys(in_spec: pytree.TreeSpec) -> list[str]:
    kw = _children(in_spec)[1]
    return list(kw.context) if kw.context else []


def _same_const(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return a is b
