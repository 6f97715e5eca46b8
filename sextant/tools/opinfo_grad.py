"""OpInfo gradient mode: each float32 sample's gradients through ``torch.compile(backend="sextant")``.

    r = run_op("tanh", mode=GRAD)   # from opinfo_check: the same OpResult rows as the inference mode

For every sample of an op with ``supports_autograd``, the op's inputs that OpInfo marks as
differentiable require grad, each output that requires grad gets a random cotangent, and
``torch.autograd.grad(outputs, inputs, cotangents)`` runs eagerly and through sextant: the sample's
call compiled with ``fullgraph=True`` and ``fallback=False``, so AOTAutograd's forward and backward
graphs must both be compiled by sextant (``dynamo.STATS`` says so, with each graph's extern calls).
Outputs and gradients are compared at the inference mode's tolerances. All samples of an op are
compiled together first; a batch that fails, or calls any op as an extern op, is redone sample by
sample so each failure, and each extern call, is attributed to its sample.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from sextant.tools.opinfo_check import (
    AOT,
    ERROR,
    EXTERN,
    GRAPH_BREAK,
    WRONG,
    Batch,
    EagerFailed,
    Failure,
    Mode,
    OpCall,
    RandomOutput,
    SkippedSample,
    Verdict,
    _seeded,
    classify,
    compare_values,
    prepare,
    skip_reason,
)

TARGET = "cpu"  # the target the graphs are compiled for: the one training runs on, and whose programs list externs


@dataclass
class GradPrepared:
    """A sample ready to check: its module and inputs, cotangents, and eager's outputs and gradients."""

    mod: OpCall
    tensors: tuple[torch.Tensor, ...]  # detached; the differentiable ones require grad
    wrt: list[int]  # indices into ``tensors`` of the inputs that require grad
    diff: list[int]  # indices of the outputs that require grad (each gets a cotangent)
    cotangents: list[torch.Tensor]
    expected: list[torch.Tensor]  # eager: the outputs, then one gradient per ``wrt`` input (zeros where None)

    @property
    def labels(self) -> list[str]:
        n = len(self.expected) - len(self.wrt)
        return [f"output {i}" for i in range(n)] + [f"grad of input {j}" for j in self.wrt]


def _unseeded(info: Any) -> Callable[..., Any]:
    """``info.op``, but for an op OpInfo runs under ``wrapper_set_seed`` (its random ops: dropout,
    attention with dropout): a copy whose ``wrapper_set_seed`` just calls the op. Dynamo does not
    trace the seeding (a graph break), and every sample is run under its own seeds anyway; samples
    whose results then change with the seed are not counted (``prepare_grad``), the others are
    checked (``dropout_p=0``, ``training=False``)."""
    op = info.op
    if not _seeded(info):
        return op

    def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return types.FunctionType(op.__code__, {**op.__globals__, "wrapper_set_seed": call}, op.__name__,
                              op.__defaults__, op.__closure__)


def _grad_call(info: Any, sample: Any) -> Callable[..., Any]:
    """The function OpInfo's own gradient tests differentiate: the op through its ``gradcheck_wrapper``
    (e.g. symmetrising a Hermitian input), outputs through the sample's ``output_process_fn_grad``.

    Outputs are returned as copies: AOTAutograd takes an output that is a view of an input out of
    the compiled graph and replays the view eagerly (with no backward graph at all when every output
    is one), so a view op's backward (``select_backward``, ``as_strided_scatter``, ...) would never
    reach sextant. Copied, the view stays in the forward graph and its backward in the backward graph,
    as it would in the middle of a model.

    The masked ops' wrappers (zeroing masked-out outputs) are left out: they are there for gradcheck's
    finite differences, which non-finite outputs break and this comparison does not (``equal_nan``),
    and Dynamo cannot trace them (they hand the op itself to ``torch.masked._output_mask``)."""
    wrapper, process, raw = info.gradcheck_wrapper, sample.output_process_fn_grad, _unseeded(info)
    if wrapper.__name__.startswith("gradcheck_wrapper_masked"):
        op = raw
    else:
        def op(*args: Any, **kwargs: Any) -> Any:
            return wrapper(raw, *args, **kwargs)

    def call(*args: Any, **kwargs: Any) -> Any:
        return pytree.tree_map_only(torch.Tensor, torch.clone, process(op(*args, **kwargs)))

    return call


class CutOff(Exception):
    """A compiled output that should require grad does not."""


