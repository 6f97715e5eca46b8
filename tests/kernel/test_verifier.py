"""Verifier: typical kernels pass; each rule has a kernel that breaks it and a message that
names the kernel, the statement and the problem."""

from __future__ import annotations

import re

import pytest

from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    Barrier,
    Binary,
    Buffer,
    Cast,
    Const,
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
from sextant.kernel.simplify import simplify_kernel
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

from .samples import BID, BOOL, F32, I32, TID, TIDY, b, block_sum, elementwise, f, tiled_matmul, v, warp_sum

IV = v("i")
GUARDED = (Assign(IV, add(mul(BID, c(64)), TID)),)


def kernel(*body: Stmt, grid=(4, 1, 1), block=(64, 1, 1), n: int = 256, shared=(), local=(), **kw) -> Kernel:
    params = (Buffer("x", F32, n), Buffer("idx", I32, n), Buffer("y", F32, n, role="out"),
              Buffer("acc", F32, n, role="inout"))
    return Kernel(kw.pop("name", "k"), params, grid, block, body, shared=shared, local=local)


def fails(k: Kernel, pattern: str, **kw) -> str:
    with pytest.raises(KernelVerificationError) as info:
        verify_kernel(k, **kw)
    msg = str(info.value)
    assert msg.startswith(f"kernel {k.name} is invalid")
    assert re.search(pattern, msg), msg
    return msg


# -- valid kernels -----------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: elementwise(n=1000),
    lambda: elementwise(n=1024),
    lambda: block_sum(),
    lambda: block_sum(rows=5, length=1000, block=256),
    lambda: warp_sum(),
    lambda: tiled_matmul(),
    lambda: tiled_matmul(m=64, n=32, k=48, tile=16),
])
def test_typical_kernels_pass(make) -> None:
    k = make()
    verify_kernel(k)
    verify_kernel(simplify_kernel(k))


def test_clamped_and_selected_accesses_pass() -> None:
    """Patterns the schedules emit to stay in bounds without an ``If``."""
    j, ok, g = v("j"), v("ok", BOOL), v("g")
    k = kernel(
        *GUARDED,
        Assign(ok, b("bitwise_and", b("ge", b("sub", IV, c(1)), c(0)), lt(b("sub", IV, c(1)), c(256)))),
        Assign(j, Select(ok, b("sub", IV, c(1)), c(0), I32)),  # a padded read: index clamped to 0
        Assign(g, b("minimum", b("maximum", Load("idx", IV, I32), c(0)), c(255))),  # a gather
        Store("y", IV, b("add", Load("x", j, F32), Load("x", g, F32))),
    )
    verify_kernel(k)


def test_correlated_index_the_analysis_cannot_bound_passes() -> None:
    """``i - (i/64)*64`` is in bounds although intervals alone cannot show it: no witness, no error."""
    k = kernel(*GUARDED, Store("y", b("sub", IV, mul(b("div", IV, c(64)), c(64))), f(0)))
    verify_kernel(k)


def test_index_searched_again_once_a_register_it_reads_changes() -> None:
    """A fruitless search is not repeated for the same index later in the block — unless a register
    the index reads was assigned in between."""
    m = v("m")
    idx = add(b("sub", IV, mul(b("div", IV, c(64)), c(64))), m)  # i % 64 + m: intervals cannot bound it
    same = (*GUARDED, Assign(m, c(0)), Store("y", idx, f(0)), Store("acc", idx, f(0)))
    verify_kernel(kernel(*same))
    fails(kernel(*same, Assign(m, c(200)), Store("acc", idx, f(1))),
          r"store to acc\[i - i / 64 \* 64 \+ m\] is out of bounds: index 25[6-9]")


def test_data_dependent_index_passes() -> None:
    verify_kernel(kernel(*GUARDED, Store("y", IV, Load("x", Load("idx", IV, I32), F32))))


def test_scalar_arguments_count_as_assigned() -> None:
    n = v("n")
    k = kernel(*GUARDED, If(lt(IV, n), (Store("y", IV, f(0)),)))
    fails(k, "reads register n before it is assigned")
    verify_kernel(k, scalars={"n"})


# -- launch and buffers ---------------------------------------------------------------------------
def test_launch_dimensions() -> None:
    fails(kernel(grid=(0, 1, 1)), r"grid \(0, 1, 1\) must be three positive integers")
    fails(kernel(block=(64, 0, 1)), r"block \(64, 0, 1\) must be three positive")
    fails(kernel(block=(64, 32, 1)), r"block \(64, 32, 1\) has 2048 threads \(at most 1024\)")
    fails(kernel(block=(1, 1, 128)), r"exceeds the hardware limits")
    fails(kernel(grid=(1, 70000, 1)), r"exceeds the hardware limits")


