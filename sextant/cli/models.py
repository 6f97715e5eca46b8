"""Resolve the command line's MODEL argument into ``(module, args, kwargs)``.

MODEL is either a built-in example (``mlp``, ``cnn``, ...) or ``FILE.py:FACTORY`` (also
``package.module:FACTORY``): a function taking no arguments that returns ``(module, args)`` or
``(module, args, kwargs)``. Every way this can go wrong gets its own message naming the cause,
because a wrong path or a factory returning the wrong thing is the most common first mistake.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from sextant.cli.errors import CliError, ExitCode
from sextant.examples import EXAMPLES


@dataclass
class LoadedModel:
    """What MODEL resolved to."""

    name: str  # as given on the command line
    module: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    onnx: Any = None  # an ONNX ModelProto when MODEL is a .onnx file (module then runs it in onnxruntime)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)  # --input-shape, for ONNX inputs

    @property
    def num_params(self) -> int:
        if self.onnx is not None:
            return self.module.num_weights
        return sum(p.numel() for p in self.module.parameters())

    @property
    def eager_name(self) -> str:
        """What the compiled model is compared against."""
        return self.module.runtime if self.onnx is not None else "eager PyTorch (CPU)"


def parse_input_shapes(specs: list[str] | None) -> dict[str, list[int]]:
    """``--input-shape NAME=D0,D1,...`` (repeatable) → ``{NAME: [D0, D1, ...]}``."""
    out: dict[str, list[int]] = {}
    for spec in specs or []:
        name, _, dims = spec.partition("=")
        try:
            out[name] = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            out[name] = []
        if not name or not out[name]:
            raise _usage(f"--input-shape {spec!r} is not NAME=D0,D1,...", "e.g. --input-shape input_ids=1,128")
    return out


def load_onnx_model(spec: str, input_shapes: dict[str, list[int]] | None = None) -> LoadedModel:
    """A ``.onnx`` file as a LoadedModel: example inputs from its (or the given) input shapes."""
    from sextant.errors import SextantError
    from sextant.frontend.onnx import load
    from sextant.frontend.onnx.dtypes import from_onnx
    from sextant.frontend.onnx.eager import OnnxModel
    from sextant.frontend.onnx.importer import graph_inputs

    if not Path(spec).is_file():
        raise _usage(f"ONNX file {spec!r} does not exist", "MODEL is a path to a .onnx file, FILE.py:FACTORY or "
                     f"a built-in example ({_examples()})")
    try:
        model = load(spec)
    except SextantError as e:
        raise _usage(str(e), "check that the file is an ONNX model") from e
    given = dict(input_shapes or {})
    inputs = graph_inputs(model)
    args = []
    for vi in inputs:
        tt = vi.type.tensor_type
        dtype = from_onnx(tt.elem_type)
        dims = given.get(vi.name) or [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        if dtype is None or any(d < 0 for d in dims):
            args.append(None)  # the import reports it (unsupported type / symbolic dimension) by name
            continue
        args.append(torch.randn(dims).to(dtype.torch) if dtype.is_float else torch.zeros(dims, dtype=dtype.torch))
    return LoadedModel(spec, OnnxModel(model, [vi.name for vi in inputs]), tuple(args), {}, model, given)


def _usage(message: str, hint: str) -> CliError:
    return CliError(message, hint, ExitCode.USAGE)


def _examples() -> str:
    return ", ".join(sorted(EXAMPLES))


def _load_file(path: Path) -> ModuleType:
    """Import a user's .py file under a private name, with its folder importable (for its own imports)."""
    name = f"_sextant_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _usage(f"cannot import {path}: not a Python source file", "MODEL is FILE.py:FACTORY")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise _usage(f"importing {path} failed: {type(e).__name__}: {e}",
                     "fix the file (run it with python to see the traceback, or add --verbose)") from e
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    return module