def forward_backward(fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...], wrt: list[int],
                     diff: list[int] | None, cotangents: list[torch.Tensor] | None
                     ) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[torch.Tensor]]:
    """``fn``'s outputs, the indices of those that require grad, the ``cotangents`` on those outputs
    (random when None) and the gradients of the inputs ``wrt``. ``diff``: the outputs that must require
    grad (a compiled run is checked against eager's); an output cut off from autograd raises."""
    inputs = tuple(t.detach().clone().requires_grad_(i in wrt) for i, t in enumerate(tensors))
    outs = pytree.tree_leaves(fn(*inputs))
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise EagerFailed("non-tensor outputs")
    needs = [i for i, o in enumerate(outs) if o.requires_grad]
    if diff is not None and (lost := sorted(set(diff) - set(needs))):
        raise CutOff(f"output {lost[0]} does not require grad (cut off from autograd)")
    diff = needs if diff is None else diff
    if cotangents is None:
        cotangents = [torch.randn_like(outs[i]) for i in diff]
    grads = torch.autograd.grad([outs[i] for i in diff], [inputs[j] for j in wrt], cotangents,
                                allow_unused=True, materialize_grads=True)
    return [o.detach() for o in outs], diff, cotangents, [g.detach() for g in grads]


def prepare_grad(name: str, info: Any, sample: Any) -> GradPrepared:
    """Wrap ``sample`` and compute its outputs and gradients eagerly, under a fixed seed."""
    fn = _grad_call(info, sample)
    with torch.no_grad():  # the random-op check and the tensors' copies, as in the inference mode
        try:
            base = prepare(name, info, sample, fn)
        except RandomOutput:
            if not _seeded(info):
                raise
            raise SkippedSample("random output") from None  # e.g. dropout_p > 0: the other samples count
    leaves = pytree.tree_leaves((sample.input, tuple(sample.args), dict(sample.kwargs)))
    flags = [t.requires_grad and t.dtype.is_floating_point for t in leaves if isinstance(t, torch.Tensor)]
    wrt = [i for i, f in enumerate(flags) if f]
    if not wrt:
        raise SkippedSample("no input requires grad")
    torch.manual_seed(0)
    try:
        outs, diff, cotangents, grads = forward_backward(base.mod, base.tensors, wrt, None, None)
    except EagerFailed:
        raise
    except Exception as e:  # e.g. "the derivative for 'target' is not implemented"
        raise EagerFailed(f"{type(e).__name__}: {e}") from e
    if not diff:
        raise SkippedSample("no differentiable output")
    return GradPrepared(base.mod, base.tensors, wrt, diff, cotangents, outs + grads)


