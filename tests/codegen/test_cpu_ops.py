"""Every graph-IR elementwise op, in every dtype its typing rule allows, run by the CPU code
generator and compared with the reference executor (torch) on random and edge-case inputs."""

from __future__ import annotations

import contextlib
import math
import zlib

import pytest
import torch

from sextant.codegen import CodegenError, compile_kernels
from sextant.graph.dtypes import DType
from sextant.graph.ir import make_node
from sextant.graph.ops import BINARY, UNARY, IRTypeError, TensorType, infer_type
from sextant.graph.reference import eval_node
from sextant.kernel.ir import (
    Assign,
    Binary,
    Buffer,
    Cast,
    Expr,
    If,
    Kernel,
    Load,
    Select,
    Special,
    Store,
    Unary,
    Var,
    add,
    c,
    lt,
    mul,
)

N = 333  # ragged: not a multiple of the block size
T = 64
DTYPES = list(DType)
FLOAT_EDGES = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 0.25, 3.0, -3.0,
               1e-3, -1e-3, 0.7, -0.7, 0.99, -0.99, 7.0, 100.0, -100.0, 1e-30]
INT_EDGES = [0, 1, -1, 2, -2, 7, -7, 31, 63, 64]
INT_LIMITS = {DType.i32: (-(2**31), 2**31 - 1), DType.i64: (-(2**63), 2**63 - 1)}


def _cases() -> list[tuple[str, tuple[DType, ...], DType]]:
    """(op, operand dtypes, result dtype) for everything the typing rules accept."""
    out = []
    for op in sorted(UNARY):
        for dt in DTYPES:
            with contextlib.suppress(IRTypeError):
                out.append((op, (dt,), infer_type(op, [TensorType((N,), dt)], {}).dtype))
    for op in sorted(BINARY):
        for dt in DTYPES:
            with contextlib.suppress(IRTypeError):
                out.append((op, (dt, dt), infer_type(op, [TensorType((N,), dt)] * 2, {}).dtype))
    out += [("where", (DType.bool, dt, dt), dt) for dt in DTYPES]
    out += [("cast", (src,), dst) for src in DTYPES for dst in DTYPES if src != dst]
    return out


CASES = _cases()


def _name(op: str, ins: tuple[DType, ...], out: DType) -> str:
    return f"{op}_{'_'.join(d.value for d in ins)}_to_{out.value}"


def _expr(op: str, ins: list[Expr], out: DType) -> Expr:
    if op == "cast":
        return Cast(ins[0], out)
    if op == "where":
        return Select(ins[0], ins[1], ins[2], out)
    if len(ins) == 1:
        return Unary(op, ins[0], out)
    return Binary(op, ins[0], ins[1], out)


