"""SIMT kernels written directly in kernel IR, run on the CPU (compile_kernels + launch) and
checked against torch: guards, shared memory and barriers, warp reductions, local arrays,
multi-dimensional grids and blocks, concurrency, and half-precision memory."""

from __future__ import annotations

import re
import threading
from dataclasses import replace

import pytest
import torch

from sextant.codegen import CodegenError, compile_kernels, emit_module
from sextant.codegen.simt import Phase, UniformFor, plan_kernel
from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    AtomicAdd,
    Barrier,
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
    Special,
    Store,
    Var,
    WarpReduce,
    add,
    c,
    lt,
    mul,
)

F32, I32, BOOL = DType.f32, DType.i32, DType.bool
TID, BID = Special("tid", "x"), Special("bid", "x")


def f(v: float) -> Const:
    return Const(v, F32)


def fadd(a: Expr, b: Expr) -> Expr:
    return Binary("add", a, b, F32)


def fmul(a: Expr, b: Expr) -> Expr:
    return Binary("mul", a, b, F32)


def land(a: Expr, b: Expr) -> Expr:
    return Binary("bitwise_and", a, b, BOOL)


def gid(block: int) -> Expr:
    return add(mul(BID, c(block)), TID)


# -- elementwise ----------------------------------------------------------------------------------
def test_elementwise_guard_at_ragged_size():
    n, T = 1000, 128
    i = Var("i")
    body = (Assign(i, gid(T)),
            If(lt(i, c(n)), (Store("y", i, fadd(fmul(Load("x", i, F32), f(2.0)), f(1.0))),)))
    k = Kernel("axpb", (Buffer("x", F32, n), Buffer("y", F32, n, role="out")), (-(-n // T), 1, 1), (T, 1, 1), body)
    m = compile_kernels([k])
    x = torch.randn(n)
    y = torch.full((n + 24,), -7.0)  # elements past n must stay untouched
    m.launch("axpb", [x, y])
    torch.testing.assert_close(y[:n], x * 2 + 1)
    assert (y[n:] == -7.0).all()


# -- block reduction: shared memory and a tree of barriers ----------------------------------------
def block_sum_kernel(n: int, T: int = 128) -> Kernel:
    """out[b] = sum of x[b*T : (b+1)*T]: a shared-memory tree; the halving loop holds the barrier."""
    i, k, stride = Var("i"), Var("k"), Var("stride")
    levels = T.bit_length() - 1
    body = (
        Assign(i, gid(T)),
        Store("s", TID, Select(lt(i, c(n)), Load("x", i, F32), f(0.0), F32)),
        Barrier(),
        For(k, c(0), c(levels), 1, (
            Assign(stride, Binary("shr", c(T // 2), k, I32)),
            If(lt(TID, stride), (
                Store("s", TID, fadd(Load("s", TID, F32), Load("s", add(TID, stride), F32))),)),
            Barrier(),
        )),
        If(Binary("eq", TID, c(0), BOOL), (Store("out", BID, Load("s", c(0), F32)),)),
    )
    nb = -(-n // T)
    return Kernel("block_sum", (Buffer("x", F32, n), Buffer("out", F32, nb, role="out")), (nb, 1, 1), (T, 1, 1),
                  body, shared=(Buffer("s", F32, T, "shared"),))


def test_block_sum_reduction_with_barrier_tree():
    n, T = 1000, 128
    kernel = block_sum_kernel(n, T)
    plan = plan_kernel(kernel)
    assert [type(it) for it in plan.items] == [Phase, UniformFor, Phase]
    m = compile_kernels([kernel])
    x = torch.randn(n)
    out = torch.zeros(kernel.grid[0])
    m.launch("block_sum", [x, out])
    want = torch.nn.functional.pad(x, (0, kernel.grid[0] * T - n)).view(-1, T).sum(1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# -- tiled matmul ----------------------------------------------------------------------------------
def tiled_matmul_kernel(M: int, N: int, K: int, tile: int = 16) -> Kernel:
    """C = A @ B with tile x tile blocks; the K loop stages tiles of A and B in shared memory
    between two barriers; loads outside the matrices read 0."""
    tx, ty = Special("tid", "x"), Special("tid", "y")
    row, col, acc, t, kk, ka, kb = (Var(n) for n in ("row", "col", "acc", "t", "kk", "ka", "kb"))
    acc = Var("acc", F32)
    ts = c(tile)
    body = (
        Assign(row, add(mul(Special("bid", "y"), ts), ty)),
        Assign(col, add(mul(Special("bid", "x"), ts), tx)),
        Assign(acc, f(0.0)),
        For(t, c(0), c(-(-K // tile)), 1, (
            Assign(ka, add(mul(t, ts), tx)),
            Store("As", add(mul(ty, ts), tx),
                  Select(land(lt(row, c(M)), lt(ka, c(K))), Load("A", add(mul(row, c(K)), ka), F32), f(0.0), F32)),
            Assign(kb, add(mul(t, ts), ty)),
            Store("Bs", add(mul(ty, ts), tx),
                  Select(land(lt(kb, c(K)), lt(col, c(N))), Load("B", add(mul(kb, c(N)), col), F32), f(0.0), F32)),
            Barrier(),
            For(kk, c(0), ts, 1, (
                Assign(acc, fadd(acc, fmul(Load("As", add(mul(ty, ts), kk), F32),
                                           Load("Bs", add(mul(kk, ts), tx), F32)))),
            )),
            Barrier(),
        )),
        If(land(lt(row, c(M)), lt(col, c(N))), (Store("C", add(mul(row, c(N)), col), acc),)),
    )
    grid = (-(-N // tile), -(-M // tile), 1)
    return Kernel("matmul", (Buffer("A", F32, M * K), Buffer("B", F32, K * N), Buffer("C", F32, M * N, role="out")),
                  grid, (tile, tile, 1), body,
                  shared=(Buffer("As", F32, tile * tile, "shared"), Buffer("Bs", F32, tile * tile, "shared")))


BIG = (150, 170, 131)  # M, N, K for the concurrency test: long enough for launches to overlap


@pytest.fixture(scope="module")
def matmul_module():
    return compile_kernels([tiled_matmul_kernel(37, 45, 29), replace(tiled_matmul_kernel(*BIG), name="matmul_big")])


def test_tiled_matmul_ragged(matmul_module):
    plan = plan_kernel(tiled_matmul_kernel(37, 45, 29))
    assert {"acc", "row", "col"} <= plan.per_thread_vars  # live across the barriers
    assert "ka" not in plan.per_thread_vars and "t" in plan.uniform_loop_vars
    A, B = torch.randn(37, 29), torch.randn(29, 45)
    C = torch.zeros(37, 45)
    matmul_module.launch("matmul", [A, B, C])
    torch.testing.assert_close(C, A @ B, rtol=1e-4, atol=1e-4)


def test_concurrent_launches_from_two_python_threads(matmul_module):
    M, N, K = BIG
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(M, K, generator=gen), torch.randn(K, N, generator=gen)) for _ in range(2)]
    expected = []
    for A, B in inputs:
        C = torch.zeros(M, N)
        matmul_module.launch("matmul_big", [A, B, C], parallel=False)
        torch.testing.assert_close(C, A @ B, rtol=1e-4, atol=1e-4)
        expected.append(C)
    start = threading.Barrier(2)
    results: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def worker(j: int) -> None:
        try:
            A, B = inputs[j]
            outs = [torch.zeros(M, N) for _ in range(16)]
            calls = [matmul_module.prepare("matmul_big", [A, B, C], parallel=bool(r % 2)) for r, C in enumerate(outs)]
            start.wait()
            for call in calls:
                call()
            results[j] = outs
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for j in range(2):
        assert len(results[j]) == 16
        assert all(torch.equal(C, expected[j]) for C in results[j])


# -- warp reductions --------------------------------------------------------------------------------
def warp_reduce_kernel(op: str, width: int, T: int, nb: int) -> Kernel:
    i, v, r = Var("i"), Var("v", F32), Var("r", F32)
    body = (
        Assign(i, gid(T)),
        Assign(v, Load("x", i, F32)),
        WarpReduce(r, op, v, width),
        Store("out", i, fadd(r, f(0.0))),
    )
    n = T * nb
    return Kernel(f"warp_{op}_{width}_{T}", (Buffer("x", F32, n), Buffer("out", F32, n, role="out")),
                  (nb, 1, 1), (T, 1, 1), body)


@pytest.mark.parametrize(("op", "width", "T"), [("sum", 32, 64), ("max", 32, 64), ("sum", 8, 64), ("max", 8, 64),
                                                ("min", 8, 40), ("sum", 32, 48)])
def test_warp_reduce(op, width, T):
    nb = 3
    m = compile_kernels([warp_reduce_kernel(op, width, T, nb)])
    x = torch.randn(nb * T)
    out = torch.zeros(nb * T)
    m.launch(f"warp_{op}_{width}_{T}", [x, out])
    fn = {"sum": lambda t: t.sum(), "max": lambda t: t.max(), "min": lambda t: t.min()}[op]
    want = torch.empty_like(x)
    for b in range(nb):
        for g in range(0, T, width):  # a partial last warp reduces over the lanes that exist
            lo, hi = b * T + g, b * T + min(g + width, T)
            want[lo:hi] = fn(x[lo:hi])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# -- local arrays and unrolled loops -----------------------------------------------------------------
def register_tile_kernel(T: int, nb: int, R: int = 4) -> Kernel:
    """Each thread fills a local tile (unrolled loop), publishes its sum in shared memory, and
    after a barrier writes tile + its right neighbour's sum: the tile must be per thread."""
    j, tot, g = Var("j"), Var("tot", F32), Var("g")
    nbr = Binary("remainder", add(TID, c(1)), c(T), I32)
    body = (
        Assign(g, gid(T)),
        Assign(tot, f(0.0)),
        For(j, c(0), c(R), 1, (
            Store("tile", j, fmul(Load("x", add(mul(g, c(R)), j), F32), f(2.0))),
            Assign(tot, fadd(tot, Load("tile", j, F32))),
        ), unroll=True),
        Store("s", TID, tot),
        Barrier(),
        For(j, c(0), c(R), 1, (
            Store("y", add(mul(g, c(R)), j), fadd(Load("tile", j, F32), Load("s", nbr, F32))),
        )),
    )
    n = T * nb * R
    return Kernel("tile", (Buffer("x", F32, n), Buffer("y", F32, n, role="out")), (nb, 1, 1), (T, 1, 1), body,
                  shared=(Buffer("s", F32, T, "shared"),), local=(Buffer("tile", F32, R, "local"),))


def test_local_register_tile_and_unrolled_loop():
    T, nb, R = 32, 5, 4
    kernel = register_tile_kernel(T, nb, R)
    assert plan_kernel(kernel).per_thread_locals == {"tile"}
    loops = re.findall(r'^"?(j\.head[.\d]*)"?:', str(emit_module([kernel])), re.MULTILINE)
    assert len(loops) == 1  # only the second j loop is a loop: the first one is unrolled
    m = compile_kernels([kernel])
    x = torch.randn(nb * T * R)
    y = torch.zeros_like(x)
    m.launch("tile", [x, y])
    tile = (x * 2).view(nb, T, R)
    sums = tile.sum(-1).roll(-1, dims=1)
    torch.testing.assert_close(y.view(nb, T, R), tile + sums[..., None], rtol=1e-5, atol=1e-5)


def test_one_thread_block_runs_body_directly():
    """T == 1: barriers vanish and a warp reduction of one lane is its operand."""
    i, r = Var("i"), Var("r", F32)
    body = (Assign(i, BID), Barrier(), WarpReduce(r, "sum", Load("x", i, F32), 32), Store("y", i, fmul(r, f(3.0))))
    k = Kernel("one", (Buffer("x", F32, 10), Buffer("y", F32, 10, role="out")), (10, 1, 1), (1, 1, 1), body)
    y = torch.zeros(10)
    x = torch.randn(10)
    compile_kernels([k]).launch("one", [x, y])
    torch.testing.assert_close(y, x * 3)


# -- multi-dimensional grids and blocks ---------------------------------------------------------------
@pytest.mark.parametrize(("grid", "block"), [((5, 3, 1), (8, 4, 1)), ((3, 2, 2), (4, 2, 3))])
def test_multidimensional_grid_and_block_coordinates(grid, block):
    """Every thread writes its coordinates at its global linear id; a barrier in the middle makes
    the thread loops run twice."""
    T = block[0] * block[1] * block[2]
    specials = [Special(kind, ax) for kind in ("bid", "tid", "gdim", "bdim") for ax in "xyz"]
    lin_b = add(mul(add(mul(Special("bid", "z"), c(grid[1])), Special("bid", "y")), c(grid[0])), Special("bid", "x"))
    lin_t = add(mul(add(mul(Special("tid", "z"), c(block[1])), Special("tid", "y")), c(block[0])), Special("tid", "x"))
    g = Var("g")
    stores = tuple(Store("out", add(mul(g, c(len(specials))), c(j)), s) for j, s in enumerate(specials))
    body = (Assign(g, add(mul(lin_b, c(T)), lin_t)), *stores[:6], Barrier(), *stores[6:])
    n = grid[0] * grid[1] * grid[2] * T
    k = Kernel("coords", (Buffer("out", I32, n * len(specials), role="out"),), grid, block, body)
    out = torch.full((n * len(specials),), -1, dtype=torch.int32)
    compile_kernels([k]).launch("coords", [out])
    want = []
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                for tz in range(block[2]):
                    for ty in range(block[1]):
                        for tx in range(block[0]):
                            want.append([bx, by, bz, tx, ty, tz, *grid, *block])
    assert out.view(n, -1).tolist() == want


def test_2d_block_shared_transpose():
    """A tile transpose through shared memory: thread (x, y) reads what thread (y, x) wrote."""
    B, tiles = 8, (3, 2)
    tx, ty = Special("tid", "x"), Special("tid", "y")
    W, H = tiles[0] * B, tiles[1] * B
    r = add(mul(Special("bid", "y"), c(B)), ty)
    col = add(mul(Special("bid", "x"), c(B)), tx)
    orow = add(mul(Special("bid", "x"), c(B)), ty)
    ocol = add(mul(Special("bid", "y"), c(B)), tx)
    body = (
        Store("s", add(mul(ty, c(B)), tx), Load("x", add(mul(r, c(W)), col), F32)),
        Barrier(),
        Store("y", add(mul(orow, c(H)), ocol), Load("s", add(mul(tx, c(B)), ty), F32)),
    )
    k = Kernel("transpose", (Buffer("x", F32, W * H), Buffer("y", F32, W * H, role="out")), (*tiles, 1), (B, B, 1),
               body, shared=(Buffer("s", F32, B * B, "shared"),))
    x = torch.randn(H, W)
    y = torch.zeros(W, H)
    compile_kernels([k]).launch("transpose", [x, y])
    assert torch.equal(y, x.t())


# -- registers across phases ------------------------------------------------------------------------
def test_register_updated_in_a_barrier_loop_is_per_thread():
    """``cnt = cnt + tid`` inside a loop with a barrier: each thread keeps its own count."""
    T = 16
    cnt, k = Var("cnt"), Var("k")
    body = (
        Assign(cnt, c(0)),
        For(k, c(0), c(5), 1, (Assign(cnt, add(cnt, add(TID, c(1)))), Barrier())),
        Store("out", TID, cnt),
    )
    kern = Kernel("count", (Buffer("out", I32, T, role="out"),), (1, 1, 1), (T, 1, 1), body)
    out = torch.zeros(T, dtype=torch.int32)
    compile_kernels([kern]).launch("count", [out])
    assert out.tolist() == [5 * (t + 1) for t in range(T)]


def test_barrier_under_thread_dependent_control_is_rejected():
    k, T = Var("k"), 8
    loop = For(k, c(0), add(TID, c(1)), 1, (Barrier(),))
    kern = Kernel("bad_loop", (Buffer("out", I32, T),), (1, 1, 1), (T, 1, 1), (loop,))
    with pytest.raises(CodegenError, match="thread-uniform"):
        compile_kernels([kern])
    cond = If(lt(TID, c(4)), (Barrier(),))
    kern = Kernel("bad_if", (Buffer("out", I32, T),), (1, 1, 1), (T, 1, 1), (cond,))
    with pytest.raises(CodegenError, match="thread-uniform"):
        compile_kernels([kern])


def test_uniform_if_with_barrier_and_large_shared_buffer():
    """A barrier under a block-uniform condition, and a 256 KiB shared buffer (heap-allocated)."""
    T, size = 32, 65536
    body = (
        If(lt(BID, c(2)), (
            Store("s", add(mul(TID, c(size // T)), c(5)), Cast(add(TID, BID), F32)),
            Barrier(),
            Store("out", add(mul(BID, c(T)), TID), Load("s", add(mul(Binary("sub", c(T - 1), TID, I32),
                                                                         c(size // T)), c(5)), F32)),
        )),
    )
    k = Kernel("uif", (Buffer("out", F32, 3 * T, role="out"),), (3, 1, 1), (T, 1, 1), body,
               shared=(Buffer("s", F32, size, "shared"),))
    out = torch.full((3 * T,), -1.0)
    compile_kernels([k]).launch("uif", [out])
    want = torch.tensor([[T - 1 - t + b for t in range(T)] for b in range(2)] + [[-1.0] * T]).flatten()
    assert torch.equal(out, want)


# -- parallel launch ------------------------------------------------------------------------------
def test_parallel_and_partial_launch():
    n, T = 1 << 16, 64
    i = Var("i")
    body = (Assign(i, gid(T)), Store("y", i, fadd(Load("x", i, F32), Cast(BID, F32))))
    k = Kernel("addbid", (Buffer("x", F32, n), Buffer("y", F32, n, role="out")), (n // T, 1, 1), (T, 1, 1), body)
    m = compile_kernels([k])
    x = torch.randn(n)
    want = x + torch.arange(n // T).repeat_interleave(T).float()
    for parallel in (True, False):
        y = torch.zeros(n)
        m.prepare("addbid", [x, y], parallel=parallel)()
        assert torch.equal(y, want)
    y = torch.zeros(n)
    m.launch("addbid", [x, y], grid_blocks=10)  # only the first ten blocks
    assert torch.equal(y[: 10 * T], want[: 10 * T]) and not y[10 * T:].any()
    with pytest.raises(ValueError, match="dtype"):
        m.launch("addbid", [x.double(), y])


# -- half-precision memory ----------------------------------------------------------------------------
@pytest.mark.parametrize("dt", [DType.f16, DType.bf16])
def test_half_precision_roundtrip(dt):
    """All 65536 bit patterns: a copy is bit-exact, widening to f32 matches torch exactly, and so
    does rounding random f32 values (incl. ties, overflow and NaN) to the half type."""
    n, T = 1 << 16, 256
    i = Var("i")
    body = (
        Assign(i, gid(T)),
        Store("copy", i, Load("h", i, dt)),
        Store("wide", i, Cast(Load("h", i, dt), F32)),
        Store("narrow", i, Cast(Load("f", i, F32), dt)),
    )
    k = Kernel("half", (Buffer("h", dt, n), Buffer("f", F32, n), Buffer("copy", dt, n, role="out"),
                        Buffer("wide", F32, n, role="out"), Buffer("narrow", dt, n, role="out")),
               (n // T, 1, 1), (T, 1, 1), body)
    h = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dt.torch)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32)
    bits[: 1 << 15] = (torch.arange(1 << 15, dtype=torch.int32) << 16) | (1 << 15)  # exact ties
    f = bits.view(torch.float32)
    f[-4:] = torch.tensor([1e6, -7e4, float("inf"), float("nan")])
    copy, wide, narrow = torch.zeros(n, dtype=dt.torch), torch.zeros(n), torch.zeros(n, dtype=dt.torch)
    compile_kernels([k]).launch("half", [h, f, copy, wide, narrow])
    assert torch.equal(copy.view(torch.int16), h.view(torch.int16))
    torch.testing.assert_close(wide, h.float(), rtol=0, atol=0, equal_nan=True)
    want = f.to(dt.torch)
    ok = ~want.isnan()
    assert torch.equal(narrow[ok].view(torch.int16), want[ok].view(torch.int16))
    assert narrow[~ok].isnan().all()


# -- two-level block reduction: a warp reduction under a thread-dependent If -------------------------
def test_block_reduction_with_warp_reduce_in_first_warp_only():
    T, nb = 128, 3
    v, r, r2, lane0 = Var("v", F32), Var("r", F32), Var("r2", F32), Var("lane0", BOOL)
    warp = Binary("div", TID, c(32), I32)
    body = (
        Assign(v, Load("x", gid(T), F32)),
        WarpReduce(r, "sum", v, 32),
        Assign(lane0, Binary("eq", Binary("bitwise_and", TID, c(31), I32), c(0), BOOL)),
        If(lane0, (Store("s", warp, r),)),
        Barrier(),
        If(lt(TID, c(32)), (  # only the first warp: warp-uniform, not block-uniform
            WarpReduce(r2, "sum", Select(lt(TID, c(T // 32)), Load("s", TID, F32), f(0.0), F32), 32),
            If(Binary("eq", TID, c(0), BOOL), (Store("out", BID, r2),)),
        )),
    )
    k = Kernel("block_red", (Buffer("x", F32, T * nb), Buffer("out", F32, nb, role="out")), (nb, 1, 1), (T, 1, 1),
               body, shared=(Buffer("s", F32, T // 32, "shared"),))
    x = torch.randn(T * nb)
    out = torch.zeros(nb)
    compile_kernels([k]).launch("block_red", [x, out])
    torch.testing.assert_close(out, x.view(nb, T).sum(1), rtol=1e-5, atol=1e-5)


def test_select_evaluates_only_the_chosen_load():
    """``where(mask[i], x[i * 2**28], 1 + i)``: the unchosen arm's address is far out of bounds,
    so evaluating it eagerly would fault (the mask is data, so LLVM cannot simplify it away)."""
    n, T = 4, 8
    i = Var("i")
    far = Load("x", mul(i, c(1 << 28)), F32)
    body = (Assign(i, TID), Store("y", TID, Select(Load("mask", i, BOOL), far, fadd(f(1.0), Cast(i, F32)), F32)))
    k = Kernel("guarded", (Buffer("x", F32, n), Buffer("mask", BOOL, T), Buffer("y", F32, T, role="out")),
               (1, 1, 1), (T, 1, 1), body)
    x, y = torch.randn(n), torch.zeros(T)
    mask = torch.arange(T) == 0
    compile_kernels([k]).launch("guarded", [x, mask, y])
    assert y.tolist() == [x[0].item()] + [1.0 + t for t in range(1, T)]


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16, DType.i64])
def test_atomic_add_from_many_blocks(dtype):
    """Blocks run on several host threads at once, each adding a long run of ones into the same
    few bins: every add must land (an atomicrmw, or a compare-exchange loop for bf16). A plain
    read-modify-write loses adds here (seen: a bin short by a third)."""
    blocks, per, bins = 8, 96 if dtype == DType.bf16 else 500_000, 3  # bf16 counts exactly to 256 only
    j = Var("j")
    body = (For(j, c(0), c(per // bins * bins), 1, (
        AtomicAdd("bins", Binary("remainder", j, c(bins), I32), Load("x", add(mul(BID, c(per)), j), dtype)),)),)
    k = Kernel("hist", (Buffer("x", dtype, blocks * per), Buffer("bins", dtype, bins, role="inout")),
               (blocks, 1, 1), (1, 1, 1), body)
    m = compile_kernels([k])
    x = torch.ones(blocks * per, dtype=dtype.torch)
    for _ in range(3):
        hist = torch.zeros(bins, dtype=dtype.torch)
        m.launch("hist", [x, hist])
        assert torch.equal(hist.double(), torch.full((bins,), float(per // bins * blocks), dtype=torch.float64))
