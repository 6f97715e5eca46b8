"""Kernels over symbolic sizes: sizes as scalar arguments, and instances at given sizes.

A kernel of a program with symbolic sizes (``sextant.compile(..., dynamic_shapes=...)``) reads
each size it needs as a scalar ``i32`` argument (``Kernel.sizes``; register ``n_<name>`` in the
body), so one compiled kernel serves every size in the declared ranges. Index arithmetic over a
size is an ordinary expression over that register (:func:`dim_expr`); a launch grid over sizes is
kept in ``meta["grid"]`` and evaluated per call (:func:`with_grid`, :func:`launch_blocks`), and the
kernel's ``grid`` is its capacity: the grid at the sizes' upper bounds.

:func:`instantiate` substitutes values for the sizes — a static kernel, which the verifier checks
exactly (a symbolic kernel is verified at a few instances; see :func:`verification_points`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import sympy

from sextant.graph.symbolic import Bounds, Dim, SymbolicShapeError, SymDim, substitute
from sextant.kernel.ir import (
    INDEX,
    SIZE_PREFIX,
    Binary,
    Const,
    Expr,
    Kernel,
    Size,
    Var,
    size_var,
)

MAX_BLOCKS = 2**31 - 1  # a launch's block index is an i32


def dim_expr(d: Dim) -> Expr:
    """A dimension as an index expression: a constant, or arithmetic over size registers."""
    if isinstance(d, SymDim):
        return _sympy_expr(d.expr)
    return Const(int(d), INDEX)


@functools.lru_cache(maxsize=4096)
def _sympy_expr(e: sympy.Expr) -> Expr:
    if e.is_Integer:
        return Const(int(e), INDEX)
    if e.is_Symbol:
        return size_var(e.name)
    if e.is_Mul and len(e.args) == 2 and e.args[0] == -1 and isinstance(e.args[1], sympy.floor):
        return _sympy_expr(sympy.ceiling(-e.args[1].args[0]))  # -floor(-x) = ceil(x): one division, not three
    if e.is_Add or e.is_Mul:
        op = "add" if e.is_Add else "mul"
        terms = sorted(e.args, key=lambda t: (t.is_number, str(t)))  # constants last: ``n*4 + 1``
        out = _sympy_expr(terms[0])
        for t in terms[1:]:
            out = Binary(op, out, _sympy_expr(t), INDEX)
        return out
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        base = _sympy_expr(e.base)
        out = base
        for _ in range(int(e.exp) - 1):
            out = Binary("mul", out, base, INDEX)
        return out
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        num = sympy.expand(num)
        if den.is_Integer and int(den) > 0:
            if isinstance(e, sympy.ceiling):  # ceil(p/q) = floor((p + q - 1)/q)
                num = num + int(den) - 1
            # the IR's ``div`` truncates (C); it is floor division for a numerator that cannot be negative
            return Binary("div" if _nonnegative(num) else "floordiv", _sympy_expr(num), Const(int(den), INDEX),
                          INDEX)
    if isinstance(e, sympy.Mod) and e.args[1].is_Integer and int(e.args[1]) > 0:
        a = sympy.expand(e.args[0])  # sympy's Mod is Python's (floor) remainder; ``fmod`` is C's
        return Binary("fmod" if _nonnegative(a) else "remainder", _sympy_expr(a), Const(int(e.args[1]), INDEX),
                      INDEX)
    raise SymbolicShapeError(f"size {e} has no index expression (integer polynomials, floor division "
                             "and remainders by constants only)")


def _nonnegative(p: sympy.Expr) -> bool:
    """Whether a polynomial over sizes (never negative) is never negative: all its coefficients are."""
    if not p.free_symbols:
        return bool(p >= 0)
    if not p.is_polynomial():
        return False
    return all(k >= 0 for k in sympy.Poly(p, *sorted(p.free_symbols, key=str)).coeffs())


def capacity(d: Dim) -> int:
    """The largest value ``d`` takes in its declared ranges, for a grid's or buffer's capacity."""
    if isinstance(d, SymDim):
        hi = d.range()[1]
        return int(min(hi, MAX_BLOCKS))
    return int(d)


def with_grid(kernel: Kernel, grid: tuple[Dim, Dim, Dim]) -> Kernel:
    """``kernel`` launched on ``grid`` (a static extent of at least one block: a launch is never
    empty); symbolic extents are kept in ``meta["grid"]`` (evaluated per launch: the SIMT CPU lowering
    recovers a block's coordinates from them, the GPU reads ``nctaid``) and the kernel's grid is
    their capacity."""
    if not any(isinstance(g, SymDim) for g in grid):
        return dataclasses.replace(kernel, grid=tuple(max(1, int(g)) for g in grid))
    k = dataclasses.replace(kernel, grid=tuple(max(1, capacity(g)) for g in grid))
    k.meta["grid"] = tuple(grid)
    return k


def launch_blocks(kernel: Kernel) -> Dim:
    """How many blocks a launch of ``kernel`` runs: a ``SymDim`` for a symbolic grid."""
    gx, gy, gz = kernel.meta.get("grid", kernel.grid)
    return gx * gy * gz


# -- which sizes a kernel reads ---------------------------------------------------------------------
def _walk(node: Any, out: set[str], seen: set[int]) -> None:
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, tuple):
            stack.extend(x)
        elif isinstance(x, Var):
            if x.name.startswith(SIZE_PREFIX):
                out.add(x.name[len(SIZE_PREFIX):])
        elif isinstance(x, SymDim):
            out.update(x.names)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            if id(x) in seen:
                continue
            seen.add(id(x))
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))


def with_sizes(kernel: Kernel, bounds: Bounds) -> Kernel:
    """``kernel`` taking as arguments the symbols of ``bounds`` it reads (in name order)."""
    used: set[str] = set()
    _walk((kernel.params, kernel.body, kernel.meta.get("grid", ())), used, set())
    sizes = tuple(Size(n, lo, hi) for n, lo, hi in bounds if n in used)
    unknown = used - {n for n, _, _ in bounds}
    if unknown:
        raise SymbolicShapeError(f"kernel {kernel.name} reads undeclared size(s) {', '.join(sorted(unknown))}")
    if not sizes:
        return kernel
    return dataclasses.replace(kernel, sizes=sizes)


# -- instances --------------------------------------------------------------------------------------
def instantiate(kernel: Kernel, values: Mapping[str, int]) -> Kernel:
    """The static kernel ``kernel`` is at these sizes: size registers become constants, buffer sizes
    and the grid are evaluated."""
    if not kernel.sizes:
        return kernel
    consts = {SIZE_PREFIX + s.name: Const(int(values[s.name]), INDEX) for s in kernel.sizes}
    memo: dict[int, Any] = {}

    def sub(x: Any) -> Any:
        if isinstance(x, tuple):
            return tuple(sub(v) for v in x)
        if isinstance(x, Var):
            return consts.get(x.name, x)
        if not dataclasses.is_dataclass(x) or isinstance(x, type):
            return x
        hit = memo.get(id(x))
        if hit is not None:
            return hit
        changes = {}
        for f in dataclasses.fields(x):
            v = getattr(x, f.name)
            w = sub(v)
            if w is not v:
                changes[f.name] = w
        out = dataclasses.replace(x, **changes) if changes else x
        memo[id(x)] = out
        return out

    params = tuple(dataclasses.replace(b, size=b.size.subs(values)) if isinstance(b.size, SymDim) else b
                   for b in kernel.params)
    grid = tuple(max(1, substitute(g, values)) for g in kernel.meta.get("grid", kernel.grid))
    meta = {k: v for k, v in kernel.meta.items() if k != "grid"}
    return Kernel(kernel.name, params, grid, kernel.block, sub(kernel.body), kernel.shared, kernel.local, meta)


def instantiate_launch(kernel: Kernel, values: Mapping[str, int]) -> Kernel:
    """``kernel``'s launch at these sizes: its grid and buffer sizes evaluated, its body and size
    parameters kept (the compiled code is the symbolic kernel's; a launch passes the sizes)."""
    if not kernel.sizes:
        return kernel
    static = instantiate(dataclasses.replace(kernel, body=()), values)
    return dataclasses.replace(kernel, params=static.params, grid=static.grid, meta=static.meta)


def verification_points(sizes: Iterable[Size]) -> list[dict[str, int]]:
    """Sizes a symbolic kernel is verified at: every size at its least value (at least 1), and every
    size at a ragged value above it (7 past a multiple of 64 where the range allows, so tile tails and partial
    blocks are exercised); each instance is checked exactly, index by index."""
    sizes = list(sizes)
    low = {s.name: min(s.hi, max(s.lo, 1)) for s in sizes}  # a size of 0 launches nothing to check
    ragged = {s.name: min(s.hi, max(s.lo, 64 * (s.lo // 64 + 1) + 7)) for s in sizes}
    return [low] if ragged == low else [low, ragged]


def check_binding(sizes: Iterable[Size], values: Mapping[str, int], what: str) -> None:
    """Raise naming the size when a value is outside its declared range."""
    for s in sizes:
        v = values.get(s.name)
        if v is None or not s.lo <= v <= s.hi:
            raise SymbolicShapeError(f"{what}: size {s.name}={v} is outside its declared range [{s.lo}, {s.hi}]")