def elementwise_kernel(name: str, op: str, ins: tuple[DType, ...], out: DType, n: int = N) -> Kernel:
    """out[i] = op(a0[i], a1[i], ...) for i < n, one element per thread, guarded."""
    i = Var("i")
    loads: list[Expr] = [Load(f"a{j}", i, dt) for j, dt in enumerate(ins)]
    body = (
        Assign(i, add(mul(Special("bid", "x"), c(T)), Special("tid", "x"))),
        If(lt(i, c(n)), (Store("out", i, _expr(op, loads, out)),)),
    )
    params = tuple(Buffer(f"a{j}", dt, n) for j, dt in enumerate(ins)) + (Buffer("out", out, n, role="out"),)
    return Kernel(name, params, (-(-n // T), 1, 1), (T, 1, 1), body)


@pytest.fixture(scope="module")
def ops_module():
    return compile_kernels([elementwise_kernel(_name(*case), *case) for case in CASES])


def _random(dt: DType, op: str, position: int, gen: torch.Generator) -> torch.Tensor:
    """Operand ``position`` of ``op``: random values plus edge cases, within the op's domain."""
    if dt == DType.bool:
        return torch.rand(N, generator=gen) < 0.5
    if dt.is_float:
        x = torch.randn(N, generator=gen) * 3
        edges = torch.tensor(FLOAT_EDGES)
        if position == 0:
            x[: len(edges)] = edges
        else:  # pair every edge value with a few others
            x[: len(edges)] = edges.roll(3)
            x[len(edges): 2 * len(edges)] = edges
        if op in ("erfinv",):
            x[2 * len(edges):] = torch.rand(N - 2 * len(edges), generator=gen) * 2 - 1
        return x.to(dt.torch)
    lo, hi = INT_LIMITS[dt]
    x = torch.randint(-100, 100, (N,), generator=gen, dtype=dt.torch)
    if position == 0:
        x[: len(INT_EDGES) + 2] = torch.tensor([*INT_EDGES, lo, hi], dtype=dt.torch)
    elif op in ("shl", "shr"):
        x = torch.randint(-3, 72, (N,), generator=gen, dtype=dt.torch)
    elif op == "pow":
        x = torch.randint(-3, 40, (N,), generator=gen, dtype=dt.torch)
    else:
        x[: len(INT_EDGES) + 2] = torch.tensor([*INT_EDGES, hi, lo], dtype=dt.torch).roll(1)
    if position == 1 and op in ("div", "floordiv", "fmod", "remainder"):
        x[x == 0] = 3  # torch raises on integer division by zero (tested separately)
    return x


def _inputs(op: str, ins: tuple[DType, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xs = [_random(dt, op, j, gen) for j, dt in enumerate(ins)]
    if op in ("div", "floordiv", "fmod", "remainder") and ins[0].is_int:
        lo, _ = INT_LIMITS[ins[0]]
        xs[1][(xs[0] == lo) & (xs[1] == -1)] = 5  # INT_MIN / -1 kills torch itself (SIGFPE)
    return xs


TOLERANCE = {DType.f32: (1e-5, 1e-6), DType.f16: (2e-3, 1e-5), DType.bf16: (1.6e-2, 1e-5)}
LOOSE = {"lgamma": 10, "digamma": 10, "tan": 4, "erfinv": 10, "pow": 4}


def _compare(got: torch.Tensor, want: torch.Tensor, op: str, ins: tuple[DType, ...]) -> None:
    assert got.dtype == want.dtype
    if not got.dtype.is_floating_point:
        assert torch.equal(got, want), (got[got != want][:10], want[got != want][:10])
        return
    rtol, atol = TOLERANCE[DType.from_torch(got.dtype)]
    scale = LOOSE.get(op, 1) if ins[0].is_float else 1
    torch.testing.assert_close(got, want, rtol=rtol * scale, atol=atol * scale, equal_nan=True)
    zeros = (got == 0) & (want == 0)
    if op not in ("maximum", "minimum"):  # torch's own vector/scalar paths disagree on max(-0, +0)
        assert torch.equal(torch.signbit(got[zeros]), torch.signbit(want[zeros])), "sign of zero differs"


@pytest.mark.parametrize("case", CASES, ids=[_name(*case) for case in CASES])
def test_op_matches_reference(ops_module, case):
    op, ins, out = case
    xs = _inputs(op, ins, seed=zlib.crc32(_name(*case).encode()))
    nodes = [make_node("input", attrs={"shape": (N,), "dtype": dt, "name": f"a{j}", "index": j})
             for j, dt in enumerate(ins)]
    node = make_node(op, nodes, {"dtype": out} if op == "cast" else {})
    want = eval_node(node, xs)
    got = torch.full((N,), 123, dtype=out.torch)
    ops_module.launch(_name(*case), [*xs, got])
    _compare(got, want, op, ins)


@pytest.mark.parametrize("dt", [DType.i32, DType.i64])
def test_integer_division_by_zero_and_overflow_do_not_trap(dt):
    lo, _ = INT_LIMITS[dt]
    a = torch.tensor([5, -5, 0, lo, lo, 7], dtype=dt.torch)
    b = torch.tensor([0, 0, 0, -1, 0, -1], dtype=dt.torch)
    ops = ["div", "floordiv", "fmod", "remainder"]
    m = compile_kernels([elementwise_kernel(f"k_{op}", op, (dt, dt), dt, n=6) for op in ops])
    results = {}
    for op in ops:
        out = torch.zeros(6, dtype=dt.torch)
        m.launch(f"k_{op}", [a, b, out])
        results[op] = out
    assert results["div"][5].item() == -7 and results["fmod"][5].item() == 0  # x / -1, x % -1
    assert results["remainder"][3].item() == 0 and results["div"][3].item() == lo  # INT_MIN / -1 wraps


def test_float_to_int_cast_out_of_range_is_int_min():
    x = torch.tensor([1e10, -1e10, math.nan, 3.7, -3.7, math.inf])
    m = compile_kernels([elementwise_kernel("k", "cast", (DType.f32,), DType.i32, n=6)])
    out = torch.zeros(6, dtype=torch.int32)
    m.launch("k", [x, out])
    assert out.tolist() == [-(2**31)] * 3 + [3, -3, -(2**31)]


def test_op_type_errors_are_reported():
    bad = Kernel("bad", (Buffer("a", DType.i32, 4), Buffer("out", DType.i32, 4)), (1, 1, 1), (1, 1, 1),
                 (Store("out", c(0), Unary("sqrt", Load("a", c(0), DType.i32), DType.i32)),))
    with pytest.raises(CodegenError, match="sqrt needs a float operand"):
        compile_kernels([bad])
