"""Simplifier: each rewrite gives the expected expression *and* the same values as the
original on every input (exhaustively over small ranges, or on random and boundary points)."""

from __future__ import annotations

import itertools
import random

import pytest

from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    Binary,
    Buffer,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    Select,
    Store,
    Unary,
    add,
    c,
    lt,
    mul,
)
from sextant.kernel.printer import print_expr, print_kernel
from sextant.kernel.ranges import Undefined, children, eval_expr, free_names
from sextant.kernel.simplify import simplify_expr, simplify_kernel
from sextant.kernel.verifier import verify_kernel

from .samples import BID, BOOL, F32, I32, TID, b, block_sum, elementwise, f, run_kernel, tiled_matmul, v, warp_sum
from .test_ranges import random_box, random_int_expr

X, Y, Z = v("x"), v("y"), v("z")
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
Ranges_ = dict[str, tuple[int, int]]


def _grid(ranges: Ranges_, limit: int = 4000, seed: int = 0) -> list[dict[str, int]]:
    """Every point of the box if it is small, else its corners and random points."""
    names = sorted(ranges)
    size = 1
    for lo, hi in ranges.values():
        size *= hi - lo + 1
    if size <= limit:
        return [dict(zip(names, p)) for p in itertools.product(*(range(lo, hi + 1) for lo, hi in
                                                                  (ranges[n] for n in names)))]
    rng = random.Random(seed)
    edge = {n: sorted({p for p in (lo, lo + 1, 0, hi - 1, hi) if lo <= p <= hi}) for n, (lo, hi) in ranges.items()}
    pts = [dict(zip(names, p)) for p in itertools.product(*(edge[n] for n in names))]
    return pts + [{n: rng.randint(*ranges[n]) for n in names} for _ in range(limit)]


def assert_same_values(before: Expr, after: Expr, ranges: Ranges_, load=None, limit: int = 4000) -> int:
    """``after`` is defined and equal wherever ``before`` is defined; returns points checked."""
    n = 0
    for p in _grid(ranges, limit):
        try:
            want = eval_expr(before, p, load)
        except Undefined:
            continue
        assert eval_expr(after, p, load) == want, f"{print_expr(before)} -> {print_expr(after)} differ at {p}"
        n += 1
    return n


def well_typed(e: Expr) -> None:
    """The verifier's type rules hold for ``e`` (stored by a one-thread kernel)."""
    loads: dict[str, DType] = {}

    def find(x: Expr) -> None:
        if isinstance(x, Load):
            loads[x.buffer] = x.dtype
        for ch in children(x):
            find(ch)

    find(e)
    params = (Buffer("o", e.dtype, 1, role="out"), *(Buffer(n, dt, 1 << 20) for n, dt in loads.items()))
    k = Kernel("t", params, (1, 1, 1), (1, 1, 1), (Store("o", c(0), e),))
    verify_kernel(k, scalars=free_names(e))


def simp(e: Expr, ranges: Ranges_ | None = None) -> Expr:
    out = simplify_expr(e, {v(k): r for k, r in (ranges or {}).items()})
    assert out.dtype == e.dtype
    well_typed(out)
    return out


SMALL = {"x": (-20, 20), "y": (-20, 20)}
NONNEG = {"x": (0, 99), "y": (0, 63)}


