"""The CPU's inline exp/expm1/log/log1p/tanh/erf (``sextant.codegen.cpu_math``): ulp error against
float64 and against torch's float32 on ~10^6 values each, special values, and that loops using
them are vectorised."""

from __future__ import annotations

import math
import re

import pytest
import torch

from sextant.codegen import compile_kernels
from sextant.graph.dtypes import DType
from sextant.kernel.ir import Assign, Buffer, If, Kernel, Load, Special, Store, Unary, Var, add, c, lt, mul

N = 1 << 20
T = 64
# op: (dense range, max ulp vs the float64 result rounded, max ulp vs torch) — measured maxima
# measured here: 1.00 / 1.45 / 0.82 / 0.84 / 0.95 / 0.98 ulp vs exact, 1 ulp vs torch (bounds: a margin)
OPS = {
    "exp": ((-105.0, 90.0), 1.2, 2), "expm1": ((-20.0, 90.0), 1.6, 2), "log": ((0.0, 10.0), 1.2, 2),
    "log1p": ((-1.0, 10.0), 1.2, 2), "tanh": ((-10.0, 10.0), 1.2, 2), "erf": ((-5.0, 5.0), 1.3, 2),
}
SPECIAL = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38, -1e-38, 1e-20,
           -1e-20, 1e-7, -1e-7, 88.72283, 88.72284, 88.7229, 89.0, 100.0, -87.3, -95.0, -103.9, -103.98, -104.0,
           -110.0, 3.9, 3.93, 4.0, 9.0, 10.0, 20.0, -20.0, 1e30, -1e30, 3.4e38, -3.4e38]


