"""OpInfo conformance: PyTorch's OpInfo samples through capture + passes + the reference executor.

    python -m sextant.tools.opinfo_coverage [--ops abs,max.reduction_with_dim] [--jobs 2]
                                            [--write-supported FILE] [--markdown FILE]
    python -m sextant.tools.opinfo_coverage --grad [--ops ...] [--write-supported-grad FILE] [--markdown FILE]

For every op in ``torch.testing._internal.common_methods_invocations.op_db``, the first 20
float32 sample inputs are compiled and compared with eager PyTorch (``opinfo_check.run_op``).
Ops run in worker processes, so a crash or a hang in one op cannot take the tool down. The
table has one row per op; the last line is ``opinfo: <ops passing> ops, <passed>/<tried> samples``.
With ``--grad``, each sample's gradients are checked instead, through ``torch.compile(backend="sextant")``
(``opinfo_grad``); the last line then starts ``opinfo grad:``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from sextant.tools.opinfo_check import (
    AOT,
    CRASH,
    DTYPE,
    ERROR,
    EXPORT,
    EXTERN,
    GRAPH_BREAK,
    INFERENCE,
    LOWERING,
    TIMEOUT,
    UNSUPPORTED,
    WRONG,
    Failure,
    Mode,
    OpResult,
    op_table,
    quiet_torch_logs,
    run_op,
)

HARD_TIMEOUT_S = 240.0  # a worker stuck this long on one op is killed


# -- worker processes ---------------------------------------------------------------------------------
def _mode(grad: bool) -> Mode:
    if not grad:
        return INFERENCE
    from sextant.tools.opinfo_grad import GRAD

    return GRAD


def _serve(conn: Connection, grad: bool) -> None:
    torch.set_num_threads(1)
    quiet_torch_logs()
    mode = _mode(grad)
    while (name := conn.recv()) is not None:
        conn.send(run_op(name, mode=mode))


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    op: str | None = None
    started: float = 0.0

    @staticmethod
    def start(ctx: Any, grad: bool) -> _Worker:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, grad), daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)


def run_ops(names: list[str], jobs: int, grad: bool = False) -> Iterator[OpResult]:
    """Results of ``run_op`` for each name, computed by ``jobs`` worker processes (0: in this process);
    ``grad``: the gradient mode."""
    if jobs <= 0:
        mode = _mode(grad)
        yield from (run_op(name, mode=mode) for name in names)
        return
    ctx = mp.get_context("spawn")
    todo = deque(names)
    workers = [_Worker.start(ctx, grad) for _ in range(min(jobs, len(names)))]
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
                    workers[i] = _Worker.start(ctx, grad)
    finally:
        for w in workers:
            if w.proc.is_alive():
                with contextlib.suppress(OSError):
                    w.conn.send(None)
                w.proc.join(timeout=10)
                if w.proc.is_alive():
                    w.proc.kill()


# -- reporting ----------------------------------------------------------------------------------------
def summary_line(results: list[OpResult], grad: bool = False) -> str:
    ran = [r for r in results if r.skip is None]
    return (f"opinfo{' grad' if grad else ''}: {sum(r.ok for r in results)} ops, "
            f"{sum(r.passed for r in ran)}/{sum(r.tried for r in ran)} samples; "
            f"{sum(r.extern_only for r in results)} more ops only {'with' if grad else 'as'} extern calls")


# Why an ATen op has no lowering, where it is not just "not written yet".
def _ops(names: str) -> list[str]:
    return [f"aten.{n}" if n.count(".") == 1 else f"aten.{n}.default" for n in names.split()]


KNOWN_GAPS: dict[str, str] = {
    **dict.fromkeys(_ops("nonzero masked_select unique_dim _unique2 unique_consecutive repeat_interleave.Tensor "
                         "item _local_scalar_dense sym_size.int segment_reduce"),
                    "data-dependent output shape or values read on the host"),
    **dict.fromkeys(_ops("normal.Tensor_Tensor normal.Tensor_float normal.float_Tensor "
                         "normal_functional uniform exponential geometric log_normal cauchy randint.low "
                         "randint multinomial randperm randint_like "
                         "randint_like.low_dtype rrelu_with_noise_functional"),
                    "random distributions not lowered (sextant's Philox op draws uniform and normal numbers)"),
    **dict.fromkeys(_ops("kthvalue median median.dim nanmedian nanmedian.dim mode"),
                    "needs a selection primitive (sort and topk are lowered for rows of moderate length)"),
    **dict.fromkeys(_ops("cummax cummin logcumsumexp _cummax_helper _cummin_helper"), "needs a scan primitive"),
    **dict.fromkeys(_ops("bincount histogram.bin_ct histogram.bins_tensor _histogramdd_from_bin_cts "
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


def _extern_ops(r: OpResult) -> str:
    """The extern calls of an op's samples (gradient mode: with the graph's role), most common first."""
    calls = Counter(part for f in r.failures if f.kind == EXTERN for part in f.detail.split(", "))
    return ", ".join(c for c, _ in calls.most_common())


def reason_group(r: OpResult, grad: bool = False) -> str:
    """One line naming why an op does not fully pass (for grouping in the report); ``grad``: a
    gradient-mode result (extern calls named, wrong gradients told from wrong outputs)."""
    if r.skip is not None:
        return r.skip
    if r.extern_only:
        if grad:
            return f"passes only with extern calls: {_extern_ops(r)}"
        return "no lowering: passes as an extern call (the ATen op called between kernels)"
    kinds = Counter(f.kind for f in r.failures)
    for kind in (UNSUPPORTED, DTYPE, EXPORT, GRAPH_BREAK, AOT, CRASH, TIMEOUT, LOWERING, ERROR, WRONG, EXTERN):
        if kinds[kind]:
            details = [f.detail for f in r.failures if f.kind == kind]
            break
    else:
        return "no float32 samples"
    graphs = ("forward graph", "backward graph", "training graph")  # gradient mode: where it failed
    where = sorted({d.split(":")[0] for d in details if d.split(":")[0] in graphs})
    if where and kind in (UNSUPPORTED, DTYPE, LOWERING, ERROR):
        details = [d.split(": ", 1)[1] if d.split(":")[0] in graphs else d for d in details]
        return f"{' and '.join(where)}: {_reason(r, kind, details, grad)}"
    return _reason(r, kind, details, grad)


def _reason(r: OpResult, kind: str, details: list[str], grad: bool) -> str:
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
    if kind == WRONG and grad:
        if any(d.startswith("grad of") for d in details):
            return "wrong gradient (a lowering of a backward op, or its decomposition)"
        if any("cut off from autograd" in d for d in details):
            return "an output cut off from autograd"
        return "wrong forward output"
    if kind == WRONG:
        return "wrong result (a lowering bug)"
    if kind == EXTERN:
        return f"some samples fail, the others pass with extern calls: {_extern_ops(r)}"
    if kind in (GRAPH_BREAK, AOT):
        return f"{kind}: {sorted(details)[0].split(':')[0][:100]}"
    if kind == LOWERING:
        return "lowering produces the wrong shape/dtype"
    return f"{kind}: {details[0]}"


def format_table(results: list[OpResult]) -> str:
    width = max([len(r.name) for r in results] + [2])
    lines = [f"{'op':<{width}}  {'samples':>7}  status", "-" * (width + 40)]
    for r in results:
        counts = f"{r.passed}/{r.tried}" if r.skip is None else "-"
        lines.append(f"{r.name:<{width}}  {counts:>7}  {r.status_line()}")
    return "\n".join(lines)


def markdown_gaps(results: list[OpResult], grad: bool = False) -> str:
    """The coverage figure and the ops that do not fully pass, grouped by reason, as Markdown."""
    groups: dict[str, list[str]] = {}
    for r in results:
        if not r.ok:
            groups.setdefault(reason_group(r, grad), []).append(r.name)
    ok = [r for r in results if r.ok]
    what = ("pass all their float32 samples with forward and backward compiled by sextant, with no "
            "extern call (the list is `sextant/tools/opinfo_supported_grad.txt`)") if grad else (
            "pass all their float32 samples (the list is `sextant/tools/opinfo_supported.txt`)")
    lines = ["```", summary_line(results, grad), "```", "", f"**{len(ok)} of {len(results)}** OpInfo entries {what}."]
    approx = [f"`{r.name}` ({r.by_reference}/{r.tried})" for r in ok if r.by_reference]
    if approx:
        lines.append(f"Of these, {len(approx)} pass some samples by the float64-reference criterion: "
                     + ", ".join(approx) + ".")
    lines += ["", f"The other {len(results) - len(ok)}, by reason:", ""]
    for reason, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"- **{reason}** ({len(names)}): " + ", ".join(f"`{n}`" for n in sorted(names)))
    return "\n".join(lines) + "\n"


MD_BEGIN, MD_END = "<!-- opinfo:begin -->", "<!-- opinfo:end -->"
MD_GRAD_BEGIN, MD_GRAD_END = "<!-- opinfo-grad:begin -->", "<!-- opinfo-grad:end -->"


def write_markdown(path: Path, section: str, markers: tuple[str, str] = (MD_BEGIN, MD_END)) -> None:
    """Replace the text between the ``markers`` of ``path``, or write ``section`` as the whole file."""
    begin, end = markers
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        path.write_text(f"{head}{begin}\n{section}{end}{tail}")
    else:
        path.write_text(section)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sextant.tools.opinfo_coverage", description=__doc__.splitlines()[0])
    p.add_argument("--ops", help="comma-separated OpInfo names (default: all of op_db)")
    p.add_argument("--jobs", type=int, default=mp.cpu_count(), help="worker processes (0: run in this process)")
    p.add_argument("--grad", action="store_true",
                   help="check gradients through torch.compile(backend='sextant') instead of outputs")
    p.add_argument("--write-supported", metavar="FILE", help="write the fully passing op names, sorted")
    p.add_argument("--write-supported-grad", metavar="FILE",
                   help="with --grad: write the names of the ops whose gradients fully pass natively, sorted")
    p.add_argument("--markdown", metavar="FILE",
                   help="write the unsupported ops grouped by reason (between the opinfo markers if FILE has them; "
                        "with --grad, the opinfo-grad markers)")
    a = p.parse_args(argv)
    if a.grad and a.write_supported:
        p.error("--write-supported lists the inference mode's ops; with --grad use --write-supported-grad")
    if a.write_supported_grad and not a.grad:
        p.error("--write-supported-grad needs --grad")
    names = sorted(op_table()) if not a.ops else [n.strip() for n in a.ops.split(",") if n.strip()]
    unknown = [n for n in names if n not in op_table()]
    if unknown:
        p.error(f"not OpInfo names: {', '.join(unknown)}")
    quiet_torch_logs()
    results = []
    start = time.monotonic()
    for r in run_ops(names, a.jobs, a.grad):
        results.append(r)
        print(f"[{len(results)}/{len(names)}] {r.name}: {r.status} ({r.seconds:.1f}s)", file=sys.stderr, flush=True)
    results.sort(key=lambda r: r.name)
    print(format_table(results))
    supported = a.write_supported_grad if a.grad else a.write_supported
    if supported:
        with open(supported, "w") as f:
            f.writelines(f"{r.name}\n" for r in results if r.ok)
    if a.markdown:
        write_markdown(Path(a.markdown), markdown_gaps(results, a.grad),
                       (MD_GRAD_BEGIN, MD_GRAD_END) if a.grad else (MD_BEGIN, MD_END))
    print(f"{len(names)} ops in {time.monotonic() - start:.0f} s with {a.jobs} jobs", file=sys.stderr)
    print(summary_line(results, a.grad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
