"""Pass registry, pipelines, print-after-all, tracing, and a randomised end-to-end check."""

from __future__ import annotations

import io
import itertools
import random

import pytest
import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node, make_node
from sextant.graph.parser import parse_graph
from sextant.graph.passes import FINALLY, FIRST, PIPELINES, run_pipeline, trace_pipeline
from sextant.graph.passes.cse import cse_key
from sextant.graph.passes.dce import live_nodes
from sextant.graph.passes.pipeline import PASSES, Pass
from sextant.graph.passes.simplify import simplifier
from sextant.graph.printer import print_graph
from sextant.graph.verifier import VerificationError

F32 = DType.f32


def _example() -> Graph:
    b = GraphBuilder()
    x = b.input("x", (2, 3), F32)
    w = b.param("w", torch.randn(3, 3))
    h = b.add(b.mul(x, 1.0), 0.0)
    wt = b.permute(b.permute(w, (1, 0)), (1, 0))
    y = b.matmul(h, b.mul(wt, b.add(b.full(1.0, (3, 3), F32), b.full(1.0, (3, 3), F32))))
    z = b.matmul(h, b.mul(wt, b.full(2.0, (3, 3), F32)))
    ramp = b.mul(b.cast(b.iota((2, 3), 1), F32), b.add(b.full(0.25, (2, 3), F32), b.full(0.25, (2, 3), F32)))
    return b.build([b.add(b.add(y, z), ramp)])


def test_default_pipeline(assert_equivalent):
    assert FIRST["default"] == ["expand_random"]
    assert PIPELINES["default"] == ["simplify", "constant_fold", "cse", "dce"]
    g = _example()
    g2 = run_pipeline(g)
    # The weight is no compile-time constant: it keeps its name and its scaling stays; the iota ramp folds.
    assert print_graph(g2) == (
        "graph @main(%x: f32[2,3]) {\n"
        '  %0 = param() {name="w"} : f32[3,3]\n'
        "  %1 = full() {value=2.0} : f32[3,3]\n"
        "  %2 = mul(%0, %1) : f32[3,3]\n"
        "  %3 = matmul(%x, %2) : f32[2,3]\n"
        '  %4 = param() {name="folded.0"} : f32[2,3]\n'
        "  %5 = add(%3, %3) : f32[2,3]\n"
        "  %6 = add(%5, %4) : f32[2,3]\n"
        "  return (%6)\n"
        "}")
    assert set(g2.params) == {"w", "folded.0"}
    assert g2.params["w"] is g.params["w"]
    torch.testing.assert_close(g2.params["folded.0"], torch.tensor([[0.0, 0.5, 1.0]] * 2))
    assert run_pipeline(g2) is g2  # already at the fixed point
    assert_equivalent(g, g2)


def test_print_after_all_prints_every_pass_in_parseable_form():
    g = _example()
    buf = io.StringIO()
    out = run_pipeline(g, print_after_all=True, stream=buf)
    text = buf.getvalue()
    headers = [ln for ln in text.splitlines() if ln.startswith("// ---- IR after ")]
    first = [f"// ---- IR after {p} ----" for p in FIRST["default"]]
    assert headers[:len(first)] == first
    assert headers[len(first):len(first) + 4] == [f"// ---- IR after {p} ----" for p in PIPELINES["default"]]
    # the passes run once first, rounds of the four passes (a last one that changes nothing), then
    # the passes run once at the end
    final = [f"// ---- IR after {p} ----" for p in FINALLY["default"]]
    assert headers[len(headers) - len(final):] == final
    rounds = len(headers) - len(final) - len(first)
    assert rounds % 4 == 0 and rounds >= 8
    last = text.split(headers[-1])[-1]
    assert last.strip() == print_graph(out)
    assert print_graph(parse_graph(last)) == print_graph(out)


def test_pass_list_runs_once_in_order():
    g = _example()
    trace = trace_pipeline(g, ["dce", "simplify"])
    assert [r.name for r in trace] == ["dce", "simplify"]
    assert [r.changed for r in trace] == [False, True]
    assert trace[1].nodes_before == len(g.nodes) and trace[1].nodes_after == len(trace[1].graph.nodes)
    assert trace[1].nodes_after > trace[1].nodes_before - 4  # dead operands are left for dce


