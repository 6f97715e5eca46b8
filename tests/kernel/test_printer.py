"""Golden tests of the kernel printer, and a check that its parentheses match the tree."""

from __future__ import annotations

import math
import random

import pytest

from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
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
    Unary,
    Var,
    WarpReduce,
    add,
    c,
    lt,
    mul,
)
from sextant.kernel.printer import print_expr, print_kernel

from .samples import BID, F32, I32, TID, b, block_sum, f, v

X, Y, Z = v("x"), v("y"), v("z")


def test_kernel_golden() -> None:
    i, acc, k, val = v("i"), v("acc", F32), v("k"), v("v", F32)
    kernel = Kernel(
        "fused_3",
        (Buffer("x", F32, 4096), Buffer("w", F32, 64), Buffer("out0", F32, 4096, role="out")),
        (128, 1, 1), (256, 1, 1),
        (
            Assign(i, add(mul(BID, c(256)), TID)),
            If(lt(i, c(4096)), (
                Assign(acc, f(0)),
                For(k, c(0), c(64), 1, (Assign(acc, b("add", acc, Load("w", k, F32))),)),
                Store("out0", i, b("mul", Unary("exp", Load("x", i, F32), F32), f(0.5))),
            )),
            Barrier(),
            WarpReduce(val, "sum", Load("x", i, F32), 32),
        ),
        shared=(Buffer("tile", F32, 256, "shared"),),
        local=(Buffer("regs", F32, 8, "local"),),
    )
    assert print_kernel(kernel) == """\
kernel fused_3 grid=(128,1,1) block=(256,1,1)
  (in f32 x[4096], in f32 w[64], out f32 out0[4096])
  shared f32 tile[256]
  local f32 regs[8]
{
  i = bid.x * 256 + tid.x
  if (i < 4096) {
    acc = 0.0f
    for (k = 0; k < 64; k += 1) {
      acc = acc + w[k]
    }
    out0[i] = exp(x[i]) * 0.5f
  }
  __syncthreads()
  v = warp_sum(x[i], width=32)
}"""


def test_sample_kernel_golden() -> None:
    assert print_kernel(block_sum(rows=2, length=100, block=32)) == """\
kernel block_sum grid=(2,1,1) block=(32,1,1)
  (in f32 in0[200], out f32 out0[2])
  shared f32 buf[32]
{
  acc = 0.0f
  for (j = tid.x; j < 100; j += 32) {
    acc = acc + in0[bid.x * 100 + j]
  }
  buf[tid.x] = acc
  __syncthreads()
  for (t = 0; t < 5; t += 1) {
    s = 16 >> t
    if (tid.x < s) {
      buf[tid.x] = buf[tid.x] + buf[tid.x + s]
    }
    __syncthreads()
  }
  if (tid.x == 0) {
    out0[bid.x] = buf[0]
  }
}"""


def test_control_flow_forms() -> None:
    k, r = v("k"), v("r")
    chain = If(lt(X, c(0)), (Assign(r, c(-1)),), (If(b("eq", X, c(0)), (Assign(r, c(0)),), (Assign(r, c(1)),)),))
    kernel = Kernel("forms", (), (1, 1, 1), (1, 1, 1), (
        Assign(X, c(3)),
        chain,
        For(k, c(10), c(0), -2, (), unroll=True),
        If(lt(X, c(5)), (), (Barrier(),)),
    ))
    assert print_kernel(kernel) == """\
kernel forms grid=(1,1,1) block=(1,1,1)
  ()
{
  x = 3
  if (x < 0) {
    r = -1
  } else if (x == 0) {
    r = 0
  } else {
    r = 1
  }
  #pragma unroll
  for (k = 10; k > 0; k -= 2) {
  }
  if (x < 5) {
  } else {
    __syncthreads()
  }
}"""


