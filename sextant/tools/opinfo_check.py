"""Check one OpInfo op: its float32 samples through capture + passes + the reference executor vs eager.

    r = run_op("max.reduction_with_dim")      # OpResult: samples tried/passed, failures, skip reason

Each sample becomes an :class:`OpCall` module whose forward takes the sample's tensors. All
samples of an op are first compiled together, as one module that runs them side by side (one
torch.export instead of twenty: export's fixed cost dominates a small sample); if that batch
does not compile, every sample is compiled on its own so each failure is attributed exactly.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import random
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import torch.utils._pytree as pytree

MAX_SAMPLES = 20  # first N float32 samples of each op
OP_TIME_CAP_S = 60.0  # stop compiling samples one by one after this long (the op then fails)
MAX_TOL = 1e-3  # OpInfo tolerance overrides looser than this are not taken over
FP32_RTOL, FP32_ATOL = 1.3e-6, 1e-5

# Ops whose values are unspecified: only shapes and dtypes are compared.
EMPTY_LIKE = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})

# Failure kinds.
EXPORT, UNSUPPORTED, DTYPE, LOWERING, WRONG, ERROR, CRASH, TIMEOUT = (
    "export failed", "unsupported op", "unsupported dtype", "lowering bug", "wrong result", "error",
    "crash", "time cap")
# Gradient mode only: correct but a compiled graph calls ATen ops as themselves; Dynamo could not
# trace the call as one graph; AOTAutograd could not split it into forward and backward.
EXTERN, GRAPH_BREAK, AOT = "extern calls", "graph break", "AOTAutograd failed"


@dataclass(frozen=True)
class Failure:
    kind: str  # one of the kinds above
    detail: str  # e.g. "aten.sort.default", "complex64", "ValueError: ..."
    ops: tuple[tuple[str, str], ...] = ()  # UNSUPPORTED, EXTERN: (ATen op, the lowering's reason or "")

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class OpResult:
    """Outcome of one OpInfo op: samples tried/passed, or why it was skipped."""

    name: str
    tried: int = 0
    passed: int = 0
    skip: str | None = None
    failures: list[Failure] = field(default_factory=list)  # one per failing sample
    by_reference: int = 0  # passing samples that needed the float64-reference criterion
    seconds: float = 0.0
    extern_passed: int = 0  # of the samples refused natively (strict), those passing as extern calls

    @property
    def extern_only(self) -> bool:
        """Not lowered, but every sample passes with the op called as an extern op."""
        return (not self.ok and self.skip is None and self.tried > 0
                and all(f.kind in (UNSUPPORTED, EXTERN) for f in self.failures)
                and self.passed + self.extern_passed == self.tried)

    @property
    def ok(self) -> bool:
        return self.skip is None and not self.failures and self.tried > 0 and self.passed == self.tried

    @property
    def status(self) -> str:
        if self.skip is not None:
            return f"skipped: {self.skip}"
        if self.failures:
            return str(self.failures[0])
        if not self.tried:
            return "no float32 samples"
        return f"ok ({self.by_reference} by float64 reference)" if self.by_reference else "ok"

    def status_line(self) -> str:
        return f"{self.status} (passes as an extern call)" if self.extern_only else self.status


# -- the op database ------------------------------------------------------------------------------
def op_key(info: Any) -> str:
    """OpInfo name with its variant, e.g. ``max.reduction_with_dim``."""
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


@cache
def op_table() -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {op_key(info): info for info in op_db}


def skip_reason(info: Any) -> str | None:
    """Why an op is not run at all (None: run it)."""
    dtypes = info.supported_dtypes("cpu")
    if not dtypes:
        return "no CPU support"
    if torch.float32 not in dtypes:
        kinds = {"complex" if d.is_complex else "float64" if d == torch.float64 else "integer/other" for d in dtypes}
        return f"no float32 support ({', '.join(sorted(kinds))} only)"
    if info.name.endswith("_") and not info.name.startswith("__"):
        return "in-place op"
    return None


def tolerances(info: Any) -> tuple[float, float]:
    """(rtol, atol) for float32: the fp32 defaults, or the loosest CPU override the OpInfo declares
    (capped at ``MAX_TOL``)."""
    from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride

    rtol, atol = FP32_RTOL, FP32_ATOL
    for deco in info.decorators:
        if getattr(deco, "device_type", None) not in (None, "cpu"):
            continue
        for d in getattr(deco, "decorators", [deco]):
            if isinstance(d, toleranceOverride) and torch.float32 in d.d:
                atol, rtol = max(atol, d.d[torch.float32].atol), max(rtol, d.d[torch.float32].rtol)
            elif isinstance(d, precisionOverride) and torch.float32 in d.d:
                atol = max(atol, d.d[torch.float32])
    return min(rtol, MAX_TOL), min(atol, MAX_TOL)


def _seeded(info: Any) -> bool:
    """Whether OpInfo wraps the op in ``wrapper_set_seed`` (its marker for random ops)."""
    code = getattr(info.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


# -- samples as modules ---------------------------------------------------------------------------
class OpCall(torch.nn.Module):
    """``op(input, *args, **kwargs)`` with the sample's tensors as forward arguments."""

    def __init__(self, op: Callable[..., Any], leaves: list[Any], spec: pytree.TreeSpec) -> None:
        super().__init__()
        self.op = op
        self.slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.consts = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        self.spec = spec

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.consts)
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.op(inp, *args, **kwargs)


