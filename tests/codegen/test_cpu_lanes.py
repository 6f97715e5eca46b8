"""Unrolled loops as vector code on the CPU (codegen/lanes.py, lane_builder.py).

``plan_lanes`` must accept exactly the loops whose iterations are independent, and the vector
code must compute what the scalar unrolling computes: every kernel below runs twice, vectorised
and with the vector path switched off, against torch."""

from __future__ import annotations

import re

import pytest
import torch

from sextant.codegen import compile_kernels, emit_module, llvm_cpu
from sextant.codegen.lanes import plan_lanes
from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    Binary,
    Buffer,
    Cast,
    Const,
    For,
    Kernel,
    Load,
    Select,
    Store,
    Unary,
    Var,
    add,
    c,
    mul,
)

F32, I32, BOOL = DType.f32, DType.i32, DType.bool
U = Var("u")


def f(v: float) -> Const:
    return Const(v, F32)


def unrolled(body: tuple, n: int = 32, start: int = 0) -> For:
    return For(U, c(start), c(start + n), 1, body, unroll=True)


# -- the analysis ---------------------------------------------------------------------------------
def test_gemm_column_loop_is_planned_as_vectors():
    b = Var("b")
    body = (Assign(b, Load("w", add(mul(Var("k"), c(64)), U), F32)),
            *[Store("acc", add(U, c(32 * r)), Binary("add", Load("acc", add(U, c(32 * r)), F32),
                                                      Binary("mul", Var(f"a{r}", F32), b, F32), F32))
              for r in range(4)])
    plan = plan_lanes(unrolled(body), 16)
    assert plan is not None and plan.width == 16 and plan.trips == 32
    assert plan.varying == {"u", "b"}


@pytest.mark.parametrize("why, body", [
    ("register carried between iterations", (Assign(Var("s", F32), Binary("add", Var("s", F32),
                                                                          Load("x", U, F32), F32)),)),
    ("store to one element from every lane", (Store("y", c(0), Load("x", U, F32)),)),
    ("strided store", (Store("y", mul(U, c(2)), Load("x", U, F32)),)),
    ("reads what the previous iteration wrote", (Store("a", add(U, c(1)), Load("a", U, F32)),)),
    ("distance unknown", (Store("a", U, Load("a", add(U, Var("k")), F32)),)),
    ("lane-dependent condition guards a load", (
        Store("y", U, Select(Binary("lt", U, Var("n"), BOOL), Load("x", add(U, c(100)), F32), f(0.0), F32)),)),
])
def test_dependent_or_unsafe_loops_stay_scalar(why, body):
    assert plan_lanes(unrolled(body), 16) is None, why


def test_accesses_a_trip_count_apart_are_independent():
    body = (Store("a", add(U, c(32)), Binary("add", Load("a", U, F32), Load("a", add(U, c(32)), F32), F32)),)
    assert plan_lanes(unrolled(body), 16) is not None


def test_width_follows_the_trip_count():
    body = (Store("y", U, Load("x", U, F32)),)
    assert plan_lanes(unrolled(body, 24), 16).width == 8
    assert plan_lanes(unrolled(body, 8), 16).width == 8
    assert plan_lanes(unrolled(body, 6), 16) is None  # 2 lanes: not worth a vector
    assert plan_lanes(For(U, c(0), c(32), 1, body), 16) is None  # not asked to unroll


