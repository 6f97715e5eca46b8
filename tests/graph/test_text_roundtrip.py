"""The printer and parser round-trip: parse(print(g)) prints identically and computes the same."""

import pytest
import torch

import sextant
from sextant.examples import EXAMPLES
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.parser import ParseError, parse_graph
from sextant.graph.printer import print_graph
from sextant.graph.reference import run_graph
from sextant.graph.verifier import verify


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer-block"])
def test_roundtrip_models(name: str) -> None:
    model, args = EXAMPLES[name]()
    graph = sextant.capture(model, args)
    text = print_graph(graph)
    again = parse_graph(text, graph.params)
    verify(again)
    assert print_graph(again) == text
    fresh = [torch.randn_like(a) for a in args]
    torch.testing.assert_close(run_graph(again, fresh), run_graph(graph, fresh))


def test_attribute_kinds_roundtrip() -> None:
    b = GraphBuilder("attrs")
    x = b.input("x", (4, 6), DType.f16)
    y = b.pad(x, (1, 0), (0, 2), float("-inf"))
    y = b.slice(y, 1, 7, 4, -2)
    m = b.binary("eq", y, float("nan"))
    z = b.where(m, y, True and 0.5)
    i = b.cast(b.iota((5, 4), 1, DType.i32), DType.i64)
    g = b.build([z, i, b.full(True, (2,), DType.bool)])
    text = print_graph(g)
    assert 'value=-inf' in text and "value=nan" in text and "step=[1,-2]" in text and "value=true" in text
    assert print_graph(parse_graph(text)) == text


def test_parse_errors_name_the_line() -> None:
    good = "graph @g(%x: f32[2]) {\n  %0 = neg(%x) : f32[2]\n  return (%0)\n}"
    assert str(parse_graph(good)).splitlines()[1] == "  %0 = neg(%x) : f32[2]"
    with pytest.raises(ParseError, match="line 2: %y used before"):
        parse_graph(good.replace("neg(%x)", "neg(%y)"))
    with pytest.raises(ParseError, match="line 2: printed type f32\\[3\\]"):
        parse_graph(good.replace("neg(%x) : f32[2]", "neg(%x) : f32[3]"))
    with pytest.raises(ParseError, match="line 2: add takes 2 operands"):
        parse_graph(good.replace("neg(%x)", "add(%x)"))
    with pytest.raises(ParseError, match="missing 'return"):
        parse_graph(good.replace("  return (%0)\n", ""))


def test_locations_are_printed_and_parsed() -> None:
    text = 'graph @g(%x: f32[2]) {\n  %0 = exp(%x) : f32[2]  loc("model.py:7")\n  return (%0)\n}'
    g = parse_graph(text)
    assert g.nodes[1].loc == "model.py:7"
    assert print_graph(g) == text
    assert "loc(" not in print_graph(g, show_loc=False)