def _load_source(source: str) -> ModuleType:
    path = Path(source)
    if source.endswith(".py") or path.exists():
        if not path.is_file():
            raise _usage(f"model file {source!r} does not exist" if not path.exists() else f"{source!r} is not a file",
                         "MODEL is FILE.py:FACTORY, with FILE.py relative to the current directory")
        return _load_file(path)
    try:
        return importlib.import_module(source)
    except ImportError as e:
        raise _usage(f"cannot import module {source!r}: {e}",
                     f"MODEL is FILE.py:FACTORY or package.module:FACTORY (built-in examples: {_examples()})") from e


def _factory(spec: str) -> Callable[[], Any]:
    source, _, attr = spec.rpartition(":")
    if not source or not attr:
        raise _usage(f"MODEL {spec!r} names no factory function",
                     "write FILE.py:FACTORY, where FACTORY() returns (module, example_args)")
    module = _load_source(source)
    fn = getattr(module, attr, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                       and v.__module__ == module.__name__)
        close = difflib.get_close_matches(attr, found, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _usage(f"{source} has no function {attr!r}",
                     f"{hint}functions defined there: {', '.join(found)}" if found else "define FACTORY() in that file")
    if not callable(fn):
        raise _usage(f"{source}:{attr} is not a function (it is of type {type(fn).__name__})",
                     "FACTORY must be a function returning (module, example_args)")
    return fn


def _check(spec: str, value: Any) -> LoadedModel:
    what = f"{spec}() returned"
    shape_hint = "return (module, example_args) or (module, example_args, example_kwargs)"
    if not isinstance(value, tuple) or len(value) not in (2, 3):
        got = f"a tuple of {len(value)}" if isinstance(value, tuple) else f"a {type(value).__name__}"
        raise _usage(f"{what} {got}, not (module, example_args)", shape_hint)
    module, args = value[0], value[1]
    kwargs = value[2] if len(value) == 3 else {}
    if not isinstance(module, torch.nn.Module):
        raise _usage(f"{what} a {type(module).__name__} where an nn.Module was expected", shape_hint)
    if isinstance(args, torch.Tensor):
        args = (args,)
    elif isinstance(args, list):
        args = tuple(args)
    if not isinstance(args, tuple):
        raise _usage(f"{what} example_args of type {type(args).__name__}; expected a tuple of inputs", shape_hint)
    if not isinstance(kwargs, Mapping):
        raise _usage(f"{what} example_kwargs of type {type(kwargs).__name__}; expected a dict", shape_hint)
    return LoadedModel(spec, module, args, dict(kwargs))


def load_model(spec: str, input_shapes: dict[str, list[int]] | None = None) -> LoadedModel:
    """The module and example inputs MODEL names; raises :class:`CliError` (usage) naming what is wrong."""
    if spec.endswith(".onnx"):
        return load_onnx_model(spec, input_shapes)
    if input_shapes:
        raise _usage("--input-shape applies to .onnx models only", "PyTorch models take their shapes from the "
                     "example inputs their factory returns")
    if spec in EXAMPLES:
        fn: Callable[[], Any] = EXAMPLES[spec]
    elif ":" in spec:
        fn = _factory(spec)
    elif spec.endswith(".py") or Path(spec).exists():
        raise _usage(f"MODEL {spec!r} names a file but no factory function",
                     f"write {spec}:FACTORY, where FACTORY() returns (module, example_args)")
    else:
        close = difflib.get_close_matches(spec, list(EXAMPLES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _usage(f"unknown model {spec!r}", f"{hint}use a built-in example ({_examples()}) or FILE.py:FACTORY")
    try:
        value = fn()
    except ImportError as e:  # e.g. an example needing an optional package
        raise CliError(f"{spec}: {e}", "install the missing package", ExitCode.ENVIRONMENT) from e
    except CliError:
        raise
    except Exception as e:
        raise _usage(f"calling {spec}() raised {type(e).__name__}: {e}",
                     "fix the factory (add --verbose for the traceback)") from e
    return _check(spec, value)
