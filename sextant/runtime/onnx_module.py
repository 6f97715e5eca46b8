"""OnnxCompiledModule: what ``sextant.compile_onnx`` returns — an ONNX model's calling convention
(named inputs, numpy arrays, a list of outputs) over the same :class:`CompiledModule`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sextant.errors import InputError
from sextant.graph.ir import Graph
from sextant.runtime.compiled import CompiledModule


class OnnxCompiledModule:
    """Call with arrays positionally (the model's input order), by input name, or with one feed dict.

    Returns numpy arrays when given numpy arrays, torch tensors when given tensors; one output
    comes back bare, several as a tuple. ``run(feed)`` always returns a list, as onnxruntime does.
    """

    def __init__(self, compiled: CompiledModule) -> None:
        self.compiled = compiled
        self.leaves = compiled.graph.leaves  # every ONNX input, in order; specialised ones carry their value
        self.input_names = [leaf.name for leaf in self.leaves]

    # the CompiledModule's inspection surface, unchanged
    @property
    def graph(self) -> Graph:
        return self.compiled.graph

    @property
    def stages(self) -> dict[str, Any]:
        return self.compiled.stages

    @property
    def target(self) -> str:
        return self.compiled.target

    @property
    def device(self) -> str:
        return self.compiled.device

    @property
    def planned_peak_bytes(self) -> int | None:
        return self.compiled.planned_peak_bytes

    def __repr__(self) -> str:
        return f"Onnx{self.compiled!r}"

    def _tensors(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[torch.Tensor], bool]:
        from sextant.frontend.onnx.dtypes import from_numpy  # (imported here: `import sextant` stays light)

        if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
            kwargs, args = args[0], ()
        if args and kwargs:
            raise InputError("pass the inputs either positionally or by name, not both")
        if kwargs:
            unknown = sorted(set(kwargs) - set(self.input_names))
            missing = [n for n in self.input_names if n not in kwargs]
            if unknown or missing:
                raise InputError(f"the model's inputs are {self.input_names}"
                                 + (f"; unknown: {unknown}" if unknown else "")
                                 + (f"; missing: {missing}" if missing else ""))
            args = [kwargs[n] for n in self.input_names]
        if len(args) != len(self.input_names):
            raise InputError(f"the model takes {len(self.input_names)} input(s) {self.input_names}, got {len(args)}")
        as_numpy = any(isinstance(a, np.ndarray) for a in args)
        tensors = []
        for leaf, a in zip(self.leaves, args):
            name = leaf.name
            if leaf.input_index is None:  # compiled for this value (constant_inputs): it must be repeated
                given = a.cpu() if isinstance(a, torch.Tensor) else from_numpy(a)
                if given.shape != leaf.value.shape or not bool((given.to(leaf.value.dtype) == leaf.value).all()):
                    raise InputError(f"input {name!r} was specialised to {leaf.value.tolist()} when the model was "
                                     f"compiled (constant_inputs), got {given.tolist()}")
                continue
            node = self.compiled.graph.inputs[leaf.input_index]
            if isinstance(a, (np.ndarray, np.generic)):
                t = from_numpy(a)
                if node.dtype.torch == torch.bfloat16 and t.dtype == torch.float32:
                    t = t.to(torch.bfloat16)  # numpy has no bfloat16: bf16 inputs are given as float32
                if self.device != "cpu":
                    t = t.to(self.device)
            elif isinstance(a, torch.Tensor):
                t = a
            else:
                raise InputError(f"input {name!r}: expected a numpy array or torch tensor, got {type(a).__name__}")
            if tuple(t.shape) != node.shape:
                raise InputError(f"input {name!r}: expected shape {list(node.shape)}, got {list(t.shape)}")
            if t.dtype != node.dtype.torch:
                raise InputError(f"input {name!r}: expected dtype {node.dtype.value}, got {t.dtype}")
            tensors.append(t)
        return tensors, as_numpy

    def flat_inputs(self, args: tuple, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """The graph's input tensors for a call (as :meth:`CompiledModule.flat_inputs`): what
        counting and profiling tools feed the program directly."""
        return self._tensors(args, kwargs)[0]

    def run(self, feed: Mapping[str, Any], output_names: Sequence[str] | None = None) -> list[Any]:
        """onnxruntime's ``session.run(None, feed)``: every output, as a list (``output_names`` unsupported)."""
        if output_names is not None:
            raise ValueError("run(feed, output_names) returns every output; pass None")
        tensors, as_numpy = self._tensors((), feed)
        return self._outputs(tensors, as_numpy)

    def _outputs(self, tensors: list[torch.Tensor], as_numpy: bool) -> list[Any]:
        outs = self.compiled._executor(tensors)
        if as_numpy:
            from sextant.frontend.onnx.dtypes import to_numpy

            return [to_numpy(o) for o in outs]
        return list(outs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors, as_numpy = self._tensors(args, kwargs)
        outs = self._outputs(tensors, as_numpy)
        return outs[0] if len(outs) == 1 else tuple(outs)
