"""``torch.compile(model, backend="sextant")``: sextant as a Dynamo backend.

Dynamo traces the user's ``forward`` in Python, splits it at graph breaks (a ``print``, a
data-dependent branch), and hands each FX graph to the backend with example inputs. sextant
compiles each graph through the same path as ``sextant.compile`` — torch.export of the
``GraphModule``, Core ATen, the one lowering table — for the target the inputs live on (CUDA
tensors → ``cuda``, CPU tensors → ``cpu``) or the one given in ``options``. A graph sextant
cannot compile (an unsupported op, an export failure, a bug in sextant) falls back to eager for
that graph only, with the reason logged on the ``sextant.dynamo`` logger; the model still runs.

The backend is registered under the name ``sextant`` as a ``torch_dynamo_backends`` entry point
(so ``backend="sextant"`` works in a fresh process after ``pip install``), and by
:func:`register` (called on ``import sextant`` when Dynamo is already loaded).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sextant.frontend.symbols import INDEX_MAX, finite_bound

log = logging.getLogger("sextant.dynamo")
OPTIONS = ("target", "arch", "pipeline", "fallback")


@dataclass
class GraphRecord:
    """What happened to one graph Dynamo handed over (kept on :data:`STATS`, for tests and users)."""

    nodes: int
    target: str | None  # None: ran eagerly
    reason: str = ""  # why it fell back, when it did
    role: str = "inference"  # or, for a training graph (``frontend.training``): "forward", "backward"
    externs: tuple[str, ...] = ()  # ATen ops the program calls as themselves (no native lowering)
    saved: tuple[int, int] | None = None  # a backward graph's (activations saved by its forward, their bytes)
    compiled: Any = field(default=None, repr=False, compare=False)  # the CompiledModule, for inspection


@dataclass
class Stats:
    graphs: list[GraphRecord] = field(default_factory=list)

    @property
    def compiled(self) -> int:
        return sum(g.target is not None for g in self.graphs)

    @property
    def fallbacks(self) -> int:
        return sum(g.target is None for g in self.graphs)

    def reset(self) -> None:
        self.graphs.clear()


STATS = Stats()


def _check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown sextant backend option(s) {unknown}; known: {', '.join(OPTIONS)}")
    return options


def sextant_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                    options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Compile one Dynamo graph; returns a callable with the graph's calling convention.

    ``options`` (``torch.compile(..., options={...})``): ``target`` ("cpu", "cuda", "cuda-sim",
    "reference"; default: the inputs' device), ``arch``, ``pipeline``, and ``fallback`` (default
    True: run a graph sextant cannot compile eagerly; False: raise).
    """
    from sextant.api import default_target
    from sextant.frontend.training import needs_autograd

    opts = _check_options(options)
    target = opts.get("target") or default_target(tuple(example_inputs))
    if needs_autograd(example_inputs) or _tensor_subclasses(example_inputs):
        return _compile_training(gm, example_inputs, opts, target)
    return _compile_graph(gm, example_inputs, opts, target)


