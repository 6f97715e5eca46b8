"""Derives the polynomial coefficients of the CPU's inline math (``sextant.codegen.cpu_math``).

    python -m sextant.tools.vmath_fit       # prints every coefficient table

Each table is a near-minimax fit of the reduced function on its interval, weighted so that
the error that matters (relative, or absolute in the final result) is what is minimised:
Lawson's iteratively reweighted least squares in float64 on a dense grid. The coefficients are
rounded to f32 one at a time, lowest degree first, the higher ones refitted after each
rounding so that they absorb its error. The fits are kept here (not just their output) so the
tables can be re-derived and checked, instead of being copied from somewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

Fn = Callable[[np.ndarray], np.ndarray]


def _lawson(a: np.ndarray, y: np.ndarray, w: np.ndarray, iters: int) -> np.ndarray:
    """argmin_c max_i w_i |(a c)_i - y_i| (Lawson: weights grow where the error is large)."""
    aw, yw = a * w[:, None], y * w
    lam = np.full(len(y), 1.0 / len(y))
    c = np.zeros(a.shape[1])
    for _ in range(iters):
        s = np.sqrt(lam)
        c = np.linalg.lstsq(aw * s[:, None], yw * s, rcond=None)[0]
        lam *= np.abs(aw @ c - yw)
        lam /= lam.sum()
    return c


def fit_f32(x: np.ndarray, y: np.ndarray, w: np.ndarray, powers: list[int], iters: int = 300) -> list[float]:
    """f32 coefficients c_j of sum_j c_j x**powers[j] ≈ y, minimising max w·|error|."""
    a = np.stack([x ** p for p in powers], 1)
    fixed: list[float] = []
    for j in range(len(powers)):
        rest = y - a[:, :j] @ np.array(fixed) if j else y
        fixed.append(float(np.float32(_lawson(a[:, j:], rest, w, iters)[0])))
    return fixed


def exp_q() -> list[float]:
    """exp(r) = 1 + r + r²·q(r) on |r| ≤ ln2/2 (relative error of exp)."""
    r = np.linspace(-0.354, 0.354, 8001)
    r = r[np.abs(r) > 1e-4]
    return fit_f32(r, (np.expm1(r) - r) / r**2, r**2 / np.exp(r), list(range(5)))


def tanh_p() -> list[float]:
    """tanh(x) = x + x³·p(x²) on |x| < 0.9 (relative error)."""
    x = np.linspace(1e-3, 0.91, 8001)
    return fit_f32(x, (np.tanh(x) - x) / x**3, x**3 / np.tanh(x), [2 * k for k in range(7)])


def erf_small() -> list[float]:
    """erf(x) = x + x·p(x²) on |x| < 1 (relative error): p(0) = 2/√π - 1 keeps the leading
    coefficient's rounding error small."""
    x = np.linspace(1e-3, 1.01, 8001)
    erf = np.vectorize(math.erf)(x)
    return fit_f32(x, erf / x - 1, x / erf, [2 * k for k in range(7)])


def erf_log_erfc() -> list[float]:
    """log(erfc(x)) ≈ q(x) on [1, 4], so erf(x) = 1 - exp(q(x)); weighted by erfc/erf, the
    absolute error of q that reaches erf."""
    x = np.linspace(0.99, 4.0, 8001)
    erfc = np.vectorize(math.erfc)(x)
    return fit_f32(x, np.log(erfc), erfc / (1 - erfc), list(range(9)))


def log_p() -> list[float]:
    """log(1+f) = f - f²/2 + f³·p(f) on f ∈ [√½-1, √2-1] (relative error of log(1+f))."""
    f = np.linspace((math.sqrt(0.5) - 1) * 1.01, (math.sqrt(2) - 1) * 1.01, 8001)
    f = f[np.abs(f) > 1e-4]
    return fit_f32(f, (np.log1p(f) - f + f * f / 2) / f**3, np.abs(f**3 / np.log1p(f)), list(range(8)))


TABLES: dict[str, Callable[[], list[float]]] = {
    "_EXP_Q": exp_q, "_TANH_P": tanh_p, "_ERF_P": erf_small, "_ERF_Q": erf_log_erfc, "_LOG_P": log_p,
}

if __name__ == "__main__":
    for name, fit in TABLES.items():
        print(f"{name} = ({', '.join(repr(c) for c in fit())})")