def test_shared_memory_limit() -> None:
    big = (Buffer("s", F32, 12289, "shared"),)
    fails(kernel(shared=big), r"shared buffers use 49156 bytes, more than the limit of 49152")
    verify_kernel(kernel(shared=big), shared_limit=64 * 1024)
    fails(kernel(shared=(Buffer("s", F32, 1024, "shared"),)), "limit of 2048", shared_limit=2048)


def test_buffer_declarations() -> None:
    fails(kernel(shared=(Buffer("x", F32, 4, "shared"),)), "buffer 'x' is declared twice")
    fails(kernel(shared=(Buffer("s", F32, 4, "global"),)), "listed as shared but has space 'global'")
    k = Kernel("k", (Buffer("x", F32, 4, role="scratch"),), (1, 1, 1), (1, 1, 1), ())
    fails(k, "role 'scratch'")


# -- buffers and types in statements --------------------------------------------------------------------
def test_unknown_buffers() -> None:
    fails(kernel(*GUARDED, Store("nope", IV, f(0))), r"`nope\[i\] = 0.0f`: stores to unknown buffer 'nope'")
    fails(kernel(*GUARDED, Store("y", IV, Load("nope", IV, F32))), "loads from unknown buffer 'nope'")


def test_load_and_store_dtypes_match_the_buffer() -> None:
    fails(kernel(*GUARDED, Store("y", IV, Load("x", IV, DType.f16))), "loads f16 from f32 buffer 'x'")
    fails(kernel(*GUARDED, Store("y", IV, Const(1, I32))), "stores a i32 value to f32 buffer 'y'")


def test_store_to_input() -> None:
    msg = fails(kernel(*GUARDED, Store("x", IV, f(0))), r"stores to 'x', an input \(role 'in'\)")
    assert "`x[i] = 0.0f`" in msg
    for ok in ("y", "acc"):  # out and inout
        verify_kernel(kernel(*GUARDED, Store(ok, IV, f(0))))
    verify_kernel(kernel(Store("s", TID, f(0)), shared=(Buffer("s", F32, 64, "shared"),)))
    verify_kernel(kernel(Store("l", c(0), f(0)), local=(Buffer("l", F32, 1, "local"),)))


@pytest.mark.parametrize(("expr", "pattern"), [
    (Binary("add", Load("x", IV, F32), Cast(IV, F32), DType.f16), "add of f32, f32 gives f32, the node says f16"),
    (Binary("add", Load("x", IV, F32), Load("idx", IV, I32), F32), "operands must have identical types"),
    (Binary("lt", Load("x", IV, F32), f(0), F32), "lt of f32, f32 gives bool, the node says f32"),
    (Unary("exp", IV, I32), "exp needs a float operand"),
    (Unary("frobnicate", f(1), F32), "unknown op 'frobnicate'"),
    (Select(IV, f(1), f(2), F32), "select condition is i32, not bool"),
    (Select(lt(IV, c(3)), f(1), Const(2, I32), F32), "select of f32 and i32 typed f32"),
    (Const(1.5, I32), "constant 1.5 is not a i32"),
    (Const(2**40, I32), "is not a i32"),
    (Cast(Binary("div", f(1), Const(1, I32), F32), F32), "operands must have identical types"),
])
def test_expression_types(expr, pattern: str) -> None:
    value = expr if expr.dtype == F32 else Cast(expr, F32)
    fails(kernel(*GUARDED, Store("y", IV, value)), pattern)


def test_index_expressions_are_i32() -> None:
    i64 = Cast(IV, DType.i64)
    fails(kernel(*GUARDED, Store("y", i64, f(0))), "index expression \\(i64\\)i is i64, not i32")
    fails(kernel(*GUARDED, Store("y", IV, Load("x", i64, F32))), "is i64, not i32")
    fails(kernel(For(Var("k", DType.i64), Const(0, DType.i64), Const(4, DType.i64), 1, ())), "is i64, not i32")


def test_condition_is_bool() -> None:
    fails(kernel(*GUARDED, If(IV, (Store("y", IV, f(0)),))), r"`if \(i\)`: condition is i32, not bool")


def test_register_types_and_assignments() -> None:
    fails(kernel(Assign(IV, f(1))), "assigns a f32 value to i32 register i")
    fails(kernel(Assign(IV, c(1)), Assign(Var("i", F32), f(1))), "register i is used as f32 and as i32")


# -- assigned before use ---------------------------------------------------------------------------
def test_read_before_assignment() -> None:
    fails(kernel(Store("y", IV, f(0)), *GUARDED), r"`y\[i\] = 0.0f`: reads register i before it is assigned")