def test_trace_reports_each_pass_until_fixed_point():
    g = _example()
    trace = trace_pipeline(g, "default")
    final = FINALLY["default"]
    assert [r.name for r in trace[len(trace) - len(final):]] == final
    assert not any(r.changed for r in trace[len(trace) - len(final):])  # no scatter here
    first = FIRST["default"]
    assert [r.name for r in trace[:len(first)]] == first and not any(r.changed for r in trace[:len(first)])
    trace = trace[len(first):len(trace) - len(final)]
    assert [r.name for r in trace] == PIPELINES["default"] * (len(trace) // 4)
    rounds = [trace[i:i + 4] for i in range(0, len(trace), 4)]
    assert len(rounds) >= 2
    assert all(any(r.changed for r in rnd) for rnd in rounds[:-1])  # stops after the first quiet round
    assert not any(r.changed for r in rounds[-1])
    for prev, r in itertools.pairwise(trace):
        assert r.nodes_before == prev.nodes_after
    assert trace[0].nodes_before == len(g.nodes)
    assert print_graph(trace[-1].graph) == print_graph(run_pipeline(g))
    assert len(trace_pipeline(g, "default", max_rounds=1)) == len(first) + 4 + len(final)


def test_verifier_runs_after_each_pass_and_names_it(monkeypatch):
    def broken(g: Graph) -> Graph:
        x = g.inputs[0]
        orphan = make_node("neg", [x])
        return g.with_nodes([n for n in g.nodes], [make_node("exp", [orphan])])  # uses an undefined node

    monkeypatch.setitem(PASSES, "broken", Pass("broken", broken, "emits invalid IR"))
    with pytest.raises(VerificationError, match="after pass 'broken'"):
        run_pipeline(_example(), ["simplify", "broken"])
    run_pipeline(_example(), ["simplify", "broken"], verify=False)  # opting out


def test_unknown_names_are_rejected():
    with pytest.raises(KeyError, match="unknown pipeline"):
        run_pipeline(_example(), "O9")
    with pytest.raises(KeyError, match="unknown pass"):
        run_pipeline(_example(), ["simplify", "licm"])


def test_every_registered_pass_has_a_doc():
    for name, p in PASSES.items():
        assert p.name == name and p.doc and "\n" not in p.doc


# ---- randomised: chains of real ops with identities sprinkled in ------------------------------

SHAPE = (2, 3, 4)


def _random_graph(seed: int) -> tuple[Graph, int]:
    """A random chain over two inputs; returns the graph and how many identities were inserted."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b = GraphBuilder(f"rand{seed}")
    x = b.input("x", SHAPE, F32)
    y = b.input("y", SHAPE, F32)
    cur = x
    identities = 0

    def other(like: Node) -> Node:
        choice = rng.randrange(4)
        if choice == 0 and like.shape == y.shape:
            return y
        if choice == 1:
            return b.param(f"p{len(b.params)}", torch.randn(like.shape, generator=gen))
        if choice == 2:  # a constant computed from iota (stage 2 folds it into a param)
            return b.cast(b.reshape(b.iota((like.type.numel,), 0), like.shape), F32)
        return b.full(rng.choice([0.5, 2.0, -1.5]), like.shape, F32)

    def real(n: Node) -> Node:
        kind = rng.randrange(9)
        if kind == 8:  # a broadcast constant, used as it is and through another op
            row = b.cast(b.iota((1, *n.shape[1:]), n.type.rank - 1), F32)
            e = b.expand(b.mul(row, b.full(0.25, row.shape, F32)), n.shape)
            return b.add(b.mul(n, e), b.unary("neg", e))
        if kind == 0:
            return b.unary(rng.choice(["neg", "tanh", "sin", "sigmoid", "abs"]), n)
        if kind == 1:
            return b.emit(rng.choice(["add", "sub", "mul", "maximum"]), [n, other(n)])
        if kind == 2:
            return b.permute(n, rng.sample(range(n.type.rank), n.type.rank))
        if kind == 3:
            return b.reshape(n, rng.choice([(24,), (6, 4), (4, 3, 2), (2, 12)]))
        if kind == 4:
            return b.cast(b.cast(n, DType.f16), F32)  # rounding: must stay
        if kind == 5:  # a constant subexpression to fold
            c = b.add(b.mul(other(n), b.full(0.5, n.shape, F32)), b.full(1.0, n.shape, F32))
            return b.mul(n, c)
        if kind == 6:  # duplicated work to merge
            return b.add(b.unary("tanh", n), b.unary("tanh", n))
        return b.emit("where", [b.emit("gt", [n, b.full(0.0, n.shape, F32)]), n, other(n)])

    def identity(n: Node) -> Node:
        s, r = n.shape, n.type.rank
        rules = [
            lambda: b.emit("add", [n, b.full(0.0, s, F32)]),
            lambda: b.emit("mul", [b.full(1.0, s, F32), n]),
            lambda: b.emit("div", [n, b.full(1.0, s, F32)]),
            lambda: b.emit("sub", [n, b.full(0.0, s, F32)]),
            lambda: b.emit("neg", [b.emit("neg", [n])]),
            lambda: b.emit("reshape", [b.emit("reshape", [n], shape=(n.type.numel,))], shape=s),
            lambda: b.emit("permute", [n], perm=tuple(range(r))),
            lambda: b.emit("expand", [n], shape=s),
            lambda: b.emit("cast", [n], dtype=F32),
            lambda: b.emit("slice", [n], start=(0,) * r, step=(1,) * r, size=s),
            lambda: b.emit("pad", [n], low=(0,) * r, high=(0,) * r, value=0.0),
            lambda: b.emit("concat", [n], axis=0),
            lambda: b.emit("where", [b.full(True, s, DType.bool), n, b.full(3.0, s, F32)]),
            lambda: b.emit("where", [b.emit("lt", [n, n]), n, n]),
            lambda: b.emit("add", [n, b.add(b.full(2.0, s, F32), b.full(-2.0, s, F32))]),  # 0 only after folding
        ]
        if r >= 2:
            perm = rng.sample(range(r), r)
            inverse = tuple(perm.index(i) for i in range(r))
            rules.append(lambda: b.emit("permute", [b.emit("permute", [n], perm=tuple(perm))], perm=inverse))
        return rng.choice(rules)()

    for _ in range(rng.randint(6, 14)):
        if rng.random() < 0.5:
            cur = identity(cur)
            identities += 1
        cur = real(cur)
    cur = identity(cur)
    return b.build([cur, b.reduce("sum", cur, (0,))]), identities + 1


@pytest.mark.parametrize("seed", range(40))
def test_random_chains_optimise_without_changing_results(seed, assert_equivalent):
    g, identities = _random_graph(seed)
    g2 = run_pipeline(g)
    assert_equivalent(g, g2, seed=seed)
    # The result is a fixed point of every pass: no identity left, no duplicates, nothing dead.
    assert all(simplifier.rewrite(n) is None for n in g2.nodes)
    assert len({cse_key(n) for n in g2.nodes}) == len(g2.nodes)
    assert len(live_nodes(g2) | set(g2.inputs)) == len(g2.nodes)
    # Weights are no constants: every one is still there, untouched. Everything computed from
    # constants alone (full, iota, params folded earlier) is folded, except the lazy broadcasts.
    originals = {n.attr("name") for n in g2.nodes if n.op == "param" and not n.attr("name").startswith("folded.")}
    assert originals == {n.attr("name") for n in g.nodes if n.op == "param"}
    assert all(g2.params[k] is g.params[k] for k in originals)
    constant: set[Node] = set()
    for n in g2.nodes:
        if n.op in ("full", "iota") or (n.op == "param" and n.attr("name") not in originals):
            constant.add(n)
        elif n.op not in ("input", "param") and all(i in constant for i in n.inputs):
            assert n.op == "expand", f"{n} was not folded"
            constant.add(n)
    assert len(g2.nodes) <= len(g.nodes) - identities
