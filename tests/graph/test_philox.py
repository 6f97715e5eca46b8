"""Philox4x32-10 (``graph/philox.py``) and its graph-IR spelling (``passes/expand_random.py``).

The reference is checked against Random123's known-answer vectors; the expansion against the
reference bit for bit (uniform) on every backend, so a CPU run, a cuda-sim run and the reference
draw the same numbers for the same seed.
"""

from __future__ import annotations

import pytest
import torch

import sextant
from sextant.graph import philox
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.parser import parse_graph
from sextant.graph.passes import run_pipeline
from sextant.graph.passes.expand_random import expand_random
from sextant.graph.reference import run_graph

# Random123's kat_vectors for philox4x32_10: (counter, key) -> four words
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_reference_matches_known_answers(ctr, key, want) -> None:
    words = philox.philox4x32([torch.tensor([c]) for c in ctr], [torch.tensor([k]) for k in key])
    assert tuple(int(w) for w in words) == want


def _graph(shape: tuple[int, ...], dtype: DType, dist: str, count: int = 1):
    b = GraphBuilder("rng")
    x = b.input("x", shape, dtype)
    outs = [b.add(b.random(shape, dtype, dist), x) for _ in range(count)]
    return b.build(outs)


@pytest.mark.parametrize("dtype", [DType.f32, DType.f16, DType.bf16])
def test_expansion_is_the_reference_bit_for_bit(dtype: DType) -> None:
    g = _graph((3, 5, 7), dtype, "uniform", count=2)
    expanded = expand_random(g)
    assert "random" not in expanded.op_counts() and expanded.seed == g.seed
    x = torch.zeros(3, 5, 7, dtype=dtype.torch)
    for seed in (0, 1, 2**40 + 12345, 2**63 - 1):
        s = torch.tensor(seed, dtype=torch.int64)
        want, got = run_graph(g, [x, s]), run_graph(expanded, [x, s])
        for w, v in zip(want, got):
            assert torch.equal(w, v)
        assert not torch.equal(want[0], want[1]), "two random ops must draw different streams"
        assert float(want[0].min()) >= 0 and float(want[0].max()) < 1


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_backends_draw_the_reference_numbers(target: str) -> None:
    g = _graph((4, 33), DType.f32, "uniform")
    x = torch.randn(4, 33)
    compiled = sextant.compile_graph(g, target=target)
    s = torch.tensor(987654321987, dtype=torch.int64)
    assert torch.equal(compiled._executor([x, s])[0], run_graph(g, [x, s])[0])
    gn = _graph((4, 33), DType.f32, "normal")
    got = sextant.compile_graph(gn, target=target)._executor([x, s])[0]
    torch.testing.assert_close(got, run_graph(gn, [x, s])[0], rtol=1e-5, atol=1e-5)


def test_statistics_of_a_large_draw() -> None:
    u = philox.random(7, 0, (1 << 18,), torch.float32, "uniform")
    n = philox.random(7, 1, (1 << 18,), torch.float32, "normal")
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert abs(float(n.mean())) < 0.01 and abs(float(n.std()) - 1) < 0.01
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert float((hist - 1 / 16).abs().max()) < 0.003


def test_seed_line_prints_and_parses() -> None:
    g = _graph((2, 3), DType.f32, "normal")
    text = str(g)
    assert "random(%rng_seed) {dist=\"normal\", stream=0}" in text.replace("'", '"') and "seed %rng_seed" in text
    again = parse_graph(text)
    assert again.seed == g.seed and str(again) == text


def test_default_pipeline_expands_random_ops() -> None:
    g = run_pipeline(_graph((8,), DType.f32, "uniform"), "default")
    assert "random" not in g.op_counts() and g.seed == len(g.inputs) - 1


def test_counters_are_computed_not_folded_into_tables() -> None:
    """The element index and the rounds' products stay computations: constant folding must not
    turn them into i64 tables of the tensor's size (passes/constant_fold.py's run-time indices)."""
    g = run_pipeline(_graph((16, 32), DType.f32, "uniform", count=2), "default")
    assert not g.params, list(g.params)
    assert g.op_counts().get("iota", 0) >= 2