@contextlib.contextmanager
def _no_compile_cache() -> Iterator[None]:
    """sextant's on-disk compile cache off: a cached program would hide a changed (or patched) lowering."""
    before = os.environ.get("SEXTANT_COMPILE_CACHE")
    os.environ["SEXTANT_COMPILE_CACHE"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["SEXTANT_COMPILE_CACHE"]
        else:
            os.environ["SEXTANT_COMPILE_CACHE"] = before


def compiled_forward_backward(mod: torch.nn.Module, tensors: tuple[torch.Tensor, ...], wrt: list[int],
                              diff: list[int], cotangents: list[torch.Tensor], target: str = TARGET
                              ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
    """Outputs and gradients with ``mod`` under ``torch.compile(backend="sextant")`` (one graph, no
    fallback), and the STATS records of the graphs compiled. Raises what compiling or running raised."""
    from sextant.frontend import dynamo

    torch._dynamo.reset()  # each call is one fresh compile: no recompile limit, no stale guards
    dynamo.STATS.reset()
    compiled = torch.compile(mod, backend="sextant", fullgraph=True, dynamic=False,
                             options={"target": target, "fallback": False})
    with _no_compile_cache():
        outs, _, _, grads = forward_backward(compiled, tensors, wrt, diff, cotangents)
    records = list(dynamo.STATS.graphs)
    torch._dynamo.reset()
    return outs, grads, records


def _graphs_problem(records: list[Any]) -> Failure | None:
    """Why the compiled graphs are not one forward and one backward graph, both compiled (None: they are)."""
    roles = sorted(r.role for r in records)
    if any(r.target is None for r in records):  # not expected with fallback=False
        return Failure(ERROR, "a graph ran eagerly: " + next(r.reason for r in records if r.target is None))
    if "forward" not in roles or "backward" not in roles:
        return Failure(ERROR, f"compiled graphs: {', '.join(roles) or 'none'} (expected forward and backward)")
    return None


def _externs(records: list[Any]) -> tuple[tuple[str, str], ...]:
    """(ATen op, the graph's role) for each op a compiled graph calls as an extern op."""
    return tuple(sorted({(op, r.role) for r in records for op in r.externs}))


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = getattr(cur, "inner_exception", None) or cur.__cause__ or cur.__context__


def classify_grad(e: BaseException) -> Failure:
    """The Failure a compile-or-run exception stands for: the cause under Dynamo's and the backend's
    wrappers, classified as the inference mode does; graph breaks and AOTAutograd failures by name."""
    from torch._dynamo.exc import BackendCompilerFailed, Unsupported

    from sextant.errors import SextantError

    chain = list(_chain(e))
    which = ""
    for x in chain:
        msg = str(x)
        if isinstance(x, SextantError) and msg.startswith("sextant backend: cannot compile this"):
            which = msg.removeprefix("sextant backend: cannot compile this ").split(":")[0]
            if "AOTAutograd could not split" in msg:
                detail = msg.split("AOTAutograd could not split the training graph: ", 1)[-1]
                return Failure(AOT, detail.splitlines()[0][:160])
    if isinstance(e, CutOff):
        return Failure(WRONG, str(e))
    if isinstance(e, Unsupported) and not isinstance(e, BackendCompilerFailed):
        return Failure(GRAPH_BREAK, (str(e).strip().splitlines() or [""])[0][:160])
    root = next((x for x in chain if not isinstance(x, BackendCompilerFailed)
                 and not (isinstance(x, SextantError) and str(x).startswith("sextant backend: cannot compile"))),
                chain[-1])
    f = classify(root)
    return Failure(f.kind, f"{which}: {f.detail}" if which else f.detail, f.ops)


def _float64_grads(info: Any, p: GradPrepared) -> list[torch.Tensor]:
    """Eager outputs and gradients with float32 inputs and cotangents promoted to float64 ([] where the
    op has no float64 gradients)."""
    if torch.float64 not in info.supported_backward_dtypes("cpu"):
        return []
    wide = tuple(t.double() if t.dtype == torch.float32 else t for t in p.tensors)
    cots = [c.double() if c.dtype == torch.float32 else c for c in p.cotangents]
    try:
        outs, _, _, grads = forward_backward(p.mod, wide, p.wrt, p.diff, cots)
    except Exception:
        return []
    return outs + grads


def judge(name: str, info: Any, p: GradPrepared, outs: list[torch.Tensor], grads: list[torch.Tensor],
          notes: list[str]) -> Failure | None:
    """Compare compiled outputs and gradients with eager's (None: they match)."""
    try:
        return compare_values(name, info, p.expected, outs + grads, lambda: _float64_grads(info, p), notes,
                              p.labels)
    except RandomOutput:
        raise
    except Exception as e:  # a comparison that cannot be made: the sample fails
        return Failure(ERROR, f"comparing: {type(e).__name__}: {e}"[:160])


class GradMode(Mode):
    """Gradients through ``torch.compile(backend="sextant")``: forward and backward graph both compiled."""

    name = "grad"
    requires_grad = True
    time_cap = 150.0  # a sample costs a Dynamo trace, AOTAutograd and two compiles (~0.5 s; 3x that on busy cores)
    chunk = 5  # one failing sample costs a chunk's samples one by one, not all twenty

    def __init__(self, target: str = TARGET) -> None:
        self.target = target

    def skip(self, info: Any) -> str | None:
        why = skip_reason(info)
        if why is None and not info.supports_autograd:
            return "no autograd support"
        if why is None and torch.float32 not in info.supported_backward_dtypes("cpu"):
            return "no float32 gradients"
        return why

    def prepare(self, name: str, info: Any, sample: Any) -> GradPrepared:
        return prepare_grad(name, info, sample)

    def check_sample(self, name: str, info: Any, p: GradPrepared, notes: list[str]) -> Failure | None:
        try:
            outs, grads, records = compiled_forward_backward(p.mod, p.tensors, p.wrt, p.diff, p.cotangents,
                                                             self.target)
        except Exception as e:
            return classify_grad(e)
        problem = _graphs_problem(records) or judge(name, info, p, outs, grads, notes)
        if problem is not None:
            return problem
        externs = _externs(records)
        if externs:
            notes.clear()
            return Failure(EXTERN, ", ".join(f"{op} ({role})" for op, role in externs),
                           tuple((op, "") for op, _ in externs))
        return None

    def check_batch(self, name: str, info: Any, ps: list[GradPrepared]) -> list[Verdict] | None:
        """All samples as one module (one Dynamo trace, one forward and one backward graph); None if
        that fails or calls extern ops (the samples are then checked one by one)."""
        tensors: list[torch.Tensor] = []
        wrt: list[int] = []
        diff: list[int] = []
        cots: list[torch.Tensor] = []
        n_out = 0
        for p in ps:
            wrt += [len(tensors) + j for j in p.wrt]
            diff += [n_out + i for i in p.diff]
            tensors += p.tensors
            cots += p.cotangents
            n_out += len(p.expected) - len(p.wrt)
        try:
            outs, grads, records = compiled_forward_backward(Batch([p.mod for p in ps]), tuple(tensors), wrt, diff,
                                                             cots, self.target)
        except Exception:
            return None
        if _graphs_problem(records) is not None or _externs(records):
            return None
        verdicts: list[Verdict] = []
        for p in ps:
            k, m = len(p.expected) - len(p.wrt), len(p.wrt)
            notes: list[str] = []
            verdicts.append((judge(name, info, p, outs[:k], grads[:m], notes), notes))
            outs, grads = outs[k:], grads[m:]
        return verdicts

    def passes_as_extern(self, name: str, info: Any, p: GradPrepared, failure: Failure) -> bool:
        return failure.kind == EXTERN  # correct, with extern calls: found by the same run


GRAD = GradMode()
