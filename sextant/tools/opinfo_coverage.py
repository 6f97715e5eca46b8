"""OpInfo conformance: PyTorch's OpInfo samples through capture + passes + the reference executor.

    python -m sextant.tools.opinfo_coverage [--ops abs,max.reduction_with_dim] [--jobs 2]
                                            [--write-supported FILE] [--markdown FILE]

For every op in ``torch.testing._internal.common_methods_invocations.op_db`` the first
``MAX_SAMPLES`` float32 sample inputs are wrapped in a module whose forward takes the
sample's tensors, captured with :func:`sextant.capture`, optimised by the default pass
pipeline, run by the reference executor and compared with eager PyTorch. Ops run in worker
processes, so a crash or a hang in one op cannot take the tool down.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import logging
import multiprocessing as mp
import random
import sys
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

MAX_SAMPLES = 20  # first N float32 samples of each op
OP_TIME_CAP_S = 60.0  # stop trying further samples of an op after this long (the op then fails)
HARD_TIMEOUT_S = 240.0  # a worker stuck this long on one op is killed
MAX_TOL = 1e-3  # OpInfo tolerance overrides looser than this are not taken over

# Ops whose values are unspecified: only shapes and dtypes are compared.
EMPTY_LIKE = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})

# Failure kinds, in the order the report explains them.
EXPORT, UNSUPPORTED, DTYPE, LOWERING, WRONG, ERROR, CRASH, TIMEOUT = (
    "export failed", "unsupported op", "unsupported dtype", "lowering bug", "wrong result", "error",
    "crash", "time cap")


@dataclass(frozen=True)
class Failure:
    kind: str  # one of the kinds above
    detail: str  # e.g. "aten.sort.default", "complex64", "ValueError: ..."
    ops: tuple[tuple[str, str], ...] = ()  # UNSUPPORTED: (ATen op, the lowering's reason or "")

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
    """(rtol, atol) for float32: the loosest CPU override the OpInfo declares (capped at ``MAX_TOL``),
    at least the fp32 defaults."""
    from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride

    rtol, atol = 1.3e-6, 1e-5
    for deco in info.decorators:
        if getattr(deco, "device_type", None) not in (None, "cpu"):
            continue
        for d in getattr(deco, "decorators", [deco]):
            if isinstance(d, toleranceOverride) and torch.float32 in d.d:
                atol, rtol = max(atol, d.d[torch.float32].atol), max(rtol, d.d[torch.float32].rtol)
            elif isinstance(d, precisionOverride) and torch.float32 in d.d:
                atol = max(atol, d.d[torch.float32])
    return min(rtol, MAX_TOL), min(atol, MAX_TOL)


# -- one sample -------------------------------------------------------------------------------------
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


class NonTensorOutput(Exception):
    """The op returns something other than tensors (nested in tuples/lists)."""


class RandomOutput(Exception):
    """The op's eager results differ between two runs with different seeds."""


class EagerFailed(Exception):
    """Eager PyTorch itself rejects the sample (not a sextant problem: the sample is not counted)."""


def _clone(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)