def test_assigned_in_one_branch_only() -> None:
    t = v("t")
    one = kernel(*GUARDED, If(lt(IV, c(5)), (Assign(t, c(1)),)), Store("y", t, f(0)))
    fails(one, "reads register t before it is assigned")
    both = kernel(*GUARDED, If(lt(IV, c(5)), (Assign(t, c(1)),), (Assign(t, c(2)),)), Store("y", t, f(0)))
    verify_kernel(both)


def test_assigned_in_a_loop() -> None:
    t, k = v("t"), v("k")
    maybe_empty = kernel(*GUARDED, For(k, c(0), b("fmod", IV, c(3)), 1, (Assign(t, k),)), Store("y", t, f(0)))
    fails(maybe_empty, "reads register t before it is assigned")
    runs = kernel(*GUARDED, For(k, c(0), c(3), 1, (Assign(t, k),)), Store("y", t, f(0)))
    verify_kernel(runs)
    fails(kernel(For(k, c(0), c(3), 1, ()), Store("y", k, f(0))), "reads register k before it is assigned")


def test_loop_variable_rules() -> None:
    k = v("k")
    fails(kernel(For(k, c(0), c(4), 1, (Assign(k, c(2)),))), "assigns the loop variable k inside its loop")
    fails(kernel(For(k, c(0), c(4), 1, (For(k, c(0), c(4), 1, ()),))), "shadows an enclosing loop's")
    fails(kernel(For(k, c(0), c(4), 0, ())), "loop step must be a non-zero integer")


# -- synchronisation ------------------------------------------------------------------------------
def test_barrier_under_thread_dependent_if() -> None:
    msg = fails(kernel(If(lt(TID, c(32)), (Barrier(),))),
                r"`__syncthreads\(\)`: barrier under thread-dependent control flow: `if \(tid.x < 32\)` "
                r"has a condition that depends on tid.x")
    assert "kernel k" in msg


def test_barrier_under_condition_on_a_register_derived_from_tid() -> None:
    t, u = v("t"), v("u")
    k = kernel(Assign(t, mul(TID, c(2))), Assign(u, add(t, c(1))), If(lt(u, c(9)), (Barrier(),)))
    fails(k, "depends on register u")


def test_barrier_under_condition_assigned_under_thread_dependent_control() -> None:
    flag = v("flag")
    k = kernel(Assign(flag, c(0)), If(lt(TID, c(3)), (Assign(flag, c(1)),)), If(b("eq", flag, c(1)), (Barrier(),)))
    fails(k, "depends on register flag")


def test_barrier_under_condition_on_a_thread_dependent_load() -> None:
    k = kernel(If(lt(Load("idx", TID, I32), c(3)), (Barrier(),)))
    fails(k, "barrier under thread-dependent control flow")
    loc = (Buffer("l", I32, 1, "local"),)
    k = kernel(Store("l", c(0), TID), If(lt(Load("l", c(0), I32), c(3)), (Barrier(),)), local=loc)
    fails(k, "depends on local buffer l")


def test_barrier_in_loop_with_thread_dependent_bounds() -> None:
    j = v("j")
    fails(kernel(For(j, TID, c(64), 64, (Barrier(),))),
          r"`for \(j = tid.x; j < 64; j \+= 64\)` has bounds that depend on tid.x")


def test_barrier_under_uniform_control_passes() -> None:
    j, n = v("j"), v("n")
    verify_kernel(kernel(
        Assign(n, add(mul(BID, c(2)), c(1))),
        If(lt(BID, c(2)), (Barrier(),)),
        For(j, c(0), n, 1, (Barrier(),)),
        If(lt(Load("idx", BID, I32), c(0)), (Barrier(),)),  # same address for the whole block
    ))


def test_barrier_under_warp_uniform_condition_is_still_an_error() -> None:
    fails(kernel(If(lt(TID, c(32)), (Barrier(),))), "barrier under thread-dependent control flow")


def test_warp_reduce_under_control_flow() -> None:
    r = v("r", F32)
    fails(kernel(If(lt(TID, c(16)), (WarpReduce(r, "sum", f(1)),))),
          r"warp reduction under control flow that differs within a warp: `if \(tid.x < 16\)`")
    verify_kernel(kernel(If(lt(TID, c(32)), (WarpReduce(r, "sum", f(1)),))))
    verify_kernel(kernel(If(b("eq", b("div", TID, c(32)), c(1)), (WarpReduce(r, "sum", f(1)),))))
    # with rows of 16 threads a warp holds two values of tid.y: tid.y is not warp-uniform
    fails(kernel(If(lt(TIDY, c(1)), (WarpReduce(r, "sum", f(1)),)), block=(16, 4, 1)), "differs within a warp")
    verify_kernel(kernel(If(lt(TIDY, c(1)), (WarpReduce(r, "sum", f(1)),)), block=(32, 2, 1)))


