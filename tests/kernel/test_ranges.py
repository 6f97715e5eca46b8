"""Range analysis: exact cases, soundness on random expressions, facts through a kernel, and
the evaluator's agreement with the graph IR's reference semantics."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from sextant.graph.dtypes import DType
from sextant.graph.reference import _BINARY, _UNARY
from sextant.kernel.flow import MAX_REGISTER_WALKS
from sextant.kernel.ir import (
    Assign,
    Binary,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    Select,
    Special,
    Stmt,
    Store,
    Unary,
    Var,
    WarpReduce,
    add,
    c,
    lt,
    mul,
)
from sextant.kernel.ranges import (
    Env,
    Ranges,
    Undefined,
    Unknown,
    bounds,
    eval_expr,
    int_range,
    loop_range,
    refine,
    register_ranges,
    special_ranges,
)
from sextant.work import WorkCounter

from .samples import BID, BOOL, F32, I32, TID, b, elementwise, f, v

X, Y = v("x"), v("y")
I32_MAX = 2**31 - 1


@pytest.mark.parametrize(("expr", "env", "expected"), [
    (c(5), {}, (5, 5)),
    (Const(True, BOOL), {}, (1, 1)),
    (add(mul(BID, c(256)), TID), {BID: (0, 15), TID: (0, 255)}, (0, 4095)),
    (b("sub", X, Y), {X: (0, 10), Y: (-3, 4)}, (-4, 13)),
    (mul(X, Y), {X: (-2, 3), Y: (-5, 4)}, (-15, 12)),
    (b("div", X, c(4)), {X: (-9, 9)}, (-2, 2)),  # truncating
    (b("div", X, Y), {X: (10, 20), Y: (-5, -2)}, (-10, -2)),
    (b("floordiv", X, c(4)), {X: (-9, 9)}, (-3, 2)),
    (b("fmod", X, c(8)), {X: (0, 100)}, (0, 7)),
    (b("fmod", X, c(8)), {X: (-100, 3)}, (-7, 3)),
    (b("fmod", X, c(8)), {X: (2, 5)}, (2, 5)),
    (b("fmod", X, c(8)), {}, (-7, 7)),  # unknown dividend: still bounded by the divisor
    (b("remainder", X, c(8)), {X: (-100, 3)}, (0, 7)),
    (b("minimum", X, c(7)), {X: (0, 100)}, (0, 7)),
    (b("maximum", X, c(0)), {X: (-5, 100)}, (0, 100)),
    (b("shl", X, c(3)), {X: (-1, 2)}, (-8, 16)),
    (b("shr", X, c(2)), {X: (-9, 9)}, (-3, 2)),  # arithmetic shift = floor
    (b("shr", c(64), Y), {Y: (0, 6)}, (1, 64)),
    (b("bitwise_and", X, c(255)), {}, (0, 255)),
    (b("bitwise_or", X, Y), {X: (4, 5), Y: (0, 8)}, (4, 15)),
    (Unary("neg", X, I32), {X: (-3, 7)}, (-7, 3)),
    (Unary("abs", X, I32), {X: (-3, 7)}, (0, 7)),
    (Cast(X, DType.i64), {X: (-3, 7)}, (-3, 7)),
    (Cast(lt(X, Y), I32), {}, (0, 1)),
    (Select(lt(X, c(0)), c(0), X, I32), {X: (-5, 9)}, (0, 9)),  # branches see the condition
    (Select(b("ge", X, c(1)), b("sub", X, c(1)), c(0), I32), {X: (0, 9)}, (0, 8)),
    (lt(X, c(10)), {X: (0, 9)}, (1, 1)),
    (b("ge", X, c(10)), {X: (0, 9)}, (0, 0)),
    (b("eq", X, Y), {X: (0, 3), Y: (5, 6)}, (0, 0)),
    (lt(X, Y), {X: (0, 5), Y: (5, 6)}, (0, 1)),
])
def test_bounds(expr: Expr, env: dict, expected: tuple[int, int]) -> None:
    assert bounds(expr, env) == expected


@pytest.mark.parametrize(("expr", "env"), [
    (X, {}),  # unknown register
    (mul(X, c(1 << 20)), {X: (0, 1 << 12)}),  # may overflow i32: no interval (it could wrap)
    (add(X, c(1)), {X: (0, I32_MAX)}),
    (b("div", X, Y), {X: (1, 5), Y: (-1, 1)}),  # divisor may be 0
    (b("shl", X, Y), {X: (0, 1), Y: (0, 40)}),  # shift amount may be too large
    (Load("buf", X, I32), {X: (0, 3)}),
    (b("add", f(1), f(2)), {}),  # floats are not analysed
    (Cast(f(2.5), I32), {}),
])
def test_bounds_unknown(expr: Expr, env: dict) -> None:
    assert bounds(expr, env) is None


def test_bounds_specials_and_env_of_kernel() -> None:
    k = Kernel("k", (), (16, 2, 1), (128, 1, 1), ())
    env = Ranges.for_kernel(k).entry()
    assert bounds(TID, env) == (0, 127)
    assert bounds(Special("bid", "y"), env) == (0, 1)
    assert bounds(Special("tid", "z"), env) == (0, 0)
    assert bounds(Special("bdim", "x"), env) == (128, 128)
    assert bounds(add(mul(BID, Special("bdim", "x")), TID), env) == (0, 2047)


# -- soundness: every value a random expression takes lies in its interval ---------------------
_INT_OPS = ["add", "sub", "mul", "div", "floordiv", "fmod", "remainder", "minimum", "maximum",
            "shl", "shr", "bitwise_and", "bitwise_or", "bitwise_xor"]


def random_int_expr(rng: random.Random, names: list[str], depth: int, big: bool = False) -> Expr:
    """A random i32 expression (also used by the simplifier tests)."""
    r = rng.random()
    if depth == 0 or r < 0.15:
        if rng.random() < 0.6:
            return v(rng.choice(names))
        k = rng.choice([0, 1, 2, 3, 4, 7, 8, 16, 32, 64, 100, -1, -4])
        return c(rng.choice([k, 2**30, -(2**31), I32_MAX]) if big and rng.random() < 0.1 else k)
    if r < 0.25:
        cond = Binary(rng.choice(["lt", "le", "gt", "ge", "eq", "ne"]), random_int_expr(rng, names, depth - 1, big),
                      random_int_expr(rng, names, depth - 1, big), BOOL)
        return Select(cond, random_int_expr(rng, names, depth - 1, big), random_int_expr(rng, names, depth - 1, big),
                      I32)
    if r < 0.3:
        return Unary(rng.choice(["neg", "abs", "bitwise_not"]), random_int_expr(rng, names, depth - 1, big), I32)
    op = rng.choice(_INT_OPS + ["add", "mul", "div", "fmod"])
    rhs = c(rng.randint(0, 6)) if op in ("shl", "shr") and rng.random() < 0.8 else \
        random_int_expr(rng, names, depth - 1, big)
    return Binary(op, random_int_expr(rng, names, depth - 1, big), rhs, I32)


def random_box(rng: random.Random) -> tuple[int, int]:
    """A random interval: small, or wide, or hugging one end of the i32 range (where sums and
    products overflow)."""
    kind = rng.choice(["small", "small", "wide", "top", "bottom"])
    if kind == "small":
        lo, hi = sorted((rng.randint(-50, 50), rng.randint(-50, 50)))
    elif kind == "wide":
        lo, hi = sorted((rng.randint(-(2**30), 2**30), rng.randint(-(2**30), 2**30)))
    elif kind == "top":
        lo, hi = I32_MAX - rng.randint(0, 2**30), I32_MAX - rng.randint(0, 8)
    else:
        lo, hi = -(2**31) + rng.randint(0, 8), -(2**31) + rng.randint(0, 2**30)
    return (min(lo, hi), max(lo, hi))


def _points(ranges: dict[str, tuple[int, int]], rng: random.Random, n: int) -> list[dict[str, int]]:
    def pick(lo: int, hi: int) -> int:
        return rng.choice([lo, hi, rng.randint(lo, hi)])
    return [{k: pick(*r) for k, r in ranges.items()} for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_bounds_are_sound_on_random_expressions(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for _ in range(300):
        ranges = {n: random_box(rng) for n in ("x", "y", "z")}
        big = any(hi > 2**20 or lo < -(2**20) for lo, hi in ranges.values())
        e = random_int_expr(rng, ["x", "y", "z"], 4, big)
        iv = bounds(e, {v(n): r for n, r in ranges.items()})
        if iv is None:
            continue
        for p in _points(ranges, rng, 40):
            try:
                val = eval_expr(e, p)
            except Undefined:
                continue
            assert iv[0] <= val <= iv[1], (e, p, iv, val)
            checked += 1
    assert checked > 1000


# -- refinement by conditions --------------------------------------------------------------------
def test_refine_guard() -> None:
    i = v("i")
    env = Env({i: (0, 4351)})
    then = refine(env, lt(i, c(4096)), True)
    assert then is not None and bounds(i, then) == (0, 4095)
    other = refine(env, lt(i, c(4096)), False)
    assert other is not None and bounds(i, other) == (4096, 4351)


def test_refine_compound_and_conjunction() -> None:
    env = {BID: (0, 16), TID: (0, 255)}
    i = add(mul(BID, c(256)), TID)
    r = refine(env, lt(i, c(4096)), True)
    assert r is not None
    assert bounds(i, r) == (0, 4095)
    assert bounds(BID, r) == (0, 15)  # pushed into the operands of the (non-wrapping) sum
    both = refine({X: (-10, 10)}, b("bitwise_and", b("ge", X, c(0)), lt(X, c(4))), True)
    assert both is not None and bounds(X, both) == (0, 3)
    neither = refine({X: (-10, 10)}, Unary("logical_not", b("bitwise_or", lt(X, c(0)), b("gt", X, c(3))), BOOL), True)
    assert neither is not None and bounds(X, neither) == (0, 3)


def test_refine_unknown_register_gets_half_bounded() -> None:
    r = refine({}, lt(X, c(10)), True)
    assert r is not None and bounds(X, r) == (int_range(I32)[0], 9)


def test_refine_contradiction_is_unreachable() -> None:
    assert refine({X: (0, 9)}, b("ge", X, c(10)), True) is None
    assert refine({X: (0, 9)}, lt(X, c(10)), False) is None
    assert refine({}, b("bitwise_and", lt(X, c(0)), b("gt", X, c(5))), True) is None


def test_refine_ne_excludes_endpoint() -> None:
    r = refine({X: (0, 9)}, b("ne", X, c(0)), True)
    assert r is not None and bounds(X, r) == (1, 9)


def test_refine_through_bool_register_definition() -> None:
    """``ok = (x >= 0) & (x < 8); y = ok ? x : 0``: the definition of ``ok`` refines ``x``."""
    ok = v("ok", BOOL)
    ranges = Ranges({X: (-5, 20)})
    env = ranges.assign(ranges.entry(), ok, b("bitwise_and", b("ge", X, c(0)), lt(X, c(8))))
    assert bounds(Select(ok, X, c(0), I32), env) == (0, 7)


# -- facts through a kernel ------------------------------------------------------------------------
def _visit_all(kernel: Kernel) -> dict[str, Env]:
    """Facts before each ``Store``, keyed by the buffer stored to."""
    ranges = Ranges.for_kernel(kernel)
    seen: dict[str, Env] = {}

    def visit(s: Stmt, env: Env) -> None:
        if isinstance(s, Store):
            seen[s.buffer] = env.copy()  # the walk updates env in place

    ranges.walk(kernel.body, ranges.entry(), visit)
    return seen


def _kernel(*body: Stmt, grid: int = 4, block: int = 64) -> Kernel:
    return Kernel("k", (), (grid, 1, 1), (block, 1, 1), body)


def test_loop_variable_ranges() -> None:
    k, j = v("k"), v("j")
    assert loop_range(For(k, c(0), c(64), 16, ()), {}) == (0, 48)
    assert loop_range(For(k, c(10), c(0), -3, ()), {}) == (1, 10)
    assert loop_range(For(k, c(5), c(5), 1, ()), {}) is False
    assert loop_range(For(k, TID, c(300), 64, ()), {TID: (0, 63)}) == (0, 299)
    # a tile from a variable origin: at most the tile's last step past the origin's maximum
    origin = mul(BID, c(128))
    assert loop_range(For(k, origin, add(origin, c(128)), 8, ()), {BID: (0, 3)}) == (0, 504)
    assert loop_range(For(k, c(0), X, 1, ()), {}) is None
    assert loop_range(For(k, c(0), X, 1, (Assign(X, c(3)),)), {X: (1, 5)}) is None  # body moves the bound
    kern = _kernel(For(k, c(0), c(8), 1, (For(j, k, c(8), 2, (Store("a", add(mul(k, c(8)), j), f(0)),)),)))
    env = _visit_all(kern)["a"]
    assert bounds(k, env) == (0, 7)
    assert bounds(j, env) == (0, 7)
    assert bounds(add(mul(k, c(8)), j), env) == (0, 63)


def test_registers_from_assignments() -> None:
    i, n, acc = v("i"), v("n"), v("acc")
    kern = _kernel(
        Assign(i, add(mul(BID, c(64)), TID)),
        Assign(n, c(3)),
        If(lt(TID, c(5)), (Assign(n, c(10)),)),
        Assign(acc, c(0)),
        For(v("k"), c(0), c(8), 1, (Assign(acc, add(acc, c(1))),)),
        Store("a", i, f(0)),
    )
    env = _visit_all(kern)["a"]
    assert bounds(i, env) == (0, 255)
    assert bounds(n, env) == (3, 10)  # either branch
    assert bounds(acc, env) is None  # feeds itself: not bounded by its first value
    base = Ranges.for_kernel(kern).base
    assert base[i] == (0, 255) and base[n] == (3, 10) and acc not in base


def test_register_ranges_walk_again_where_a_new_bound_was_missing() -> None:
    # after the loop, ``a`` is known only from its register range: the first walk bounds ``a`` but
    # not ``b``; the second (needed because the first looked ``a`` up after the loop and missed)
    # bounds ``b`` — and a third, which could find nothing new, is not run
    a, b_, k = v("a"), v("b"), v("k")
    kern = _kernel(For(k, c(0), c(8), 1, (Assign(a, add(k, c(1))),)), Assign(b_, add(a, c(1))))
    work = WorkCounter()
    resolved = register_ranges(kern, special_ranges(kern), work)
    assert resolved == {a: (1, 8), b_: (2, 9)}
    assert work.counts["ranges: register walks"] == 2


def test_register_ranges_walks_at_most_a_bounded_number_of_times() -> None:
    """A chain of loops, each reading the register the one before it assigned: every link needs one
    more walk to bound. The walks stop at ``MAX_REGISTER_WALKS`` (the rest stay unknown: sound)."""
    k = v("k")
    regs = [v(f"a{i}") for i in range(6)]
    body: list[Stmt] = [For(k, c(0), c(8), 1, (Assign(regs[0], add(k, c(1))),))]
    for i in range(1, 6):
        body.append(For(v(f"k{i}"), c(0), c(2), 1, (Assign(regs[i], add(regs[i - 1], c(1))),)))
    kern = _kernel(*body)
    work = WorkCounter()
    resolved = register_ranges(kern, special_ranges(kern), work)
    assert work.counts["ranges: register walks"] == MAX_REGISTER_WALKS
    assert resolved == {regs[i]: (1 + i, 8 + i) for i in range(MAX_REGISTER_WALKS)}


def test_guard_facts_apply_inside_and_are_dropped_on_reassignment() -> None:
    i = v("i")
    kern = _kernel(
        Assign(i, add(mul(BID, c(64)), TID)),
        If(lt(i, c(200)), (
            Store("inside", i, f(0)),
            Assign(i, add(i, c(100))),
            Store("after", i, f(0)),
        )),
        Store("outside", i, f(0)),
    )
    seen = _visit_all(kern)
    assert bounds(i, seen["inside"]) == (0, 199)
    assert bounds(i, seen["after"]) == (100, 299)  # recomputed from the new value
    assert bounds(i, seen["outside"]) == (100, 299)  # i + 100 from [0, 199], or i from [200, 255]


def test_guard_inside_loop_does_not_leak_to_next_iteration() -> None:
    r = v("r")
    kern = _kernel(
        Assign(r, c(0)),
        If(lt(r, c(10)), (
            For(v("k"), c(0), c(100), 1, (Store("a", r, f(0)), Assign(r, add(r, c(5))))),
        )),
    )
    env = _visit_all(kern)["a"]
    assert bounds(r, env) is None  # r grows across iterations: the guard says nothing about it


def test_warp_reduce_bounds() -> None:
    s, m = v("s"), v("m")
    kern = _kernel(WarpReduce(s, "sum", b("fmod", TID, c(4)), 32), WarpReduce(m, "max", TID, 32),
                   Store("a", c(0), f(0)))
    env = _visit_all(kern)["a"]
    assert bounds(s, env) == (0, 96)
    assert bounds(m, env) == (0, 63)


def test_unreachable_branch_is_skipped() -> None:
    i = v("i")
    kern = _kernel(Assign(i, TID), If(b("ge", i, c(1000)), (Store("dead", i, f(0)),)), Store("live", i, f(0)))
    seen = _visit_all(kern)
    assert "dead" not in seen and "live" in seen


def test_elementwise_guard_bounds_index() -> None:
    seen = _visit_all(elementwise(n=1000))
    assert bounds(v("i"), seen["out0"]) == (0, 999)


# -- the evaluator agrees with the graph IR's reference (torch) -----------------------------------
_VALUES = [0, 1, -1, 2, -2, 3, 7, -7, 31, 32, 100, -100, 2**31 - 1, -(2**31), 2**30]


def _torch(op: str, dtype: DType, *args: int) -> object:
    ts = [torch.tensor(a, dtype=dtype.torch) for a in args]
    fn = _BINARY[op] if len(ts) == 2 else _UNARY[op]
    return fn(*ts).item()


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "floordiv", "fmod", "remainder", "maximum", "minimum",
                                "bitwise_and", "bitwise_or", "bitwise_xor", "shl", "shr", "lt", "le", "eq", "ne"])
@pytest.mark.parametrize("dtype", [DType.i32, DType.i64])
def test_eval_int_binary_matches_reference(op: str, dtype: DType) -> None:
    for a, bb in itertools.product(_VALUES, repeat=2):
        e = Binary(op, Const(a, dtype), Const(bb, dtype), BOOL if op in ("lt", "le", "eq", "ne") else dtype)
        try:
            got = eval_expr(e)
        except Undefined:
            assert (op in ("div", "floordiv", "fmod", "remainder") and (bb == 0 or bb == -1)) or \
                (op in ("shl", "shr") and not 0 <= bb < 8 * dtype.itemsize)
            continue
        assert got == _torch(op, dtype, a, bb), (op, a, bb)


@pytest.mark.parametrize("op", ["neg", "abs", "sign", "bitwise_not"])
def test_eval_int_unary_matches_reference(op: str) -> None:
    for a in _VALUES:
        assert eval_expr(Unary(op, Const(a, I32), I32)) == _torch(op, I32, a)


def test_eval_floats_round_to_their_dtype() -> None:
    third = eval_expr(Binary("div", Const(1.0, DType.f16), Const(3.0, DType.f16), DType.f16))
    assert third == torch.tensor(1 / 3, dtype=torch.float16).item()
    assert eval_expr(Cast(Const(16777217, I32), F32)) == 16777216.0
    assert eval_expr(Cast(Const(-2.7, F32), I32)) == -2
    with pytest.raises(Undefined):
        eval_expr(Cast(Const(3e9, F32), I32))


def test_eval_select_loads_and_unknowns() -> None:
    mem = {"w": [10, 20, 30]}
    e = Select(lt(X, c(3)), Load("w", b("minimum", X, c(2)), I32), c(-1), I32)
    assert eval_expr(e, {"x": 1}, lambda buf, i: mem[buf][i]) == 20
    assert eval_expr(e, {"x": 7}, lambda buf, i: mem[buf][i]) == -1
    assert eval_expr(add(TID, c(1)), {"tid.x": 4}) == 5
    with pytest.raises(Unknown):
        eval_expr(add(X, c(1)))
    with pytest.raises(Undefined):  # both operands of a select are computed
        eval_expr(Select(Const(True, BOOL), c(1), b("div", c(1), c(0)), I32))
    assert eval_expr(Var("flag", BOOL), {"flag": True}) is True