@pytest.mark.parametrize(("expr", "ranges", "text"), [
    # folding with the graph ops' integer semantics
    (b("div", c(-7), c(2)), {}, "-3"),
    (b("fmod", c(-7), c(3)), {}, "-1"),
    (b("remainder", c(-7), c(3)), {}, "2"),
    (b("floordiv", c(-7), c(2)), {}, "-4"),
    (add(c(I32_MAX), c(1)), {}, str(I32_MIN)),  # wraps
    (b("shr", c(-16), c(2)), {}, "-4"),
    (b("div", c(5), c(0)), {}, "5 / 0"),  # undefined: left alone
    (b("shl", c(1), c(40)), {}, "1 << 40"),
    (Cast(c(300), DType.bool), {}, "true"),
    (Cast(Const(True, BOOL), I32), {}, "1"),
    # identities that hold for wrapping integers
    (add(X, c(0)), {}, "x"),
    (add(c(0), X), {}, "x"),
    (mul(X, c(1)), {}, "x"),
    (mul(X, c(0)), {}, "0"),
    (b("sub", X, X), {}, "0"),
    (add(X, X), {}, "x * 2"),
    (mul(mul(X, c(4)), c(8)), {}, "x * 32"),
    (add(add(X, c(3)), c(5)), {}, "x + 8"),
    (add(b("sub", X, c(3)), c(1)), {}, "x - 2"),
    (add(add(X, c(1)), add(Y, c(2))), {}, "x + y + 3"),
    (b("sub", add(X, c(5)), add(Y, c(2))), {}, "x - y + 3"),
    (b("bitwise_and", X, c(0)), {}, "0"),
    (b("bitwise_and", X, c(-1)), {}, "x"),
    (b("bitwise_or", X, c(0)), {}, "x"),
    (b("bitwise_xor", X, X), {}, "0"),
    (b("shl", X, c(0)), {}, "x"),
    (Unary("neg", Unary("neg", X, I32), I32), {}, "x"),
    (b("div", X, c(1)), {}, "x"),
    (b("fmod", X, c(1)), {}, "0"),
    (b("fmod", X, c(-8)), {}, "x % 8"),
    (b("shr", b("shr", X, c(2)), c(3)), {}, "x >> 5"),
    (b("fmod", b("fmod", X, c(64)), c(8)), {}, "x % 8"),
    (b("bitwise_and", add(mul(X, c(64)), Y), c(63)), {}, "y & 63"),  # low bits ignore multiples of 64
    (lt(c(3), X), {}, "x > 3"),  # constants go right
    # multiplications and divisions that need ranges (no overflow)
    (b("div", mul(X, c(4)), c(4)), {}, "x * 4 / 4"),  # x*4 may wrap: kept
    (b("div", mul(X, c(4)), c(4)), SMALL, "x"),
    (b("div", mul(X, c(12)), c(4)), SMALL, "x * 3"),
    (b("div", b("div", X, c(4)), c(8)), {}, "x / 32"),
    (b("div", add(mul(X, c(8)), Y), c(8)), {"x": (0, 99), "y": (0, 7)}, "x"),
    (b("fmod", add(mul(X, c(8)), Y), c(8)), {"x": (0, 99), "y": (0, 7)}, "y"),
    (b("div", add(mul(X, c(8)), Y), c(8)), {"x": (-5, 5), "y": (0, 7)}, "(x * 8 + y) / 8"),  # -8+1 rounds to 0
    (b("div", add(mul(X, c(8)), Y), c(8)), {"x": (-5, 0), "y": (-7, 0)}, "x"),  # same sign: fine
    (b("div", add(mul(X, c(256)), Y), c(64)), {"x": (0, 15), "y": (0, 255)}, "x * 4 + (y >> 6)"),
    (b("fmod", add(mul(X, c(256)), Y), c(64)), {"x": (0, 15), "y": (0, 255)}, "y & 63"),
    (b("shr", add(mul(X, c(16)), Y), c(4)), {"x": (-9, 9), "y": (-20, 20)}, "x + (y >> 4)"),  # floor: any sign
    (b("div", add(X, c(64)), c(64)), {"x": (0, 100)}, "(x >> 6) + 1"),
    # a common factor of the terms and the divisor, the constant below it: an unrolled 7x7 tap
    (b("div", add(mul(X, c(7)), c(3)), c(49)), {"x": (0, 20)}, "x / 7"),
    (b("div", add(mul(X, c(6)), mul(Y, c(4))), c(8)), {"x": (0, 9), "y": (0, 9)}, "x * 3 + y * 2 >> 2"),
    (b("div", add(mul(X, c(7)), c(7)), c(49)), {"x": (0, 20)}, "(x + 1) / 7"),  # split first: 7 | 7
    (b("div", add(mul(X, c(7)), c(3)), c(49)), {"x": (-3, 20)}, "(x * 7 + 3) / 49"),  # x < 0: kept
    (b("div", add(mul(X, c(7)), c(3)), c(49)), {}, "(x * 7 + 3) / 49"),  # may wrap: kept
    # ... and only when the parts and their sum cannot overflow
    (b("div", add(mul(X, c(8)), Y), c(8)), {"x": (2**27 - 4, 2**27 - 1), "y": (0, I32_MAX)}, "(x * 8 + y) / 8"),
    (b("fmod", add(mul(X, c(8)), Y), c(8)), {"x": (2**27 - 4, 2**27 - 1), "y": (0, I32_MAX)}, "(x * 8 + y) % 8"),
    (b("shr", add(mul(X, c(16)), Y), c(4)), {"x": (-(2**27), 0), "y": (-(2**31), 0)}, "x * 16 + y >> 4"),
    (b("div", mul(X, c(8)), c(8)), {"x": (2**28 - 2, 2**28)}, "x * 8 / 8"),  # 2^28 * 8 wraps
    (b("fmod", X, c(8)), {"x": (0, 7)}, "x"),
    (b("fmod", X, c(8)), {"x": (-7, 7)}, "x"),
    (b("div", X, c(8)), {"x": (-7, 7)}, "0"),
    (b("div", X, c(8)), {"x": (0, 99)}, "x >> 3"),  # strength reduction when x >= 0 ...
    (b("fmod", X, c(8)), {"x": (0, 99)}, "x & 7"),
    (b("div", X, c(8)), SMALL, "x / 8"),  # ... but not otherwise: -1 / 8 == 0, -1 >> 3 == -1
    (b("fmod", X, c(8)), SMALL, "x % 8"),
    (b("floordiv", X, c(8)), {"x": (0, 99)}, "x >> 3"),
    (b("remainder", X, c(8)), {"x": (0, 99)}, "x & 7"),
    (b("bitwise_and", X, c(63)), {"x": (0, 40)}, "x"),
    # comparisons, min/max, selects decided by ranges
    (lt(X, c(100)), NONNEG, "true"),
    (b("ge", X, c(100)), NONNEG, "false"),
    (lt(add(X, c(1)), c(10)), SMALL, "x < 9"),
    (lt(add(X, c(1)), c(10)), {}, "x + 1 < 10"),  # x + 1 may wrap
    (b("eq", X, X), {}, "true"),
    (b("minimum", X, c(200)), NONNEG, "x"),
    (b("maximum", X, c(0)), NONNEG, "x"),
    (b("minimum", X, Y), {"x": (0, 5), "y": (5, 9)}, "x"),
    (Select(lt(X, c(100)), X, c(0), I32), NONNEG, "x"),
    (Select(lt(X, c(0)), c(0), X, I32), NONNEG, "x"),
    (Select(lt(X, Y), X, X, I32), {}, "x"),
    (Select(lt(X, Y), Const(True, BOOL), Const(False, BOOL), BOOL), {}, "x < y"),
    (Select(lt(X, Y), Const(False, BOOL), Const(True, BOOL), BOOL), {}, "x >= y"),
    (Unary("logical_not", lt(X, Y), BOOL), {}, "x >= y"),
    (Unary("abs", X, I32), NONNEG, "x"),
    (Cast(Cast(X, DType.i64), I32), {}, "x"),
    (b("bitwise_and", lt(X, Y), Const(True, BOOL)), {}, "x < y"),
    (b("bitwise_or", lt(X, Y), Const(True, BOOL)), {}, "true"),
    (add(X, Y), {"x": (3, 3), "y": (0, 9)}, "y + 3"),  # a register with one possible value is a constant
    # quotient and remainder put back together: linearize(delinearize(x)) is x, for any x
    (add(mul(b("div", X, c(768)), c(768)), b("fmod", X, c(768))), {}, "x"),
    (add(b("fmod", X, c(768)), mul(b("div", X, c(768)), c(768))), {}, "x"),
    (add(add(mul(b("shr", X, c(8)), c(256)), b("bitwise_and", X, c(255))), c(3)), {}, "x + 3"),
    (add(add(Y, mul(b("div", X, c(7)), c(7))), b("fmod", X, c(7))), {}, "x + y"),
    (add(mul(b("div", X, c(8)), c(4)), b("fmod", X, c(8))), {}, "x / 8 * 4 + x % 8"),  # not the identity
])
def test_rewrites(expr: Expr, ranges: Ranges_, text: str) -> None:
    out = simp(expr, ranges)
    assert print_expr(out) == text
    box = {n: ranges.get(n, SMALL["x"]) for n in free_names(expr)}
    assert_same_values(expr, out, box)
    assert simp(out, ranges) == out  # idempotent