# -- the code -------------------------------------------------------------------------------------
def run_both(kernel: Kernel, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
             monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    results = []
    for vector_bytes in (64, 0):  # 16 lanes, then the scalar unrolling
        monkeypatch.setattr(llvm_cpu, "host_vector_bytes", lambda v=vector_bytes: v)
        m = compile_kernels([kernel])
        assert ("<16 x" in m.llvm_ir) == bool(vector_bytes)  # the vector path was really taken
        outs = {k: v.clone() for k, v in outputs.items()}
        m.launch(kernel.name, [inputs[p.name] if p.name in inputs else outs[p.name] for p in kernel.params])
        results.append(outs)
    return results


def one_block(name: str, params: tuple[Buffer, ...], body: tuple, local: tuple[Buffer, ...] = ()) -> Kernel:
    return Kernel(name, params, (1, 1, 1), (1, 1, 1), body, local=local)


def test_vector_ir_is_emitted(monkeypatch):
    monkeypatch.setattr(llvm_cpu, "host_vector_bytes", lambda: 64)
    k = one_block("copy", (Buffer("x", F32, 64), Buffer("y", F32, 64, role="out")),
                  (unrolled((Store("y", U, Binary("mul", Load("x", U, F32), f(2.0), F32)),), 64),))
    text = str(emit_module([k]))
    assert len(re.findall(r"load <16 x float>", text)) == 4 and len(re.findall(r"store <16 x float>", text)) == 4
    assert "load float" not in text


def test_gemm_tile_in_lanes_matches_torch(monkeypatch):
    m_, n_, k_ = 4, 32, 8
    acc, b, kv = Buffer("acc", F32, m_ * n_, "local"), Var("b", F32), Var("k")
    a = [Var(f"a{r}", F32) for r in range(m_)]
    kstep = For(kv, c(0), c(k_), 1, (
        *[Assign(a[r], Load("A", add(mul(c(r), c(k_)), kv), F32)) for r in range(m_)],
        unrolled((Assign(b, Load("B", add(mul(kv, c(n_)), U), F32)),
                  *[Store("acc", add(U, c(n_ * r)), Binary("add", Load("acc", add(U, c(n_ * r)), F32),
                                                            Binary("mul", a[r], b, F32), F32)) for r in range(m_)]),
                 n_),
    ))
    body = (unrolled((Store("acc", U, f(0.0)),), m_ * n_), kstep,
            unrolled((Store("C", U, Load("acc", U, F32)),), m_ * n_))
    params = (Buffer("A", F32, m_ * k_), Buffer("B", F32, k_ * n_), Buffer("C", F32, m_ * n_, role="out"))
    kernel = one_block("gemm", params, body, (acc,))
    A, B = torch.randn(m_, k_), torch.randn(k_, n_)
    vec, scalar = run_both(kernel, {"A": A.flatten(), "B": B.flatten()}, {"C": torch.zeros(m_ * n_)}, monkeypatch)
    torch.testing.assert_close(vec["C"].view(m_, n_), A @ B)
    torch.testing.assert_close(vec["C"], scalar["C"], rtol=0, atol=0)


def test_math_casts_gathers_and_selects_in_lanes(monkeypatch):
    n = 32
    x, g, t = Load("x", U, F32), Load("x", mul(U, c(2)), F32), Var("t", F32)
    flag = Var("flag", BOOL)
    body = (
        Assign(t, Unary("tanh", Binary("add", Unary("exp", x, F32), g, F32), F32)),  # a gather: stride 2
        Store("y", U, Binary("maximum", Unary("erf", t, F32), Cast(Load("h", U, DType.f16), F32), F32)),
        Store("i", U, Binary("floordiv", Load("j", U, I32), c(3), I32)),
        Store("m", U, Binary("gt", x, f(0.0), BOOL)),
        Store("z", U, Select(flag, Load("x", add(U, c(n)), F32), f(-1.0), F32)),  # one condition: one arm runs
        Store("bf", U, Cast(x, DType.bf16)),
    )
    params = (Buffer("x", F32, 2 * n), Buffer("h", DType.f16, n), Buffer("j", I32, n), Buffer("y", F32, n, role="out"),
              Buffer("i", I32, n, role="out"), Buffer("m", BOOL, n, role="out"), Buffer("z", F32, n, role="out"),
              Buffer("bf", DType.bf16, n, role="out"))
    kernel = one_block("lanes", params, (Assign(flag, Binary("gt", Load("x", c(0), F32), f(-10.0), BOOL)),
                                         unrolled(body, n)))
    xs, h, j = torch.randn(2 * n), torch.randn(n).half(), torch.randint(-50, 50, (n,), dtype=torch.int32)
    outs = {"y": torch.zeros(n), "i": torch.zeros(n, dtype=torch.int32), "m": torch.zeros(n, dtype=torch.bool),
            "z": torch.zeros(n), "bf": torch.zeros(n, dtype=torch.bfloat16)}
    vec, scalar = run_both(kernel, {"x": xs, "h": h, "j": j}, outs, monkeypatch)
    x0 = xs[:n]
    tt = torch.tanh(torch.exp(x0) + xs[::2])
    torch.testing.assert_close(vec["y"], torch.maximum(torch.erf(tt), h.float()), rtol=1e-5, atol=1e-6)
    assert torch.equal(vec["i"], torch.div(j, 3, rounding_mode="floor"))
    assert torch.equal(vec["m"], x0 > 0)
    assert torch.equal(vec["z"], xs[n:] if xs[0] > -10 else torch.full((n,), -1.0))
    assert torch.equal(vec["bf"], x0.bfloat16())
    for k in outs:
        assert torch.equal(vec[k], scalar[k]), k


def test_registers_after_the_loop_hold_the_last_lane(monkeypatch):
    v, s = Var("v", F32), Var("s", F32)
    body = (unrolled((Assign(v, Binary("mul", Load("x", U, F32), f(3.0), F32)), Store("y", U, v)), 16),
            Assign(s, Binary("add", v, Cast(U, F32), F32)), Store("last", c(0), s))
    kernel = one_block("after", (Buffer("x", F32, 16), Buffer("y", F32, 16, role="out"),
                                 Buffer("last", F32, 1, role="out")), body)
    x = torch.randn(16)
    vec, scalar = run_both(kernel, {"x": x}, {"y": torch.zeros(16), "last": torch.zeros(1)}, monkeypatch)
    torch.testing.assert_close(vec["y"], x * 3)
    assert vec["last"].item() == scalar["last"].item() == pytest.approx(x[15].item() * 3 + 15)


def test_buffers_carry_alias_scopes_and_overlapping_writes_are_refused():
    from sextant.codegen.cpu_module import LaunchError

    k = one_block("copy", (Buffer("x", F32, 16), Buffer("y", F32, 16, role="out")),
                  (unrolled((Store("y", U, Load("x", U, F32)),), 16),))
    text = str(emit_module([k], vector_bytes=64))  # one 16-lane vector access each, whatever the host
    assert text.count("!alias.scope") == 2 and text.count("!noalias") == 2
    m = compile_kernels([k])
    t = torch.randn(24)
    with pytest.raises(LaunchError, match="overlap"):
        m.launch("copy", [t[:16], t[8:]])