class Batch(torch.nn.Module):
    """Several OpCalls side by side: forward takes all their tensors, returns all their results."""

    def __init__(self, calls: list[OpCall]) -> None:
        super().__init__()
        self.calls = torch.nn.ModuleList(calls)

    def forward(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        outs, i = [], 0
        for call in self.calls:
            n = len(call.slots)
            outs.append(call(*tensors[i:i + n]))
            i += n
        return tuple(outs)


class NonTensorOutput(Exception):
    """The op returns something other than tensors (nested in tuples/lists)."""


class RandomOutput(Exception):
    """The op's results depend on the random seed."""


class EagerFailed(Exception):
    """Eager PyTorch itself rejects the sample (not a sextant problem: the sample is not counted)."""


class SkippedSample(EagerFailed):
    """Gradient mode: the sample is not counted (no output requires grad, a random sample); an op
    with no other samples is skipped, with this reason."""


@dataclass
class Prepared:
    """A sample ready to check: its module, input tensors and eager results."""

    mod: OpCall
    tensors: tuple[torch.Tensor, ...]
    expected: list[torch.Tensor]


def _clone(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)


def _eager(mod: torch.nn.Module, tensors: tuple[torch.Tensor, ...], seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    try:
        outs = pytree.tree_leaves(mod(*_clone(tensors)))
    except Exception as e:
        raise EagerFailed(f"{type(e).__name__}: {e}") from e
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise NonTensorOutput(type(outs[0]).__name__ if outs else "no outputs")
    return outs


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    except (RuntimeError, NotImplementedError):  # sparse or complex32 values: sextant rejects those anyway
        return True


def prepare(name: str, info: Any, sample: Any, op: Callable[..., Any] | None = None) -> Prepared:
    """Wrap ``sample`` and run it eagerly (twice, under different seeds, to catch random ops);
    ``op``: what to call instead of ``info.op``."""
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    mod = OpCall(op or info.op, leaves, spec)
    # copied: some sample generators reuse (and modify) a tensor for the samples they yield later
    tensors = _clone(v for v in leaves if isinstance(v, torch.Tensor))
    expected = _eager(mod, tensors, 0)
    if name not in EMPTY_LIKE and not all(_same(a, b) for a, b in zip(expected, _eager(mod, tensors, 1))):
        raise RandomOutput()
    return Prepared(mod, tensors, expected)


# -- compile, run, compare --------------------------------------------------------------------------
def _passes(graph: Any) -> Any:
    try:
        from sextant.graph.passes import run_pipeline
    except ImportError:  # pass pipeline not available: check capture alone
        return graph
    return run_pipeline(graph, "default")


def compile_and_run(mod: torch.nn.Module, tensors: tuple[torch.Tensor, ...], strict: bool = True
                    ) -> list[torch.Tensor]:
    """``mod(*tensors)`` through sextant.capture, the default passes and the reference executor;
    ``strict``: ops with no lowering are refused (native coverage), else run as extern calls."""
    import sextant
    from sextant.graph.reference import run_graph

    with contextlib.redirect_stderr(io.StringIO()):  # torch.export prints partial graphs when it fails
        graph = sextant.capture(mod, _clone(tensors), strict=strict)
    graph = _passes(graph)
    inputs: list[Any] = [None] * len(graph.inputs)
    for leaf, t in zip(graph.leaves, tensors):
        if leaf.input_index is not None:
            inputs[leaf.input_index] = t.clone()
    return run_graph(graph, inputs)


def classify(e: BaseException) -> Failure:
    """The Failure a compile-or-run exception stands for."""
    from sextant.errors import ExportError, UnsupportedOpError

    if isinstance(e, ExportError):
        cause = e.__cause__
        first = (str(cause).strip().splitlines() or [""])[0][:120] if cause else str(e)
        return Failure(EXPORT, f"{type(cause).__name__ if cause else 'ExportError'}: {first}")
    if isinstance(e, UnsupportedOpError):
        dtypes = sorted({it.reason.split()[1].removeprefix("torch.") for it in e.items
                         if it.reason.startswith("dtype ")})
        if dtypes:
            return Failure(DTYPE, ", ".join(dtypes))
        ops = tuple(sorted({(it.op, it.reason) for it in e.items}))
        detail = ", ".join(f"{op} ({why})" if why else op for op, why in ops)
        return Failure(UNSUPPORTED, detail, ops)
    if isinstance(e, AssertionError) and str(e).startswith("lowering of"):
        return Failure(LOWERING, str(e).splitlines()[0])
    return Failure(ERROR, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}")


def compare(name: str, info: Any, p: Prepared, actual: list[torch.Tensor], notes: list[str]) -> Failure | None:
    """None if sextant's outputs match eager's; a pass by the float64 criterion is noted in ``notes``."""
    return compare_values(name, info, p.expected, actual, lambda: _float64_reference(info, p), notes)


def compare_values(name: str, info: Any, expected: list[torch.Tensor], actual: list[torch.Tensor],
                   reference: Callable[[], list[torch.Tensor]], notes: list[str],
                   labels: list[str] | None = None) -> Failure | None:
    """Compare ``actual`` with eager's ``expected`` at the op's float32 tolerances; a value outside
    them still passes when it is as accurate as eager's against ``reference()`` (the same values
    in float64, computed only if needed; [] where there is none). ``labels`` name the values."""
    if len(actual) != len(expected):
        return Failure(WRONG, f"{len(actual)} outputs, eager gives {len(expected)}")
    labels = labels or [f"output {i}" for i in range(len(expected))]
    rtol, atol = tolerances(info)
    wide: list[torch.Tensor] | None = None
    for label, got, want, i in zip(labels, actual, expected, itertools.count()):
        if name in EMPTY_LIKE:
            if got.shape != want.shape or got.dtype != want.dtype:
                return Failure(WRONG, f"{label}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
            continue
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, check_stride=False)
        except AssertionError as e:
            if _seeded(info):
                raise RandomOutput() from None  # eager's numbers under OpInfo's seed: sextant draws its own (Philox)
            if wide is None:
                wide = reference()
            if wide and got.dtype == want.dtype and _as_accurate_as_eager(got, want, wide[i]):
                notes.append("float64 reference")
                continue
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            return Failure(WRONG, f"{label}: " + " ".join(lines[:2])[:160])
    return None


def _float64_reference(info: Any, p: Prepared) -> list[torch.Tensor]:
    """Eager outputs with every float32 input promoted to float64 ([] where the op cannot do that)."""
    if torch.float64 not in info.supported_dtypes("cpu"):
        return []
    wide = tuple(t.double() if t.dtype == torch.float32 else t for t in p.tensors)
    try:
        return _eager(p.mod, wide, 0)
    except EagerFailed:
        return []


def _as_accurate_as_eager(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``got`` is about as close to the float64 result as eager float32 is (within 4x).

    Used where a composite lowering rounds differently from torch's fused kernel (e.g. long
    sums in another order); this is how PyTorch's own decomposition tests judge accuracy.
    """
    if not got.dtype.is_floating_point or ref.shape != got.shape or not ref.is_floating_point():
        return False
    g, w, r = got.double(), want.double(), ref
    if not torch.equal(g.isnan(), w.isnan()) or not torch.equal(g.isinf(), w.isinf()):
        return False
    finite = g.isfinite()
    if not torch.equal(g[~finite].nan_to_num(), w[~finite].nan_to_num()):
        return False
    if not finite.any():
        return True
    err_got = (g[finite] - r[finite]).abs().max()
    err_eager = (w[finite] - r[finite]).abs().max()
    return bool(err_got <= 4 * err_eager + 1e-6)


def _judge(name: str, info: Any, p: Prepared, actual: list[torch.Tensor], notes: list[str]) -> Failure | None:
    try:
        return compare(name, info, p, actual, notes)
    except RandomOutput:
        raise
    except Exception as e:  # a comparison that cannot be made (a bug here, or odd outputs): the sample fails
        return Failure(ERROR, f"comparing: {type(e).__name__}: {e}"[:160])


def check_sample(name: str, info: Any, p: Prepared, notes: list[str], strict: bool = True) -> Failure | None:
    """Compile and run one prepared sample on its own and compare; None means it passed."""
    try:
        actual = compile_and_run(p.mod, p.tensors, strict)
    except Exception as e:
        return classify(e)
    return _judge(name, info, p, actual, notes)


def check_batch(name: str, info: Any, ps: list[Prepared]) -> list[tuple[Failure | None, list[str]]] | None:
    """Compile all samples as one module and compare each; None if the batch does not compile and run."""
    try:
        actual = compile_and_run(Batch([p.mod for p in ps]), tuple(t for p in ps for t in p.tensors))
    except Exception:
        return None
    verdicts, i = [], 0
    for p in ps:
        notes: list[str] = []
        verdicts.append((_judge(name, info, p, actual[i:i + len(p.expected)], notes), notes))
        i += len(p.expected)
    return verdicts


# -- one op -------------------------------------------------------------------------------------------
Verdict = tuple[Failure | None, list[str]]  # a sample's failure (None: it passed) and its notes


class Mode:
    """What is checked for each sample: here, the op's outputs (inference). The gradient mode
    (``opinfo_grad.GRAD``) overrides the hooks; :func:`run_op` drives either."""

    name = "inference"
    requires_grad = False  # passed to ``sample_inputs``
    time_cap = OP_TIME_CAP_S  # samples compiled one by one stop after this long (the op then fails)
    chunk = 0  # a batch that fails is retried in chunks of this many samples before one by one (0: not)

    def skip(self, info: Any) -> str | None:
        return skip_reason(info)

    def prepare(self, name: str, info: Any, sample: Any) -> Any:
        return prepare(name, info, sample)

    def check_batch(self, name: str, info: Any, ps: list[Any]) -> list[Verdict] | None:
        return check_batch(name, info, ps)

    def check_sample(self, name: str, info: Any, p: Any, notes: list[str]) -> Failure | None:
        return check_sample(name, info, p, notes)

    def passes_as_extern(self, name: str, info: Any, p: Any, failure: Failure) -> bool:
        """Whether a sample refused natively passes with its unlowered ops called as extern ops."""
        return failure.kind == UNSUPPORTED and check_sample(name, info, p, [], strict=False) is None


INFERENCE = Mode()


def run_op(name: str, max_samples: int = MAX_SAMPLES, time_cap: float | None = None,
           mode: Mode = INFERENCE) -> OpResult:
    """Check the first ``max_samples`` float32 samples of OpInfo op ``name`` (``mode``: what is checked;
    ``time_cap``: default the mode's)."""
    result = OpResult(name)
    time_cap = mode.time_cap if time_cap is None else time_cap
    info = op_table().get(name)
    if info is None:
        result.skip = "not in op_db"
        return result
    result.skip = mode.skip(info)
    if result.skip:
        return result
    cache_export_overhead()
    start = time.monotonic()
    torch.manual_seed(0)
    random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _check_op(name, info, result, max_samples, time_cap, start, mode)
        except NonTensorOutput as e:
            result.skip = f"non-tensor output ({e})"
        except RandomOutput:
            result.skip = "random output"
        except SkippedSample as e:
            result.skip = str(e)
    result.seconds = time.monotonic() - start
    return result


def _check_op(name: str, info: Any, result: OpResult, max_samples: int, time_cap: float, start: float,
              mode: Mode) -> None:
    prepared: list[Any] = []
    skipped: SkippedSample | None = None
    try:
        for sample in itertools.islice(info.sample_inputs("cpu", torch.float32, requires_grad=mode.requires_grad),
                                       max_samples):
            try:
                prepared.append(mode.prepare(name, info, sample))
            except SkippedSample as e:
                skipped = e
            except EagerFailed:
                pass
    except (NonTensorOutput, RandomOutput):
        raise
    except Exception as e:  # the sample generator itself failed
        result.failures.append(Failure(ERROR, f"sample_inputs: {type(e).__name__}: {e}"[:160]))
        return
    if not prepared and skipped is not None:
        raise skipped
    verdicts = mode.check_batch(name, info, prepared) if len(prepared) > 1 else None
    if verdicts is None:
        verdicts = []
        size = mode.chunk if 1 < mode.chunk < len(prepared) else len(prepared)
        for i in range(0, len(prepared), size):
            chunk = prepared[i:i + size]
            found = mode.check_batch(name, info, chunk) if 1 < len(chunk) < len(prepared) else None
            for p in chunk if found is None else ():
                if time.monotonic() - start > time_cap:
                    break
                notes: list[str] = []
                verdicts.append((mode.check_sample(name, info, p, notes), notes))
            verdicts += found or []
            if len(verdicts) < i + len(chunk):  # over the time cap
                break
        if len(verdicts) < len(prepared):
            result.failures.append(Failure(TIMEOUT, f"stopped after {len(verdicts)} samples"))
    for p, (failure, notes) in zip(prepared, verdicts):
        result.tried += 1
        if failure is None:
            result.passed += 1
            result.by_reference += bool(notes)
        else:
            result.failures.append(failure)
            if time.monotonic() - start <= time_cap:  # as an extern call?
                result.extern_passed += mode.passes_as_extern(name, info, p, failure)


# -- environment ----------------------------------------------------------------------------------
def cache_export_overhead() -> None:
    """Cache torch.export's per-call scan of all CompositeImplicitAutograd ops.

    ``run_decompositions`` re-walks every op namespace on each call, and importing op_db adds
    a dozen test namespaces, which makes the scan a third of a sample's time. The cache is
    keyed on the registered namespaces and CIA kernels, so it is refreshed when they change.
    """
    import torch._export.utils as export_utils
    import torch.export.decomp_utils as decomp_utils
    import torch.export.exported_program as exported_program

    collect = getattr(export_utils, "_collect_all_valid_cia_ops", None)
    if collect is None or getattr(collect, "_sextant_cached", False):
        return
    memo: dict[tuple[int, int], Any] = {}

    def cached() -> Any:
        regs = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
        key = (len(torch.ops._dir), len(regs))
        if key not in memo:
            memo.clear()
            memo[key] = collect()
        return memo[key]

    cached._sextant_cached = True  # type: ignore[attr-defined]
    for mod in (export_utils, decomp_utils, exported_program):
        if hasattr(mod, "_collect_all_valid_cia_ops"):
            mod._collect_all_valid_cia_ops = cached


def quiet_torch_logs() -> None:
    """torch.export logs warnings (with whole graphs) for some samples; the table says what matters."""
    logging.disable(logging.WARNING)