def test_identity_rewrites_hold_at_the_extremes() -> None:
    """Rewrites that need no ranges must be exact for wrapping values too."""
    extreme = {"x": (I32_MIN, I32_MIN + 50), "y": (I32_MAX - 50, I32_MAX)}
    for e in [add(add(X, c(3)), c(I32_MAX)), mul(mul(X, c(65536)), c(65536)), b("sub", add(X, c(5)), add(Y, c(2))),
              b("bitwise_and", add(mul(X, c(64)), Y), c(63)), b("fmod", b("fmod", X, c(64)), c(8)),
              b("div", b("div", X, c(4)), c(8)), b("shr", b("shr", Y, c(2)), c(3)), add(X, X),
              b("div", mul(X, c(4)), c(4)), lt(add(X, c(1)), c(10)),
              add(mul(b("div", X, c(12)), c(12)), b("fmod", X, c(12))),
              add(mul(b("shr", Y, c(5)), c(32)), b("bitwise_and", Y, c(31)))]:
        assert assert_same_values(e, simp(e), extreme) > 50


def test_floats_are_left_alone() -> None:
    a = v("a", F32)
    for e in [Binary("add", a, f(0), F32), Binary("mul", a, f(1), F32), Binary("sub", a, a, F32),
              Binary("add", f(1), f(2), F32), Binary("mul", Binary("mul", a, f(2), F32), f(4), F32),
              Binary("maximum", a, a, F32)]:
        assert simp(e) == e, print_expr(e)
    # bit-exact rewrites still apply
    assert simp(Unary("neg", Unary("neg", a, F32), F32)) == a
    assert simp(Cast(a, F32)) == a
    assert simp(Select(lt(X, c(10)), a, f(0), F32), {"x": (0, 5)}) == a
    assert simp(Cast(c(3), F32)) == Const(3.0, F32)
    assert simp(Cast(c(16777217), F32)) == Const(16777216.0, F32)  # exactly what the cast gives