def _eager(mod: OpCall, tensors: tuple[torch.Tensor, ...], seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    try:
        outs = pytree.tree_leaves(mod(*_clone(tensors)))
    except Exception as e:
        raise EagerFailed(f"{type(e).__name__}: {e}") from e
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        raise NonTensorOutput(type(outs[0]).__name__ if outs else "no outputs")
    return outs


def _classify(e: BaseException) -> Failure:
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


def check_sample(name: str, info: Any, sample: Any, notes: list[str] | None = None) -> Failure | None:
    """Run one sample through sextant and compare with eager; None means it passed.

    A pass that needed the float64-reference criterion appends "float64 reference" to ``notes``.

    Raises NonTensorOutput / RandomOutput when the op cannot be checked this way at all.
    """
    import sextant
    from sextant.graph.reference import run_graph

    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    mod = OpCall(info.op, leaves, spec)
    tensors = tuple(v for v in leaves if isinstance(v, torch.Tensor))
    expected = _eager(mod, tensors, 0)
    empty_like = name in EMPTY_LIKE
    if not empty_like:
        again = _eager(mod, tensors, 1)
        if not all(_same(a, b) for a, b in zip(expected, again)):
            raise RandomOutput()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # torch.export prints partial graphs when it fails
            graph = sextant.capture(mod, _clone(tensors))
        graph = _passes(graph)
        inputs = [None] * len(graph.inputs)
        for leaf, t in zip(graph.leaves, tensors):
            if leaf.input_index is not None:
                inputs[leaf.input_index] = t.clone()
        actual = run_graph(graph, inputs)
    except Exception as e:
        return _classify(e)
    if len(actual) != len(expected):
        return Failure(WRONG, f"{len(actual)} outputs, eager gives {len(expected)}")
    rtol, atol = tolerances(info)
    reference: list[torch.Tensor] | None = None
    for i, (got, want) in enumerate(zip(actual, expected)):
        if _seeded(info) and not empty_like and not _close(got, want, rtol, atol):
            raise RandomOutput()  # OpInfo runs random ops under a fixed seed; sextant has no RNG
        if empty_like:
            if got.shape != want.shape or got.dtype != want.dtype:
                return Failure(WRONG, f"output {i}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
            continue
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, check_stride=False)
        except AssertionError as e:
            if reference is None:
                reference = _float64_reference(info, mod, tensors)
            if reference and got.dtype == want.dtype and _as_accurate_as_eager(got, want, reference[i]):
                if notes is not None:
                    notes.append("float64 reference")
                continue
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            return Failure(WRONG, f"output {i}: " + " ".join(lines[:2])[:160])
    return None


def _float64_reference(info: Any, mod: OpCall, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Eager outputs with every float32 input promoted to float64 ([] where the op cannot do that)."""
    if torch.float64 not in info.supported_dtypes("cpu"):
        return []
    wide = tuple(t.double() if t.dtype == torch.float32 else t for t in tensors)
    try:
        return _eager(mod, wide, 0)
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


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    except (RuntimeError, NotImplementedError):  # sparse or complex32 values: sextant rejects those anyway
        return True


def _seeded(info: Any) -> bool:
    """Whether OpInfo wraps the op in ``wrapper_set_seed`` (its marker for random ops)."""
    code = getattr(info.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol, atol, equal_nan=True)


def _passes(graph: Any) -> Any:
    try:
        from sextant.graph.passes import run_pipeline
    except ImportError:  # pass pipeline not available: check capture alone
        return graph
    return run_pipeline(graph, "default")


def _cache_export_overhead() -> None:
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


def _quiet_torch_logs() -> None:
    """torch.export logs warnings (with whole graphs) for some samples; the table says what matters."""
    logging.disable(logging.WARNING)


# -- one op -------------------------------------------------------------------------------------------
def run_op(name: str, max_samples: int = MAX_SAMPLES, time_cap: float = OP_TIME_CAP_S) -> OpResult:
    """Check the first ``max_samples`` float32 samples of OpInfo op ``name``."""
    result = OpResult(name)
    info = op_table().get(name)
    if info is None:
        result.skip = "not in op_db"
        return result
    result.skip = skip_reason(info)
    if result.skip:
        return result
    _cache_export_overhead()
    start = time.monotonic()
    torch.manual_seed(0)
    random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            samples = itertools.islice(info.sample_inputs("cpu", torch.float32, requires_grad=False), max_samples)
            for sample in samples:
                if time.monotonic() - start > time_cap:
                    result.failures.append(Failure(TIMEOUT, f"stopped after {result.tried} samples"))
                    break
                notes: list[str] = []
                try:
                    failure = check_sample(name, info, sample, notes)
                except NonTensorOutput as e:
                    result.skip = f"non-tensor output ({e})"
                    break
                except RandomOutput:
                    result.skip = "random output"
                    break
                except EagerFailed:
                    continue
                except Exception as e:  # a bug in this tool or an unexpected error: count the sample as failed
                    failure = Failure(ERROR, f"{type(e).__name__}: {e}"[:160])
                result.tried += 1
                if failure is None:
                    result.passed += 1
                    result.by_reference += bool(notes)
                else:
                    result.failures.append(failure)
        except Exception as e:  # the sample generator itself failed
            result.failures.append(Failure(ERROR, f"sample_inputs: {type(e).__name__}: {e}"[:160]))
    result.seconds = time.monotonic() - start
    return result


# -- worker processes ---------------------------------------------------------------------------------
def _serve(conn: Connection) -> None:
    torch.set_num_threads(1)
    _quiet_torch_logs()
    while (name := conn.recv()) is not None:
        conn.send(run_op(name))


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    op: str | None = None
    started: float = 0.0

    @staticmethod
    def start(ctx: Any) -> _Worker:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)


def run_ops(names: list[str], jobs: int) -> Iterator[OpResult]:
    """Results of ``run_op`` for each name, computed by ``jobs`` worker processes (0: in this process)."""
    if jobs <= 0:
        yield from map(run_op, names)
        return
    ctx = mp.get_context("spawn")
    todo = deque(names)
    workers = [_Worker.start(ctx) for _ in range(min(jobs, len(names)))]
    try:
        while todo or any(w.op for w in workers):
            for w in workers:
                if w.op is None and todo:
                    w.op, w.started = todo.popleft(), time.monotonic()
                    w.conn.send(w.op)
            busy = [w for w in workers if w.op]
            wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=5)
            for i, w in enumerate(workers):
                if w.op is None:
                    continue
                lost = None
                if w.conn.poll():
                    try:
                        yield w.conn.recv()
                        w.op = None
                        continue
                    except (EOFError, OSError):
                        lost = Failure(CRASH, "worker process died")
                if not w.proc.is_alive():
                    lost = Failure(CRASH, f"worker process died (exit code {w.proc.exitcode})")
                elif time.monotonic() - w.started > HARD_TIMEOUT_S:
                    lost = Failure(TIMEOUT, f"killed after {HARD_TIMEOUT_S:.0f}s")
                if lost is not None:
                    w.proc.kill()
                    w.proc.join()
                    yield OpResult(w.op, failures=[lost], seconds=time.monotonic() - w.started)
                    workers[i] = _Worker.start(ctx)
    finally:
        for w in workers:
            if w.proc.is_alive():
                with contextlib.suppress(OSError):
                    w.conn.send(None)
                w.proc.join(timeout=10)
                if w.proc.is_alive():
                    w.proc.kill()


# -- reporting ----------------------------------------------------------------------------------------
def summary_line(results: list[OpResult]) -> str:
    ran = [r for r in results if r.skip is None]
    return (f"opinfo: {sum(r.ok for r in results)} ops, "
            f"{sum(r.passed for r in ran)}/{sum(r.tried for r in ran)} samples")


# Why an ATen op has no lowering, where it is not just "not written yet".
def _ops(names: str) -> list[str]:
    return [f"aten.{n}" if n.count(".") == 1 else f"aten.{n}.default" for n in names.split()]


KNOWN_GAPS: dict[str, str] = {
    **dict.fromkeys(_ops("nonzero masked_select unique_dim _unique2 unique_consecutive repeat_interleave.Tensor "
                         "item _local_scalar_dense sym_size.int segment_reduce"),
                    "data-dependent output shape or values read on the host"),
    **dict.fromkeys(_ops("bernoulli bernoulli.p normal.Tensor_Tensor normal.Tensor_float normal.float_Tensor "
                         "normal_functional uniform exponential geometric log_normal cauchy rand randn randint.low "
                         "randint multinomial native_dropout randperm rand_like randn_like randint_like "
                         "randint_like.low_dtype rrelu_with_noise_functional"),
                    "random numbers (sextant has no RNG)"),
    **dict.fromkeys(_ops("sort sort.stable topk kthvalue median median.dim nanmedian nanmedian.dim mode argsort "
                         "argsort.stable msort"), "needs a sort primitive"),
    **dict.fromkeys(_ops("cummax cummin logcumsumexp _cummax_helper _cummin_helper"), "needs a scan primitive"),
    **dict.fromkeys(_ops("bincount histc histogram.bin_ct histogram.bins_tensor _histogramdd_from_bin_cts "
                         "_histogramdd_bin_edges _embedding_bag_forward_only"),
                    "histogram-like binning or bags (not lowered; would need torch's exact bin arithmetic)"),
    **dict.fromkeys(_ops("linalg_cholesky_ex linalg_lu_factor_ex linalg_lu _linalg_svd _linalg_eigh linalg_eig "
                         "linalg_qr _linalg_det _linalg_slogdet linalg_solve_triangular _linalg_solve_ex "
                         "linalg_inv_ex geqrf triangular_solve cholesky_solve linalg_ldl_factor_ex "
                         "linalg_householder_product ormqr cholesky_inverse linalg_lstsq linalg_lu_solve "
                         "linalg_ldl_solve _linalg_check_errors cholesky lu_unpack linalg_matrix_exp "
                         "linalg_pinv.atol_rtol_tensor"),
                    "linear-algebra factorisation (no primitive; out of scope)"),
    **dict.fromkeys(_ops("_fft_r2c _fft_c2c _fft_c2r _conj _conj_physical complex polar view_as_complex"),
                    "complex dtype"),
    **dict.fromkeys(_ops("_native_batch_norm_legit_functional _native_batch_norm_legit.no_stats "
                         "_batch_norm_with_update_functional embedding_renorm"),
                    "updates running statistics or weights (training-mode batch norm, embedding max_norm)"),
    **dict.fromkeys(_ops("i0 special_i0e special_i1 special_i1e special_ndtri special_erfcx igamma igammac "
                         "special_zeta polygamma special_airy_ai special_bessel_j0 special_bessel_j1 "
                         "special_bessel_y0 special_bessel_y1 special_modified_bessel_i0 special_modified_bessel_i1 "
                         "special_modified_bessel_k0 special_modified_bessel_k1 special_scaled_modified_bessel_k0 "
                         "special_scaled_modified_bessel_k1 special_spherical_bessel_j0 "
                         "special_chebyshev_polynomial_t special_chebyshev_polynomial_u "
                         "special_chebyshev_polynomial_v special_chebyshev_polynomial_w "
                         "special_shifted_chebyshev_polynomial_t special_shifted_chebyshev_polynomial_u "
                         "special_shifted_chebyshev_polynomial_v special_shifted_chebyshev_polynomial_w "
                         "special_hermite_polynomial_h special_hermite_polynomial_he "
                         "special_laguerre_polynomial_l special_legendre_polynomial_p"),
                    "special function with no primitive (would need a series/rational approximation)"),
    **dict.fromkeys(_ops("nextafter frexp.Tensor hash_tensor"), "needs bit-level float access (no bitcast primitive)"),
}


def reason_group(r: OpResult) -> str:
    """One line naming why an op does not fully pass (for grouping in the report)."""
    if r.skip is not None:
        return r.skip
    kinds = Counter(f.kind for f in r.failures)
    for kind in (UNSUPPORTED, DTYPE, EXPORT, CRASH, TIMEOUT, LOWERING, ERROR, WRONG):
        if kinds[kind]:
            details = [f.detail for f in r.failures if f.kind == kind]
            break
    else:
        return "no float32 samples"
    if kind == UNSUPPORTED:
        pairs = sorted({p for f in r.failures for p in f.ops})
        known = sorted({KNOWN_GAPS[op] for op, _ in pairs if op in KNOWN_GAPS})
        if known:
            return known[0]
        reasons = sorted({why for _, why in pairs if why})
        if reasons:
            return f"unsupported arguments: {reasons[0]}"
        return f"not lowered yet: {', '.join(op for op, _ in pairs)}"
    if kind == DTYPE:
        dts = {d for det in details for d in det.split(", ")}
        if any("complex" in d for d in dts):
            return "complex dtype"
        return f"dtype not in sextant's type set: {', '.join(sorted(dts))}"
    if kind == EXPORT:
        return "torch.export cannot capture it (" + sorted(details)[0].split(":")[0] + ")"
    if kind == WRONG:
        return "wrong result (a lowering bug)"
    if kind == LOWERING:
        return "lowering produces the wrong shape/dtype"
    return f"{kind}: {details[0]}"


def format_table(results: list[OpResult]) -> str:
    width = max([len(r.name) for r in results] + [2])
    lines = [f"{'op':<{width}}  {'samples':>7}  status", "-" * (width + 40)]
    for r in results:
        counts = f"{r.passed}/{r.tried}" if r.skip is None else "-"
        lines.append(f"{r.name:<{width}}  {counts:>7}  {r.status}")
    return "\n".join(lines)


def markdown_gaps(results: list[OpResult]) -> str:
    """The coverage figure and the ops that do not fully pass, grouped by reason, as Markdown."""
    groups: dict[str, list[str]] = {}
    for r in results:
        if not r.ok:
            groups.setdefault(reason_group(r), []).append(r.name)
    ok = [r for r in results if r.ok]
    lines = ["```", summary_line(results), "```", "",
             f"**{len(ok)} of {len(results)}** OpInfo entries pass all their float32 samples "
             "(the list is `sextant/tools/opinfo_supported.txt`)."]
    approx = [f"`{r.name}` ({r.by_reference}/{r.tried})" for r in ok if r.by_reference]
    if approx:
        lines.append(f"Of these, {len(approx)} pass some samples by the float64-reference criterion: "
                     + ", ".join(approx) + ".")
    lines += ["", f"The other {len(results) - len(ok)}, by reason:", ""]
    for reason, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"- **{reason}** ({len(names)}): " + ", ".join(f"`{n}`" for n in sorted(names)))
    return "\n".join(lines) + "\n"


MD_BEGIN, MD_END = "<!-- opinfo:begin -->", "<!-- opinfo:end -->"


def write_markdown(path: Path, section: str) -> None:
    """Replace the text between the opinfo markers of ``path``, or write ``section`` as the whole file."""
    text = path.read_text() if path.exists() else ""
    if MD_BEGIN in text and MD_END in text:
        head, rest = text.split(MD_BEGIN, 1)
        _, tail = rest.split(MD_END, 1)
        path.write_text(f"{head}{MD_BEGIN}\n{section}{MD_END}{tail}")
    else:
        path.write_text(section)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sextant.tools.opinfo_coverage", description=__doc__.splitlines()[0])
    p.add_argument("--ops", help="comma-separated OpInfo names (default: all of op_db)")
    p.add_argument("--jobs", type=int, default=mp.cpu_count(), help="worker processes (0: run in this process)")
    p.add_argument("--write-supported", metavar="FILE", help="write the fully passing op names, sorted")
    p.add_argument("--markdown", metavar="FILE",
                   help="write the unsupported ops grouped by reason (between the opinfo markers if FILE has them)")
    a = p.parse_args(argv)
    names = sorted(op_table()) if not a.ops else [n.strip() for n in a.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in op_table()]
    if unknown:
        p.error(f"not OpInfo names: {', '.join(unknown)}")
    _quiet_torch_logs()
    results = []
    for r in run_ops(names, a.jobs):
        results.append(r)
        print(f"[{len(results)}/{len(names)}] {r.name}: {r.status} ({r.seconds:.1f}s)", file=sys.stderr, flush=True)
    results.sort(key=lambda r: r.name)
    print(format_table(results))
    if a.write_supported:
        with open(a.write_supported, "w") as f:
            f.writelines(f"{r.name}\n" for r in results if r.ok)
    if a.markdown:
        write_markdown(Path(a.markdown), markdown_gaps(results))
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