@pytest.mark.parametrize(("expr", "text"), [
    (b("mul", add(X, Y), Z), "(x + y) * z"),
    (add(X, mul(Y, Z)), "x + y * z"),
    (b("sub", X, b("sub", Y, Z)), "x - (y - z)"),
    (b("sub", b("sub", X, Y), Z), "x - y - z"),
    (add(X, add(Y, Z)), "x + (y + z)"),  # float addition is not associative: keep the tree
    (b("div", b("mul", X, Y), Z), "x * y / z"),
    (b("mul", X, b("div", Y, Z)), "x * (y / z)"),
    (b("fmod", X, c(8)), "x % 8"),
    (add(b("shl", X, c(2)), Y), "(x << 2) + y"),
    (b("shl", add(X, Y), c(2)), "x + y << 2"),
    (b("bitwise_and", lt(X, Y), b("ge", X, c(0))), "(x < y) & (x >= 0)"),
    (b("bitwise_or", b("bitwise_and", X, Y), Z), "(x & y) | z"),
    (b("eq", b("bitwise_and", X, c(31)), c(0)), "(x & 31) == 0"),
    (Unary("neg", add(X, Y), I32), "-(x + y)"),
    (Unary("neg", Unary("neg", X, I32), I32), "- -x"),
    (Unary("neg", c(-3), I32), "- -3"),
    (Unary("logical_not", lt(X, Y), DType.bool), "!(x < y)"),
    (Unary("bitwise_not", X, I32), "~x"),
    (Cast(add(X, Y), DType.f16), "(f16)(x + y)"),
    (b("mul", Cast(X, F32), f(2)), "(f32)x * 2.0f"),
    (Select(lt(X, Y), X, Select(lt(Y, Z), Y, Z, I32), I32), "x < y ? x : y < z ? y : z"),
    (Select(Select(lt(X, Y), lt(Y, Z), lt(Z, X), DType.bool), X, Y, I32), "(x < y ? y < z : z < x) ? x : y"),
    (add(Select(lt(X, Y), X, Y, I32), c(1)), "(x < y ? x : y) + 1"),
    (b("maximum", X, b("minimum", Y, c(7))), "max(x, min(y, 7))"),
    (Binary("fmod", f(1), f(3), F32), "fmod(1.0f, 3.0f)"),
    (Binary("pow", f(2), f(0.5), F32), "pow(2.0f, 0.5f)"),
    (Unary("sqrt", Load("w", add(X, c(1)), F32), F32), "sqrt(w[x + 1])"),
    (Load("w", Load("idx", X, I32), F32), "w[idx[x]]"),
    (add(Special("bdim", "y"), Special("gdim", "z")), "bdim.y + gdim.z"),
    (b("sub", X, c(-1)), "x - -1"),
])
def test_expression_text(expr: Expr, text: str) -> None:
    assert print_expr(expr) == text


@pytest.mark.parametrize(("const", "text"), [
    (Const(0.5, F32), "0.5f"), (Const(1e-05, F32), "1e-05f"), (Const(-2.0, F32), "-2.0f"),
    (Const(0.5, DType.f16), "(f16)0.5"), (Const(3.0, DType.bf16), "(bf16)3.0"),
    (Const(math.inf, F32), "inff"), (Const(-math.inf, DType.f16), "(f16)-inf"), (Const(math.nan, F32), "nanf"),
    (Const(7, I32), "7"), (Const(-7, I32), "-7"), (Const(7, DType.i64), "7L"),
    (Const(True, DType.bool), "true"), (Const(False, DType.bool), "false"),
])
def test_constants(const: Const, text: str) -> None:
    assert print_expr(const) == text


def test_negative_constant_operand_binds_as_unary() -> None:
    assert print_expr(b("mul", c(-1), X)) == "-1 * x"
    assert print_expr(Unary("neg", Const(-1.5, F32), F32)) == "- -1.5f"


# -- the parentheses are right: Python shares C's precedence for these operators --------------
_PY_OPS = {"add": "+", "sub": "-", "mul": "*", "shl": "<<", "shr": ">>",
           "bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}


def _random_expr(rng: random.Random, depth: int) -> Expr:
    if depth == 0 or rng.random() < 0.2:
        return rng.choice([X, Y, Z, c(rng.randint(0, 5))])
    if rng.random() < 0.15:
        return Unary(rng.choice(["neg", "bitwise_not"]), _random_expr(rng, depth - 1), I32)
    op = rng.choice(list(_PY_OPS))
    rhs = c(rng.randint(0, 3)) if op in ("shl", "shr") else _random_expr(rng, depth - 1)
    return Binary(op, _random_expr(rng, depth - 1), rhs, I32)


def _direct(e: Expr, env: dict[str, int]) -> int:
    """Unbounded evaluation straight from the tree (no text involved)."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Unary):
        a = _direct(e.a, env)
        return -a if e.op == "neg" else ~a
    return eval(f"a {_PY_OPS[e.op]} b", {}, {"a": _direct(e.a, env), "b": _direct(e.b, env)})


def test_printed_text_parses_back_to_the_same_tree() -> None:
    rng = random.Random(0)
    for _ in range(500):
        e = _random_expr(rng, 4)
        env = {"x": rng.randint(-20, 20), "y": rng.randint(-20, 20), "z": rng.randint(-20, 20)}
        text = print_expr(e)
        assert eval(text, {}, dict(env)) == _direct(e, env), text