def test_select_operands_are_not_simplified_under_its_condition() -> None:
    """The clamped load stays clamped: both sides of a select run on the GPU."""
    i = v("i")
    e = Select(lt(i, c(10)), Load("w", b("minimum", i, c(9)), F32), f(0), F32)
    assert simp(e, {"i": (0, 20)}) == e


def test_loads_are_kept_in_index_expressions() -> None:
    mem = {"idx": [3, -2, 7, 0]}
    load = lambda buf, k: mem[buf][k]
    e = b("div", add(mul(Load("idx", X, I32), c(4)), c(0)), c(4))
    out = simp(e, {"x": (0, 3)})
    assert print_expr(out) == "idx[x] * 4 / 4"  # idx[x] unbounded: could overflow
    assert_same_values(e, out, {"x": (0, 3)}, load)


# -- fuzzing: random expressions keep their values -------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_expressions_keep_their_values(seed: int) -> None:
    rng = random.Random(seed)
    changed = checked = 0
    for _ in range(150):
        ranges = {n: random_box(rng) for n in ("x", "y")}
        if rng.random() < 0.4:  # index-like: non-negative
            ranges = {n: (max(lo, 0), min(max(hi, 0) + 1, I32_MAX)) for n, (lo, hi) in ranges.items()}
        big = any(hi > 2**20 or lo < -(2**20) for lo, hi in ranges.values())
        e = random_int_expr(rng, ["x", "y"], 4, big)
        out = simp(e, ranges)
        changed += out != e
        box = {n: ranges[n] for n in free_names(e)}
        checked += assert_same_values(e, out, box, limit=200) if box else 0
    assert changed > 50 and checked > 5000


# -- kernels -----------------------------------------------------------------------------------
def test_guard_elided_when_the_launch_covers_n_exactly() -> None:
    k = simplify_kernel(elementwise(n=1024, block=256))
    assert print_kernel(k) == """\
kernel elementwise grid=(4,1,1) block=(256,1,1)
  (in f32 in0[1024], out f32 out0[1024])
{
  i = bid.x * 256 + tid.x
  out0[i] = exp(in0[i]) * 0.5f
}"""