def _tensor_subclasses(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph takes tensor subclasses (DTensor parameters of a tensor-parallel model):
    AOTAutograd flattens them into plain tensors and spells their communication out as
    ``_c10d_functional`` collectives, which sextant compiles."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return any(is_traceable_wrapper_subclass(x) for x in example_inputs)


def _fall_back(gm: torch.fx.GraphModule, opts: Mapping[str, Any], reason: str,
               role: str = "inference") -> Callable[..., Any]:
    """``gm`` run eagerly, with the reason logged and recorded (or raised, with ``fallback=False``)."""
    from sextant.errors import SextantError

    nodes = _ops(gm)
    what = "graph" if role == "inference" else f"{role} graph"
    if not opts.get("fallback", True):
        raise SextantError(f"sextant backend: cannot compile this {what}: {reason}")
    STATS.graphs.append(GraphRecord(nodes, None, reason, role))
    log.warning("sextant: running a %s of %d ops eagerly: %s", what, nodes, reason)
    return gm.forward


def _externs(compiled: Any) -> tuple[str, ...]:
    """The ATen ops a compiled graph's program calls as extern calls, in launch order."""
    from sextant.schedule.program import ExternCall

    program = getattr(compiled, "stages", {}).get("program")
    if program is None:
        return ()
    return tuple(la.extern.fn for la in program.launches if isinstance(la.extern, ExternCall))


def _ops(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" for n in gm.graph.nodes)


def _compile_training(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Mapping[str, Any],
                      target: str) -> Callable[..., Any]:
    """A graph that must stay differentiable: its forward and backward graphs from AOTAutograd, each
    compiled per concrete shape on its first call; eagerly (autograd intact) if AOTAutograd fails."""
    from sextant.frontend.training import compile_training, saved_activations

    def half(g: torch.fx.GraphModule, role: str) -> Callable[..., Any]:
        def compile_for(args: Sequence[Any]) -> Any:
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # AOTAutograd's runtime wrapper watches the first call through a mode
                fn = _compile_static(g, args, opts, target)
            saved = saved_activations(g) if role == "backward" else None
            module = getattr(fn, "compiled", fn)  # the CompiledModule behind a wrapper that skips arguments
            STATS.graphs.append(GraphRecord(_ops(g), target, role=role, externs=_externs(module), saved=saved,
                                            compiled=module))
            kept = f" ({saved[0]} activations saved by the forward, {saved[1]} bytes)" if saved else ""
            log.info("sextant: compiled a %s graph of %d ops for %s%s", role, _ops(g), target, kept)
            return fn

        def fall_back(reason: str) -> Callable[..., Any]:
            return _fall_back(g, opts, reason, role)

        return _PerShape(compile_for, fall_back, _ops(g))

    try:
        return compile_training(gm, example_inputs, half)
    except Exception as e:
        return _fall_back(gm, opts, f"AOTAutograd could not split the training graph: {_why(e)}", "training")


def _compile_static(gm: torch.fx.GraphModule, args: Sequence[Any], opts: Mapping[str, Any], target: str) -> Any:
    """``gm`` compiled for the concrete shapes of ``args``."""
    import sextant

    gm, passed = _opaque_outputs(gm)
    flat = _Flat(gm, args)
    with outside_dynamo():
        compiled = sextant.compile(flat, tuple(a for i, a in enumerate(args) if i not in flat.skipped),
                                   target=target, arch=opts.get("arch"), pipeline=opts.get("pipeline", "default"))
    if not flat.skipped and not passed:
        return compiled

    def run(*xs: Any) -> Any:
        out = compiled(*(x for i, x in enumerate(xs) if i not in flat.skipped))
        if not passed:
            return out
        out = list(out)
        for position, source in passed:
            out.insert(position, xs[source])
        return tuple(out)

    run.compiled = compiled  # type: ignore[attr-defined]
    return run


def _opaque_outputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[tuple[int, int]]]:
    """A graph that returns one of its non-tensor inputs as it is (AOTAutograd's forward hands a
    tensor-parallel model's ``DeviceMesh`` to its backward): that output is dropped from the graph
    sextant compiles and put back, the caller's object itself, around each call. Returns the graph
    and (output position, input index) per output put back."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    results = out.args[0]
    if not isinstance(results, (tuple, list)):
        return gm, []
    passed = [(k, placeholders.index(r)) for k, r in enumerate(results)
              if isinstance(r, torch.fx.Node) and r.op == "placeholder"
              and not isinstance(r.meta.get("val", r.meta.get("example_value")), torch.Tensor)
              and r.meta.get("val", r.meta.get("example_value")) is not None]
    if not passed:
        return gm, []
    dropped = {k for k, _ in passed}
    graph = copy.deepcopy(gm.graph)
    new_out = next(n for n in graph.nodes if n.op == "output")
    new_out.args = (tuple(r for k, r in enumerate(new_out.args[0]) if k not in dropped),)
    return torch.fx.GraphModule(gm, graph), passed


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Mapping[str, Any],
                   target: str, role: str = "inference") -> Callable[..., Any]:
    """One graph compiled as an inference program (``role``: what it is, for STATS and the log)."""
    import sextant

    nodes = _ops(gm)

    def fall_back(reason: str) -> Callable[..., Any]:
        return _fall_back(gm, opts, reason, role)

    bad = sorted({type(x).__name__ for x in example_inputs if not isinstance(x, (torch.Tensor, int, torch.SymInt))})
    if bad:
        return fall_back(f"non-tensor graph inputs ({', '.join(bad)})")

    def compile_for(args: Sequence[Any]) -> Any:
        return _compile_static(gm, args, opts, target)

    def compile_symbolic(args: Sequence[Any], plan: _SizePlan) -> Any:
        """One symbolic capture for every size (``sextant.compile(dynamic_shapes=...)``)."""
        flat = _Flat(gm, args)
        kept = [i for i in range(len(args)) if i not in flat.skipped]
        sized = _Sized(flat, kept, plan)
        tensors = tuple(args[i] for i in sized.tensor_args)
        with outside_dynamo():
            compiled = sextant.compile(sized, tensors, target=target, arch=opts.get("arch"),
                                       pipeline=opts.get("pipeline", "default"),
                                       dynamic_shapes=sized.dynamic_shapes())

        def run(*xs: Any) -> Any:
            return compiled(*(xs[i] for i in sized.tensor_args))

        run.compiled = compiled  # type: ignore[attr-defined]
        return run

    plan = _size_plan(gm) if _symbolic(example_inputs) else None
    if plan is not None:  # one symbolic capture; falls back to per-shape compiles if it cannot be made
        holder: dict[str, Any] = {}

        def run_symbolic(*args: Any) -> Any:
            if "fn" not in holder:
                try:
                    holder["fn"] = compile_symbolic(args, plan)
                    STATS.graphs.append(GraphRecord(nodes, target, "symbolic shapes: one capture"))
                    log.info("sextant: a graph of %d ops with symbolic sizes %s captured once on %s", nodes,
                             ", ".join(plan.names), target)
                except Exception as e:  # any failure to capture: the per-shape path, then eager, still run
                    reason = _why(e)
                    log.log(logging.WARNING if reason.startswith("internal error") else logging.INFO,
                            "sextant: symbolic capture failed (%s); compiling per concrete shape", reason)
                    STATS.graphs.append(GraphRecord(nodes, target, "symbolic shapes: compiled per concrete shape "
                                                    f"(symbolic capture failed: {reason})"))
                    holder["fn"] = _PerShape(compile_for, fall_back, nodes)
            return holder["fn"](*args)

        return run_symbolic
    if _symbolic(example_inputs):  # sizes Dynamo passes that no tensor dimension gives: per shape
        STATS.graphs.append(GraphRecord(nodes, target, "symbolic shapes: compiled per concrete shape"))
        log.info("sextant: a graph of %d ops with symbolic shapes: compiled per concrete shape on %s", nodes, target)
        return _PerShape(compile_for, fall_back, nodes)
    try:
        compiled = compile_for(example_inputs)
    except Exception as e:  # not only SextantError: a bug in sextant must not break a model that runs eagerly
        return fall_back(_why(e))
    module = getattr(compiled, "compiled", compiled)  # the CompiledModule behind a wrapper that skips arguments
    STATS.graphs.append(GraphRecord(nodes, module.target, role=role, externs=_externs(module), compiled=module))
    log.info("sextant: compiled a %s of %d ops for %s", "graph" if role == "inference" else f"{role} graph",
             nodes, module.target)

    def run(*args: Any) -> Any:
        return compiled(*args)

    run.compiled = module  # type: ignore[attr-defined]  # for inspection (stages, kernels)
    return run


@contextlib.contextmanager
def outside_dynamo() -> Iterator[None]:
    """Run a capture as if no Dynamo compile were in progress.

    The backend is called while Dynamo's ``TracingContext`` is installed, and torch.export adopts
    that context's fake mode, ShapeEnv included, when it finds one. A capture that then creates
    symbols (a size read with ``.item()``: unbacked, with no source in the user's frame) leaves them
    in Dynamo's ShapeEnv, and Dynamo's guard building for the frame fails on them ("sources must
    not be empty for symbol s78") even though sextant fell back for that graph. With no context
    installed, torch.export makes its own FakeTensorMode and ShapeEnv and Dynamo's stay untouched.
    """
    from torch._guards import tracing

    with tracing(None):
        yield


def _signature(a: Any) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    if a.dim() == 0 and a.dtype == torch.float64 and a.device.type == "cpu":
        return ("f64", a.item())  # baked into the compiled graph (see _Flat): its value is part of the key
    return tuple(a.shape), a.dtype, a.device.type


def _symbolic(xs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in x.shape)) for x in xs)


@dataclass
class _SizePlan:
    """How a Dynamo graph with symbolic sizes maps onto torch.export's ``dynamic_shapes``: each
    tensor input's symbolic axes (symbol name per axis, with its range), and for each size input
    (a ``SymInt`` Dynamo passes) the tensor input and axis that hold the same size."""

    axes: dict[int, dict[int, tuple[str, int, int]]]  # graph input index -> {axis: (symbol, a, b)}: a*symbol + b
    sizes: dict[int, tuple[int, int]]  # graph input index of a size -> (tensor input index, axis)
    ranges: dict[str, tuple[int, int | None]]

    @property
    def names(self) -> list[str]:
        return sorted(self.ranges)


def _size_plan(gm: torch.fx.GraphModule) -> _SizePlan | None:
    """The plan, from the graph's placeholders' fake values; None when a tensor size is not linear in
    one symbol, or a size input is not a symbol some tensor dimension holds as it is (then the graph
    compiles per concrete shape)."""
    vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    axes: dict[int, dict[int, tuple[str, int, int]]] = {}
    where: dict[str, tuple[int, int]] = {}
    ranges: dict[str, tuple[int, int | None]] = {}
    for i, v in enumerate(vals):
        if not isinstance(v, torch.Tensor):
            continue
        for axis, d in enumerate(v.shape):
            if not isinstance(d, torch.SymInt):
                continue
            expr = d.node.expr
            if expr.is_Integer:
                continue
            if len(expr.free_symbols) != 1:
                return None  # a size over two symbols (s0*s1): not a torch.export Dim
            (sym,) = expr.free_symbols
            poly = expr.as_poly(sym)
            if poly is None or poly.degree() != 1 or not all(c.is_Integer for c in poly.all_coeffs()):
                return None
            a, b = (int(c) for c in poly.all_coeffs())
            if a < 1:
                return None
            axes.setdefault(i, {})[axis] = (sym.name, a, b)  # a derived size (2*s0 after a concat): a*Dim + b
            if (a, b) == (1, 0):
                where.setdefault(sym.name, (i, axis))
            vr = d.node.shape_env.var_to_range.get(sym)
            lo = finite_bound(vr.lower, 2) if vr is not None else 2  # Dynamo specialises sizes 0 and 1
            hi = finite_bound(vr.upper, INDEX_MAX) if vr is not None else INDEX_MAX
            ranges[sym.name] = (lo, hi if hi < INDEX_MAX else None)
    sizes: dict[int, tuple[int, int]] = {}
    for i, v in enumerate(vals):
        if isinstance(v, torch.SymInt):
            if not v.node.expr.is_Symbol or v.node.expr.name not in where:
                return None
            sizes[i] = where[v.node.expr.name]
        elif v is not None and not isinstance(v, torch.Tensor):
            return None
    return _SizePlan(axes, sizes, ranges) if axes else None


class _Sized(torch.nn.Module):
    """A Dynamo graph (through :class:`_Flat`) as a module of its tensor inputs only: the sizes
    Dynamo passes as ints are read off the tensors they belong to, so torch.export sees them as the
    same symbols."""

    def __init__(self, flat: _Flat, kept: list[int], plan: _SizePlan) -> None:
        super().__init__()
        self.flat, self.kept, self.plan = flat, kept, plan
        self.tensor_args = [i for i in kept if i not in plan.sizes]

    def dynamic_shapes(self) -> dict[str, tuple]:
        from torch.export import Dim

        dims = {name: Dim(name, min=lo, max=hi) if hi is not None else Dim(name, min=lo)
                for name, (lo, hi) in self.plan.ranges.items()}
        def dim(name: str, a: int, b: int) -> Any:
            return dims[name] if (a, b) == (1, 0) else a * dims[name] + b

        return {"tensors": tuple({axis: dim(*spec) for axis, spec in self.plan.axes.get(i, {}).items()} or None
                                 for i in self.tensor_args)}

    def forward(self, *tensors: torch.Tensor) -> Any:
        by_index = dict(zip(self.tensor_args, tensors))
        args = [by_index[i] if i in by_index else by_index[self.plan.sizes[i][0]].shape[self.plan.sizes[i][1]]
                for i in self.kept]
        return self.flat(*args)


class _PerShape:
    """A graph Dynamo made shape-generic, compiled once per concrete signature (tensor shapes and the
    size arguments Dynamo passes alongside): sextant compiles static shapes, so a new batch size or
    sequence length costs one compile, then runs from this cache. Past ``MAX`` signatures, or for a
    signature sextant cannot compile, the graph runs eagerly."""

    MAX = 16

    def __init__(self, compile_for: Callable[[Sequence[Any]], Any], fall_back: Callable[[str], Any],
                 nodes: int) -> None:
        self._compile_for, self._fall_back, self.nodes = compile_for, fall_back, nodes
        self.compiled: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        key = tuple(_signature(a) for a in args)
        fn = self.compiled.get(key)
        if fn is None:
            if len(self.compiled) >= self.MAX:
                fn = self._fall_back(f"more than {self.MAX} distinct shapes")
            else:
                try:
                    fn = self._compile_for(args)
                    log.info("sextant: compiled a graph of %d ops for shapes %s", self.nodes, key)
                except Exception as e:
                    fn = self._fall_back(_why(e))
            self.compiled[key] = fn
        return fn(*args)


def _why(e: BaseException) -> str:
    """A fallback's reason: sextant's own error as it explains itself; anything else (a bug in
    sextant) named as an internal error, so STATS and the log tell the two apart. A
    :class:`CollectiveError` is raised again, never fallen back from."""
    from sextant.errors import CollectiveError, SextantError

    if isinstance(e, CollectiveError):  # ranks that compiled different collectives: eagerly they would hang
        raise e
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, SextantError):
        return first + _first_reasons(e)
    return f"internal error: {type(e).__name__}: {first}"


def _first_reasons(e: BaseException) -> str:
    items = getattr(e, "items", None)
    if not items:
        return ""
    return " (" + "; ".join(f"{i.op}{': ' + i.reason if i.reason else ''}" for i in items[:3]) + ")"


class _Flat(torch.nn.Module):
    """The GraphModule as a module whose forward takes the graph's flat tensor inputs (Dynamo's graphs
    take a flat list; torch.export wants positional arguments) and returns its outputs unchanged.

    Float64 scalars on the CPU are how ``dynamic=True`` passes Python floats of the model (a
    LayerNorm's eps): they are baked in as the constants they are (the graph reads them with
    ``.item()``), and the compiled graph skips them."""

    def __init__(self, gm: torch.fx.GraphModule, args: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        self.baked = {i: a.item() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 0
                      and a.dtype == torch.float64 and a.device.type == "cpu"}
        # objects that are neither tensors nor sizes (a tensor-parallel graph's DeviceMesh, which
        # AOTAutograd passes along but no op computes with): handed to the graph as they are, not
        # exported as inputs
        self.objects = {i: a for i, a in enumerate(args)
                        if not isinstance(a, (torch.Tensor, int, float, bool, torch.SymInt)) and a is not None}
        self.skipped = set(self.baked) | set(self.objects)
        self._n = len(args)
        self._traced = any(n.meta.get("stack_trace") for n in gm.graph.nodes)

    def forward(self, *args: torch.Tensor) -> Any:
        it = iter(args)
        full = [torch.tensor(self.baked[i], dtype=torch.float64) if i in self.baked else
                self.objects[i] if i in self.objects else next(it) for i in range(self._n)]
        if not self._traced:
            return self.gm(*full)
        # Node by node with the graph's own metadata current: the capture then records the user's
        # source lines Dynamo (and AOTAutograd, for training graphs) kept on each node, not the
        # generated code's.
        from torch.fx import traceback as fx_traceback

        with fx_traceback.preserve_node_meta():
            return torch.fx.Interpreter(self.gm).run(*full)


def register() -> None:
    """Register ``"sextant"`` with Dynamo (idempotent). The entry point makes this unnecessary after
    ``pip install``; it is here for source trees that were not installed."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, _lazy_import, register_backend

    _lazy_import()  # discovers the entry points: installed, "sextant" is one and torch loads it on lookup
    if "sextant" not in _COMPILER_FNS and "sextant" not in _BACKENDS:
        register_backend(sextant_backend, name="sextant")


def register_if_dynamo_loaded() -> None:
    """Called on ``import sextant``: registering imports Dynamo (~2 s), so only when it is already loaded."""
    if "torch._dynamo" in sys.modules:
        register()