def elementwise_kernel(op: str, n: int) -> Kernel:
    """out[i] = op(a[i]) for i < n in f32, one element per thread."""
    i = Var("i")
    body = (Assign(i, add(mul(Special("bid", "x"), c(T)), Special("tid", "x"))),
            If(lt(i, c(n)), (Store("out", i, Unary(op, Load("a", i, DType.f32), DType.f32)),)))
    params = (Buffer("a", DType.f32, n), Buffer("out", DType.f32, n, role="out"))
    return Kernel(op, params, (-(-n // T), 1, 1), (T, 1, 1), body)


def _values(op: str) -> torch.Tensor:
    """A dense grid over the op's interesting range, normals at several scales, the specials."""
    (lo, hi), _, _ = OPS[op]
    gen = torch.Generator().manual_seed(0)
    parts = [torch.linspace(lo, hi, N // 2)]
    parts += [torch.randn(N // 16, generator=gen) * s for s in (1e-6, 1e-2, 1.0, 30.0)]
    if op in ("log", "log1p"):  # every binade, denormals included
        parts.append(torch.exp(torch.rand(N // 8, generator=gen, dtype=torch.float64) * 191 - 103).float())
    else:
        parts.append(torch.rand(N // 8, generator=gen) * 2 - 1)
    x = torch.cat([torch.tensor(SPECIAL), *parts])
    return torch.cat([x, torch.rand(N - len(x), generator=gen) * (hi - lo) + lo])


def _f32(v: float) -> float:
    return torch.tensor(v).item()


def _ordinal(x: torch.Tensor) -> torch.Tensor:
    """f32 bit patterns mapped monotonically onto integers (neighbouring floats differ by 1)."""
    i = x.view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def _ulp_vs_exact(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in ulps of the nearest f32 (2^-149 for denormals); 0 or inf where not finite."""
    near = exact.float()
    expo = torch.floor(torch.log2(near.abs().double().clamp(min=2.0**-126)))
    err = (got.double() - exact).abs() / torch.exp2(expo - 23)
    same = (got == near) | (got.isnan() & near.isnan())
    special = ~torch.isfinite(near) | ~torch.isfinite(got)
    return torch.where(special, torch.where(same, 0.0, math.inf), err)


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    m = compile_kernels([elementwise_kernel(op, N) for op in OPS])
    out = {}
    for op in OPS:
        x = _values(op)
        got = torch.empty(N)
        m.launch(op, [x, got])
        out[op] = x, got
    return out


@pytest.mark.parametrize("op", list(OPS))
def test_ulp_error(results, op):
    x, got = results[op]
    _, exact_bound, torch_bound = OPS[op]
    fn = getattr(torch, op)
    err = _ulp_vs_exact(got, fn(x.double()))
    assert err.max().item() <= exact_bound, (err.max().item(), x[err.argmax()].item())
    want = fn(x)
    assert torch.equal(got.isnan(), want.isnan())
    diff = (_ordinal(got) - _ordinal(want)).abs()
    diff[got.isnan()] = 0
    assert diff.max().item() <= torch_bound, (diff.max().item(), x[diff.argmax()].item())


def test_special_values(results):
    def at(op: str, v: float) -> float:
        x, got = results[op]
        bits = torch.tensor([v]).view(torch.int32)
        return got[(x[: len(SPECIAL)].view(torch.int32) == bits).nonzero()[0, 0]].item()

    for op in OPS:
        assert math.isnan(at(op, math.nan)) and math.isnan(at(op, -math.nan)), op
    for op in ("expm1", "log1p", "tanh", "erf"):
        for zero in (0.0, -0.0):  # f(±0) = ±0, sign kept
            r = at(op, zero)
            assert r == 0.0 and math.copysign(1, r) == math.copysign(1, zero), op
    assert at("exp", 0.0) == at("exp", -0.0) == 1.0 and at("log", 0.0) == at("log", -0.0) == -math.inf
    assert at("exp", math.inf) == math.inf and at("exp", -math.inf) == 0.0 and at("exp", 88.7229) == math.inf
    assert at("exp", -103.9) == torch.exp(torch.tensor(-103.9)).item() > 0  # a denormal, not flushed
    assert at("exp", -103.98) == 0.0 and at("exp", 88.72283) < math.inf
    assert at("expm1", -math.inf) == -1.0 and at("expm1", math.inf) == math.inf and at("expm1", 100.0) == math.inf
    assert at("log", -1.0) != at("log", -1.0) and at("log", 0.0) == -math.inf and at("log", math.inf) == math.inf
    assert at("log", 1e-45) == pytest.approx(math.log(1.401298464324817e-45), rel=1e-7)
    assert math.isnan(at("log1p", -math.inf)) and at("log1p", -1.0) == -math.inf and at("log1p", 1e-20) == _f32(1e-20)
    for op in ("tanh", "erf"):
        assert at(op, math.inf) == 1.0 and at(op, -math.inf) == -1.0 and at(op, 10.0) == 1.0 and at(op, -20.0) == -1.0
    assert at("tanh", 1e-20) == _f32(1e-20) and at("tanh", -1e-45) == _f32(-1e-45)  # tanh(x) = x exactly for tiny x
    tiny = torch.tensor([1e-20, -1e-38])
    assert at("erf", 1e-20) == torch.erf(tiny)[0].item() and at("erf", -1e-38) == torch.erf(tiny)[1].item()


def test_loops_using_them_are_vectorised():
    ops = [*OPS, "sigmoid"]
    m = compile_kernels([elementwise_kernel(op, 4096) for op in ops])
    ir = m.optimized_ir
    assert re.search(r"<(8|16) x float>", ir)
    for fn in ("expf", "expm1f", "logf", "log1pf", "tanhf", "erff", "llvm.exp.f32", "llvm.log.f32"):
        assert not re.search(rf"call [^@]*@{re.escape(fn)}\(", ir), fn
    for op in ops:  # every kernel's loop body: vector fmuladd (the polynomials), not only scalar code
        body = re.search(rf"define [^@]*@{op}\(.*?\n}}", ir, re.S)
        assert body and re.search(r"@llvm\.fmuladd\.v(8|16)f32", body.group(0)), op