def test_guard_kept_when_the_launch_overshoots() -> None:
    k = elementwise(n=1000, block=256)
    assert simplify_kernel(k).body == k.body


def test_always_false_guard_takes_the_else_branch() -> None:
    i = v("i")
    k = Kernel("k", (), (2, 1, 1), (32, 1, 1), (
        Assign(i, add(mul(BID, c(32)), TID)),
        If(b("ge", i, c(64)), (Store("never", i, f(0)),), (Store("always", i, f(1)),)),
    ))
    assert print_kernel(simplify_kernel(k)).splitlines()[-3:] == [
        "  i = bid.x * 32 + tid.x", "  always[i] = 1.0f", "}"]


def test_dead_and_empty_statements_go() -> None:
    j = v("j")
    k = Kernel("k", (), (1, 1, 1), (32, 1, 1), (
        For(j, c(5), c(5), 1, (Store("a", j, f(0)),)),  # no iteration
        For(j, c(0), c(8), 1, ()),  # no body
        If(lt(TID, c(3)), (), (Store("a", TID, f(0)),)),  # empty then: the condition flips
    ))
    assert print_kernel(simplify_kernel(k)).splitlines()[3:] == [
        "  if (tid.x >= 3) {", "    a[tid.x] = 0.0f", "  }", "}"]


def test_index_arithmetic_in_a_kernel_uses_loop_and_thread_ranges() -> None:
    r, j = v("r"), v("j")
    k = Kernel("k", (), (8, 1, 1), (64, 1, 1), (
        For(j, c(0), c(4), 1, (
            Assign(r, add(mul(BID, c(64)), TID)),
            Store("out", add(mul(b("div", r, c(16)), c(64)), add(mul(j, c(16)), b("fmod", r, c(16)))), f(0)),
        )),
    ))
    body = print_kernel(simplify_kernel(k)).splitlines()[4:6]
    assert body == ["    r = bid.x * 64 + tid.x", "    out[(r >> 4) * 64 + (j * 16 + (r & 15))] = 0.0f"]


def _random_memory(kernel: Kernel, seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    mem: dict[str, list] = {}
    for p in kernel.params:
        mem[p.name] = [float(rng.randint(-4, 4)) if p.dtype == F32 else 0 for _ in range(p.size)]
    return mem


@pytest.mark.parametrize("make", [
    lambda: elementwise(n=100, block=32),
    lambda: elementwise(n=128, block=32),
    lambda: block_sum(rows=2, length=70, block=32),
    lambda: warp_sum(rows=2, length=50, block=64),
    lambda: tiled_matmul(m=8, n=16, k=16, tile=8),
])
def test_simplified_kernels_compute_the_same(make) -> None:
    kernel = make()
    mem = _random_memory(kernel, 0)
    assert run_kernel(simplify_kernel(kernel), mem) == run_kernel(kernel, mem)


def test_simplified_kernel_semantics_with_guards_and_index_math() -> None:
    """A kernel full of simplifiable index math and guards, run before and after."""
    i, row, col = v("i"), v("row"), v("col")
    n_rows, n_cols = 6, 16
    k = Kernel("k", (Buffer("x", I32, n_rows * n_cols), Buffer("y", I32, n_rows * n_cols, role="out")),
                (3, 1, 1), (32, 1, 1), (
        Assign(i, add(mul(BID, c(32)), TID)),
        Assign(row, b("div", i, c(n_cols))),
        Assign(col, b("fmod", i, c(n_cols))),
        If(b("bitwise_and", lt(row, c(n_rows)), b("ge", i, c(0))), (
            Store("y", add(mul(row, c(n_cols)), b("sub", c(n_cols - 1), col)),
                  Select(lt(col, c(n_cols)), Load("x", add(mul(row, c(n_cols)), col), I32), c(-1), I32)),
        )),
    ))
    out = simplify_kernel(k)
    text = print_kernel(out)
    assert "if" not in text and "i >> 4" in text and "i & 15" in text and "?" not in text
    mem = {"x": list(range(100, 196)), "y": [0] * 96}
    assert run_kernel(out, mem) == run_kernel(k, mem)