def test_warp_reduce_operands() -> None:
    r = v("r", F32)
    fails(kernel(WarpReduce(r, "mean", f(1))), "unknown warp reduction 'mean'")
    fails(kernel(WarpReduce(r, "sum", f(1), 12)), "width 12 must be a power of two <= 32")
    fails(kernel(WarpReduce(r, "sum", f(1), 64)), "width 64 must be a power of two")
    fails(kernel(WarpReduce(r, "sum", f(1), 32), block=(48, 1, 1)), "48 threads do not fill groups of 32 lanes")
    fails(kernel(WarpReduce(v("q", BOOL), "sum", Const(True, BOOL))), "warp sum of a bool value")
    fails(kernel(WarpReduce(r, "sum", c(1))), "assigns a i32 value to f32 register r")


# -- memory bounds --------------------------------------------------------------------------------
def test_unguarded_access_past_the_end() -> None:
    k = kernel(*GUARDED, Store("y", IV, Load("x", IV, F32)), grid=(5, 1, 1))  # 320 threads, 256 elements
    msg = fails(k, r"`y\[i\] = x\[i\]`: load from x\[i\] is out of bounds: index 256 at tid.x=0, bid.x=4, "
                   r"but 'x' has 256 elements")
    assert "store to y[i] is out of bounds" in msg


def test_off_by_one_guard() -> None:
    k = kernel(*GUARDED, If(b("le", IV, c(256)), (Store("y", IV, f(0)),)), grid=(5, 1, 1))
    fails(k, r"store to y\[i\] is out of bounds: index 256")
    verify_kernel(kernel(*GUARDED, If(lt(IV, c(256)), (Store("y", IV, f(0)),)), grid=(5, 1, 1)))


def test_negative_index() -> None:
    fails(kernel(*GUARDED, Store("y", b("sub", IV, c(1)), f(0))), r"index -1 at tid.x=0, bid.x=0")


def test_out_of_bounds_in_a_loop_names_the_iteration() -> None:
    k2, s = v("k"), (Buffer("s", F32, 64, "shared"),)
    k = kernel(For(k2, c(0), c(65), 1, (Store("s", k2, f(0)),)), shared=s, grid=(1, 1, 1), block=(1, 1, 1))
    fails(k, r"store to s\[k\] is out of bounds: index 64 at k=64")


def test_out_of_bounds_reported_on_large_launches_too() -> None:
    """Too many threads to try them all: boundary threads still find it."""
    k = kernel(*GUARDED, Store("y", IV, f(0)), grid=(4000, 1, 1), block=(64, 1, 1), n=64 * 3999 + 10)
    fails(k, r"store to y\[i\] is out of bounds: index 2559[4-9]\d at tid.x=\d+, bid.x=3999")


def test_always_out_of_bounds_behind_a_data_dependent_guard() -> None:
    """No concrete thread can be followed through ``idx[...] < 0``, but the index is wrong wherever it runs."""
    k = kernel(If(lt(Load("idx", TID, I32), c(0)), (Store("y", add(TID, c(256)), f(0)),)))
    fails(k, r"store to y\[tid.x \+ 256\] is always out of bounds: its index is in \[256, 319\]")
    verify_kernel(kernel(If(lt(Load("idx", TID, I32), c(0)), (Store("y", add(TID, c(192)), f(0)),))))


def test_out_of_bounds_in_dead_code_is_not_reported() -> None:
    k = kernel(*GUARDED, If(b("ge", IV, c(100000)), (Store("y", IV, f(0)),)))
    verify_kernel(k)


def test_guard_on_an_unrelated_condition_does_not_hide_a_bug() -> None:
    k = kernel(*GUARDED, If(lt(TID, c(10)), (Store("y", add(IV, c(250)), f(0)),)))
    fails(k, r"store to y\[i \+ 250\] is out of bounds: index \d+ at tid.x=\d, bid.x=\d")


def test_every_problem_is_listed() -> None:
    k = kernel(Store("x", c(0), f(0)), Store("nope", c(0), f(0)), If(lt(TID, c(3)), (Barrier(),)))
    msg = fails(k, "an input")
    assert "unknown buffer 'nope'" in msg and "barrier under" in msg


def test_specials_are_checked() -> None:
    fails(kernel(Store("y", Special("lane", "x"), f(0))), "unknown thread coordinate lane.x")
