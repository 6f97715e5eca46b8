"""Range analysis, simplification and verification do work linear in the kernel's size.

Work is counted (:class:`sextant.work.WorkCounter`: statements stepped, facts changed, copied or
undone, registers forgotten, walks of the kernel, dependence edges, witness steps), not timed,
so the assertions hold on any machine. Each family of kernels grows one pattern that used to
cost work per statement proportional to the kernel (an environment copied at every branch, a
fact scan at every reassignment, a walk of the whole kernel per loop in a chain, a witness
search replaying the kernel per access): the work per statement must stay flat as it grows.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.kernel import simplify_kernel, verify_kernel
from sextant.kernel.exprs import statement_count
from sextant.kernel.flow import MAX_REGISTER_WALKS
from sextant.kernel.ir import Assign, Buffer, Const, Expr, For, If, Kernel, Load, Select, Stmt, Store
from sextant.kernel.verifier import WITNESS_SEARCHES, WITNESS_WORK_PER_STATEMENT
from sextant.kernel.witness import MAX_WORK
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target, gpu_target
from sextant.work import WorkCounter

from .samples import BID, F32, I32, TID, b, c, f, v

H = W = 16  # the input plane of the window kernels
SIZES = (25, 50, 100, 200)
GROWTH = 1.3  # work per statement may vary this much between the smallest and the largest kernel


def _and(*conds: Expr) -> Expr:
    out = conds[0]
    for x in conds[1:]:
        out = b("bitwise_and", out, x)
    return out


def _inside(x: Expr, n: int) -> Expr:
    return _and(b("ge", x, c(0)), b("lt", x, c(n)))


def padded_window(n: int) -> Kernel:
    """A depthwise-conv / pooling row over a window of ``n`` taps with asymmetric zero padding, as
    the CPU and GPU mappings emit it: per tap a bounds condition, a clamped load selected against
    zero, and a branch skipping tap rows outside the input; an integer tap counter reassigned
    every tap (its facts and every def reading it forgotten each time)."""
    r, ow, acc, cnt = v("r"), v("ow"), v("acc", F32), v("cnt")
    body: list[Stmt] = [Assign(acc, f(0)), Assign(cnt, c(0))]
    for t in range(n):
        kh, kw = t // 5 % 5, t % 5  # a 5x5 window, over and over
        ih, iw, inb, i, x = v(f"ih{t}"), v(f"iw{t}"), v(f"inb{t}", DType.bool), v(f"i{t}"), v(f"x{t}", F32)
        row = [
            Assign(iw, b("sub", b("add", b("mul", ow, c(2)), c(kw)), c(1))),
            Assign(inb, _inside(iw, W)),
            Assign(i, Select(inb, b("add", b("mul", ih, c(W)), iw), c(0), I32)),
            Assign(x, Load("in0", i, F32)),
            Assign(acc, b("add", acc, Select(inb, x, f(0), F32))),
            Assign(cnt, b("add", cnt, c(1))),
        ]
        body += [Assign(ih, b("sub", b("add", b("mul", b("fmod", r, c(8)), c(2)), c(kh)), c(1))),
                 If(_inside(ih, H), tuple(row))]
    body.append(Store("out0", b("add", b("mul", r, c(8)), ow), acc))
    loop = For(ow, c(0), c(8), 1, tuple(body))
    return Kernel("window", (Buffer("in0", F32, H * W, "global", "in"), Buffer("out0", F32, 64, "global", "out")),
                  (4, 1, 1), (1, 1, 1), (For(r, b("mul", BID, c(2)), b("add", b("mul", BID, c(2)), c(2)), 1,
                                             (loop,)),))


def many_branches(n: int) -> Kernel:
    """``n`` registers, then ``n`` guarded stores: every branch starts with all ``n`` facts live."""
    regs = [v(f"a{k}") for k in range(n)]
    body: list[Stmt] = [Assign(a, b("add", TID, c(k))) for k, a in enumerate(regs)]
    for k, a in enumerate(regs):
        body.append(If(b("lt", a, c(k + 16)), (Store("out0", b("sub", a, c(k)), f(k)),), (Store("out0", TID, f(-k)),)))
    return Kernel("branches", (Buffer("out0", F32, 64, "global", "out"),), (1, 1, 1), (32, 1, 1), tuple(body))


def loop_chain(n: int) -> Kernel:
    """``n`` loops, each bounding a register the next one reads (the register ranges need one more
    walk per link: at most MAX_REGISTER_WALKS are made), each adding into an accumulator."""
    acc, prev = v("acc"), None
    body: list[Stmt] = [Assign(acc, c(0))]
    for k in range(n):
        q, a = v(f"q{k}"), v(f"a{k}")
        value = b("add", q, c(1)) if prev is None else b("add", prev, c(1))
        body.append(For(q, c(0), c(4), 1, (Assign(a, value), Assign(acc, b("add", acc, q)))))
        prev = a
    body.append(Store("out0", TID, Const(0.0, F32)))
    return Kernel("chain", (Buffer("out0", F32, 32, "global", "out"),), (1, 1, 1), (32, 1, 1), tuple(body))


def unprovable(n: int) -> Kernel:
    """``n`` loads at ``i - (i / 64) * 64`` (in bounds, but not provably so): each one calls for a
    witness search, which replays the statements before it."""
    body: list[Stmt] = []
    for k in range(n):
        i, x = v(f"i{k}"), v(f"x{k}", F32)
        body += [Assign(i, b("add", TID, c(k))),
                 Assign(x, Load("in0", b("sub", i, b("mul", b("div", i, c(64)), c(64))), F32)),
                 Store("out0", TID, x)]
    return Kernel("unprovable", (Buffer("in0", F32, 64, "global", "in"), Buffer("out0", F32, 64, "global", "out")),
                  (1, 1, 1), (64, 1, 1), tuple(body))


def _work(kernel: Kernel) -> tuple[int, WorkCounter]:
    work = WorkCounter()
    simplified = simplify_kernel(kernel, work=work)
    verify_kernel(simplified, work=work)
    return statement_count(kernel.body), work


@pytest.mark.parametrize("family", [padded_window, many_branches, loop_chain])
def test_work_per_statement_stays_flat(family: Callable[[int], Kernel]) -> None:
    runs = [_work(family(n)) for n in SIZES]
    kinds = set(runs[-1][1].counts)
    assert {"ranges: steps", "ranges: fact changes", "simplify: statements", "verify: statements"} <= kinds
    small_n, small = runs[0]
    big_n, big = runs[-1]
    assert big_n >= 6 * small_n
    for kind in kinds:  # each on its own, so that one quadratic walk cannot hide in the sum
        per_small = small.counts.get(kind, 0) / small_n
        per_big = big.counts[kind] / big_n
        assert per_big <= GROWTH * per_small + 1e-9, (
            f"{kind}: {per_small:.2f} -> {per_big:.2f} per statement ({small_n} -> {big_n} statements)")
    assert big.total() / big_n <= GROWTH * small.total() / small_n


def _depthwise_kernels(k: int) -> list[Kernel]:
    """The kernels both targets schedule for EfficientNet's stride-2 depthwise conv: "same" padding,
    asymmetric (one more row and column after than before), a ``k × k`` window unrolled into taps."""
    g = GraphBuilder("dw")
    x = g.input("x", (2, 8, 16, 16), F32)
    lo, hi = (k - 2) // 2, (k - 1) - (k - 2) // 2
    padded = g.pad(x, (0, 0, lo, lo), (0, 0, hi, hi), 0.0)
    w = g.param("w", torch.randn(8, 1, k, k))
    y = g.emit("conv", [padded, w], stride=(2, 2), padding=(0, 0), dilation=(1, 1), groups=8)
    graph = g.build([y])
    return [kern for target in (cpu_target(cores=2, vector_bytes=32), gpu_target("sm_90"))
            for kern in schedule(graph, target).kernels.values()]


def test_depthwise_window_work_per_statement_stays_flat() -> None:
    """Scheduled kernels, not hand-built ones: the CPU mapping unrolls the window's taps, so its
    kernel grows with ``k²``; the work of simplifying and verifying again grows with it, no faster."""
    per: dict[int, float] = {}
    for k in (3, 5, 9, 13):
        stmts, total = 0, 0
        for kern in _depthwise_kernels(k):
            n, work = _work(kern)
            stmts, total = stmts + n, total + work.total()
        per[k] = total / stmts
        if k == 3:
            small = stmts
    assert stmts >= 4 * small  # the kernels did grow
    assert per[13] <= GROWTH * per[3], per


def test_register_walks_are_bounded() -> None:
    _, work = _work(loop_chain(200))
    assert work.counts["ranges: register walks"] <= 2 * MAX_REGISTER_WALKS  # simplify's and verify's


def test_witness_searches_share_a_budget_linear_in_the_kernel() -> None:
    for n in SIZES:
        stmts, work = _work(unprovable(n))
        budget = WITNESS_SEARCHES * MAX_WORK + WITNESS_WORK_PER_STATEMENT * stmts
        assert work.counts["verify: witness steps"] <= budget
    assert work.counts.get("verify: witness searches skipped", 0) > 0  # the largest ran out: it did not go on


def test_padded_window_still_simplifies_and_verifies() -> None:
    """The families are real kernels: the guards' facts prove every access in bounds."""
    kernel = padded_window(25)
    out = simplify_kernel(kernel)
    verify_kernel(out)
    assert statement_count(out.body) <= statement_count(kernel.body)
