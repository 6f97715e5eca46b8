"""``sextant run MODEL``: compile, run on fresh random inputs, compare with eager PyTorch, time both.

Fresh inputs (not the example ones) so that a kernel which only works for the example values
is caught; integer inputs (token ids) are drawn from the example's range so embeddings stay valid.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.utils._pytree as pytree

from sextant.cli.build import Build
from sextant.cli.explain import seconds


@dataclass(frozen=True)
class RunResult:
    max_abs: float
    max_rel: float
    outputs: int
    ok: bool
    first_call_s: float
    sextant_s: float  # median per call
    eager_s: float


def fresh_inputs(args: tuple, kwargs: dict[str, Any], seed: int = 0) -> tuple[tuple, dict[str, Any]]:
    """Random tensors shaped and typed like the example inputs (non-tensors unchanged)."""
    gen = torch.Generator().manual_seed(seed)

    def fresh(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.dtype.is_floating_point:
            return torch.randn(x.shape, generator=gen, dtype=x.dtype)
        if x.dtype == torch.bool:
            return torch.rand(x.shape, generator=gen) < 0.5
        lo, hi = (int(x.min()), int(x.max()) + 1) if x.numel() else (0, 1)
        return torch.randint(lo, hi, x.shape, generator=gen, dtype=x.dtype)

    return pytree.tree_map(fresh, (tuple(args), dict(kwargs)))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up
    _sync()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(got: Any, expected: Any, atol: float, rtol: float) -> tuple[float, float, int, bool]:
    """(max abs error, max relative error, number of tensors, all within atol + rtol·|expected|)."""
    a = [x for x in pytree.tree_leaves(got) if isinstance(x, torch.Tensor)]
    b = [x for x in pytree.tree_leaves(expected) if isinstance(x, torch.Tensor)]
    if len(a) != len(b):
        return float("inf"), float("inf"), len(b), False
    max_abs = max_rel = 0.0
    ok = True
    for x, y in zip(a, b):
        x, y = x.detach().cpu(), y.detach().cpu()
        if x.shape != y.shape:
            return float("inf"), float("inf"), len(b), False
        err = (x.double() - y.double()).abs()
        if err.numel():
            max_abs = max(max_abs, float(err.max()))
            max_rel = max(max_rel, float((err / y.double().abs().clamp_min(1e-12)).max()))
            ok &= bool((err <= atol + rtol * y.double().abs()).all()) and not bool(err.isnan().any())
    return max_abs, max_rel, len(b), ok


def run_and_compare(build: Build, *, runs: int = 20, atol: float = 1e-4, rtol: float = 1e-4, seed: int = 0,
                    out: TextIO = sys.stdout) -> RunResult:
    """Run ``build`` and eager PyTorch on the same fresh inputs; print the error and the timings."""
    c, m = build.compiled, build.model
    args, kwargs = fresh_inputs(m.args, m.kwargs, seed)
    to_dev = lambda x: x.to(c.device) if isinstance(x, torch.Tensor) else x
    dargs, dkwargs = pytree.tree_map(to_dev, (args, kwargs))
    with torch.no_grad():
        t0 = time.perf_counter()
        got = c(*dargs, **dkwargs)
        _sync()
        first = time.perf_counter() - t0
        expected = m.module(*args, **kwargs)
        max_abs, max_rel, n, ok = compare(got, expected, atol, rtol)
        t_sextant = median_time(lambda: c(*dargs, **dkwargs), runs)
        t_eager = median_time(lambda: m.module(*args, **kwargs), runs)
    p = lambda *a: print(*a, file=out)
    verdict = "OK" if ok else "MISMATCH"
    eager = "eager" if m.onnx is None else "onnxruntime"
    p(f"max |sextant - {eager}| = {max_abs:.3g} (max relative {max_rel:.3g}) over {n} output tensor(s), "
      f"fresh inputs (seed {seed}); tolerance atol={atol:g} rtol={rtol:g}: {verdict}")
    p(f"compile {build.seconds:.2f} s, first call {seconds(first)}")
    p(f"median of {runs} calls: sextant {c.target} {seconds(t_sextant)}, {m.eager_name} {seconds(t_eager)} "
      f"({t_sextant / t_eager:.3g}x {eager})")
    if c.target == "cuda-sim":
        p("note: cuda-sim runs the GPU kernels on this CPU through the SIMT lowering; its time says nothing "
          "about GPU speed (see `sextant explain` for roofline estimates)")
    return RunResult(max_abs, max_rel, n, ok, first, t_sextant, t_eager)
