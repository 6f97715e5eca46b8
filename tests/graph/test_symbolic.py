"""Symbolic sizes in the graph IR (``graph/symbolic.py``, ``graph/bind.py``): the size algebra,
the text form with its ``where`` clause, the verifier, the reference executor at several sizes,
and the errors a call with the wrong sizes gets."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.export import Dim

import sextant
from sextant.errors import InputError, UnsupportedOpError
from sextant.graph.bind import bind, is_symbolic_graph, solve
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.ops import TensorType
from sextant.graph.parser import ParseError, parse_graph
from sextant.graph.printer import print_graph
from sextant.graph.reference import run_graph
from sextant.graph.symbolic import SymbolicShapeError, SymDim, graph_symbols, parse_dim
from sextant.graph.verifier import VerificationError, verify

BATCH = SymDim.symbol("batch", 1, 8)
SEQ = SymDim.symbol("seq", 3, 512)


def test_size_algebra() -> None:
    n = BATCH * SEQ * 768
    assert str(n) == "768*batch*seq" and n // 768 == SEQ * BATCH and n // 768 != SEQ
    assert (SEQ + 1) - 1 == SEQ and 3 * SEQ - SEQ * 3 == 0 and isinstance(3 * SEQ - SEQ * 3, int)
    assert n.range() == (3 * 768, 8 * 512 * 768)
    assert SEQ >= 3 and SEQ > 2 and not SEQ < 3 and SEQ != 1 and BATCH >= 1
    assert hash(BATCH * SEQ) == hash(SEQ * BATCH)
    assert pickle.loads(pickle.dumps(n)) == n and parse_dim("2*seq+1", SEQ.bounds) == 2 * SEQ + 1
    assert (2 * SEQ + 1).subs({"seq": 10}) == 21


@pytest.mark.parametrize("ask", [lambda: BATCH > 4, lambda: int(SEQ), lambda: list(range(SEQ)),
                                 lambda: SEQ / 2, lambda: float(BATCH)])
def test_asking_for_a_value_names_the_size(ask) -> None:
    with pytest.raises(SymbolicShapeError, match=r"batch|seq"):
        ask()


def test_two_ranges_for_one_symbol_rejected() -> None:
    with pytest.raises(SymbolicShapeError, match="two ranges"):
        _ = SymDim.symbol("seq", 1, 4) + SEQ


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        z = (x.reshape(b * s, d) @ self.w).reshape(b, s, -1)
        return z[:, 1:].softmax(-1) + torch.arange(s - 1).float()[:, None] + x[:, -1:, :3].cumsum(1)


DYNAMIC = {"x": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=3, max=512)}}


@pytest.fixture(scope="module")
def graph():
    return sextant.capture(Model(), (torch.randn(2, 5, 4),), dynamic_shapes=DYNAMIC)


def test_capture_names_symbols_after_dims(graph) -> None:
    text = print_graph(graph)
    assert text.splitlines()[0] == "graph @Model(%x: f32[batch,seq,4]) where batch in [1, 8], seq in [3, 512] {"
    assert "reshape(%x) {shape=[batch*seq,4]} : f32[batch*seq,4]" in text
    assert ": f32[batch,seq-1,3]" in text and graph_symbols(graph) == (("batch", 1, 8), ("seq", 3, 512))


def test_text_roundtrip(graph) -> None:
    text = print_graph(graph)
    again = parse_graph(text, graph.params)
    verify(again)
    assert print_graph(again) == text
    x = torch.randn(3, 11, 4)
    torch.testing.assert_close(run_graph(again, [x]), run_graph(graph, [x]))


@pytest.mark.parametrize("shape", [(1, 3, 4), (3, 7, 4), (8, 129, 4)])
def test_reference_executor_at_each_size(graph, shape) -> None:
    x = torch.randn(shape)
    torch.testing.assert_close(run_graph(graph, [x])[0], Model.__call__(_model(graph), x))


def _model(graph) -> Model:
    m = Model()
    m.w.data.copy_(graph.params["w"])
    return m


def test_bind_gives_a_static_graph(graph) -> None:
    values = solve(graph, [(2, 9, 4)])
    assert values == {"batch": 2, "seq": 9}
    static = bind(graph, values)
    verify(static)
    assert not is_symbolic_graph(static) and static.inputs[0].shape == (2, 9, 4)
    assert "where" not in print_graph(static).splitlines()[0]


@pytest.mark.parametrize("shape,message", [
    ((9, 5, 4), r"dimension 0 is 9, outside the range .*batch in \[1, 8\]"),
    ((2, 2, 4), r"dimension 1 is 2, outside the range .*seq in \[3, 512\]"),
    ((2, 5, 5), r"has shape \[2, 5, 5\]; with batch=2, seq=5 the model needs \[2, 5, 4\]"),
    ((2, 5), r"has 2 dimensions"),
])
def test_wrong_sizes_are_named(graph, shape, message) -> None:
    with pytest.raises(InputError, match=message):
        solve(graph, [shape])


def test_one_symbol_two_sizes_rejected() -> None:
    b = GraphBuilder("two")
    x = b.input("x", (SEQ, 2), DType.f32)
    y = b.input("y", (SEQ, 2), DType.f32)
    g = b.build([b.add(x, y)])
    with pytest.raises(InputError, match="'y' dimension 0 is 5 but input 'x' dimension 0 is 4: both are the size seq"):
        solve(g, [(4, 2), (5, 2)])


def test_parser_rejects_undeclared_symbols() -> None:
    with pytest.raises(ParseError, match=r"line 1: .*undeclared symbol"):
        parse_graph("graph @g(%x: f32[n,4]) {\n  return (%x)\n}")
    with pytest.raises(ParseError, match="line 1: cannot read the symbol declaration"):
        parse_graph("graph @g(%x: f32[n,4]) where n from 1 to 4 {\n  return (%x)\n}")


def test_verifier_checks_symbolic_types() -> None:
    b = GraphBuilder("bad")
    x = b.input("x", (SEQ, 4), DType.f32)
    r = b.reshape(x, (4, SEQ))
    wrong = Node("reshape", (x,), (("shape", (4, SEQ)),), TensorType((SEQ, 4), DType.f32))
    g = b.build([r]).with_nodes([x, wrong], [wrong])
    with pytest.raises(VerificationError, match=r"stored type f32\[seq,4\] but its operands give f32\[4,seq\]"):
        verify(g)


def test_size_as_an_integer_value() -> None:
    """A size used as a tensor value (an index wrapped by the length) is an integer ``full``."""
    b = GraphBuilder("wrap")
    x = b.input("i", (SEQ,), DType.i64)
    g = b.build([b.add(x, SEQ)])
    assert "full() {value=seq} : i64[seq]" in print_graph(g)
    out, = run_graph(g, [torch.arange(5)])
    assert out.tolist() == [5, 6, 7, 8, 9]
    scaled = b.mul(b.input("y", (SEQ,), DType.f32), SEQ)  # x * x.shape[0]: an integer fill, cast
    assert scaled.inputs[1].op == "cast" and scaled.inputs[1].inputs[0].op == "full"
    with pytest.raises(SymbolicShapeError, match="as a bool value"):
        b.full(SEQ, (2,), DType.bool)


def test_lowering_that_needs_a_concrete_size_names_the_op() -> None:
    class Upsample(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.interpolate(x[None, None], scale_factor=2.0)[0, 0]

    with pytest.raises(UnsupportedOpError, match=r"aten.upsample_nearest2d.vec(.|\n)*not with symbolic sizes yet"):
        sextant.capture(Upsample(), (torch.randn(4, 3),), dynamic_shapes={"x": {0: Dim("n", min=2, max=64)}})


def test_derived_sizes_are_solved() -> None:
    """A symbol only seen in a derived size (torch.export's ``20*_seq``) is solved from it."""
    n = SymDim.symbol("n", 1, 100)
    b = GraphBuilder("derived")
    x = b.input("x", (2 * n + 1, 3), DType.f32)
    g = b.build([b.unary("exp", x)])
    assert solve(g, [(9, 3)]) == {"n": 4}
    with pytest.raises(InputError, match=r"dimension 0 is 8, which is not 2\*n\+1 for any whole n"):
        solve(g, [(8, 3)])


class Stats(nn.Module):
    """Means and (corrected) variances over a symbolic axis divide by a symbolic count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1) + x.var(1) + torch.var(x, 1, correction=0) + nn.functional.layer_norm(x, (x.shape[-1],))[:, 0]


@pytest.mark.parametrize("target", ["reference", "cpu", "cuda-sim"])
def test_symbolic_counts(target: str) -> None:
    cm = sextant.compile(Stats(), (torch.randn(2, 5, 8),), target=target,
                         dynamic_shapes={"x": {1: Dim("seq", min=2, max=64)}})
    assert "full() {value=seq}" in print_graph(cm.graph)
    for seq in (2, 13, 64):
        x = torch.randn(2, seq, 8)
        torch.testing.assert_close(cm(x), Stats()(x), rtol=1e-5, atol=1e-5)


def test_passes_run_on_symbolic_graphs() -> None:
    """The default pipeline on a symbolic graph: rewrites whose condition depends on a size's value
    decline, constant folding skips values whose size depends on a symbol; the result verifies and
    computes what the captured graph computes, at any size."""
    from sextant.examples import gpt2
    from sextant.graph.passes import run_pipeline

    model, (ids,) = gpt2(batch=2, seq=16)
    g = sextant.capture(model, (ids,), dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=8),
                                                                    1: Dim("seq", min=2, max=64)}})
    opt = run_pipeline(g)
    verify(opt)
    assert len(opt.nodes) < len(g.nodes) and is_symbolic_graph(opt)
    for shape in [(1, 5), (3, 33)]:
        x = torch.randint(0, 1000, shape)
        torch.testing.assert_close(run_graph(opt, [x]), run_graph(g, [x]), rtol=1e-5, atol=1e-5)


def test_dim_hints_are_named_after_their_argument() -> None:
    """``Dim.DYNAMIC``/``Dim.AUTO`` have no name: their symbols read ``x_dim0`` rather than torch's
    hash-named ``s77``; torch gives them a minimum of 2."""
    class Scores(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ x.transpose(-1, -2)).softmax(-1)

    g = sextant.capture(Scores(), (torch.randn(2, 5, 4),), dynamic_shapes={"x": {0: Dim.DYNAMIC, 1: Dim.AUTO}})
    assert print_graph(g).splitlines()[0] == ("graph @Scores(%x: f32[x_dim0,x_dim1,4]) where "
                                              "x_dim0 in [2, 2147483647], x_dim1 in [2, 2147483647] {")
    x = torch.randn(3, 7, 4)
    torch.testing.assert_close(run_graph(g, [x])[0], Scores()(x))


def test_nested_floors_are_one_size() -> None:
    """torch writes a stride-5-then-2 conv length as floor(floor(s/5)/2) - 1, a lowering floor(s/10) - 1."""
    import sympy

    from sextant.graph.symbolic import make_dim, sympy_symbol

    s = sympy_symbol("s")
    bounds = (("s", 1, 4000),)
    assert make_dim(sympy.floor(sympy.floor(s / 5) / 2) - 1, bounds) == make_dim(sympy.floor(s / 10) - 1, bounds)
    nested = make_dim(sympy.floor((sympy.floor((s - 3) / 5) + 1) / 2), bounds)
    for v in (1, 2, 7, 13, 99, 4000):
        assert nested.subs({"s": v}) == ((v - 3) // 5 + 1) // 2
