"""Scatter-add as a kernel: ``scatter(x, index, src) {reduce="add"}``.

``index_put(accumulate=True)`` (``index_add`` and the embedding backward decompose to it),
``scatter_add`` and ``scatter_reduce(sum)`` lower to an adding scatter: on the CPU a deterministic
walk of the positions in order per column, on the GPU atomic adds. Every case runs against eager
on fresh random inputs, many of them with far more source slices than positions, so repeated
positions must sum.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.ops import aten

import sextant
import sextant.frontend.dynamo as dyn
from sextant.errors import InputError
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.parser import ParseError, parse_graph
from sextant.graph.printer import print_graph
from sextant.graph.reference import run_graph

TARGETS = ["cpu", "cuda-sim"]


def _adding_scatters(compiled) -> list:
    return [n for n in compiled.graph.nodes if n.op == "scatter" and n.attr("reduce") == "add"]


def _check(module: nn.Module, make_args, target: str, runs: int = 3, **tol) -> sextant.CompiledModule:
    """Compile once, then compare with eager on ``runs`` fresh inputs."""
    compiled = sextant.compile(module, make_args(), target=target, cache=False)
    for _ in range(runs):
        args = make_args()
        torch.testing.assert_close(compiled(*args), module(*args), **tol)
    assert _adding_scatters(compiled), "lowered without an adding scatter"
    return compiled


# -- graph IR -----------------------------------------------------------------------------------------
TEXT = """graph @g(%x: f32[8,4], %i: i64[5], %s: f32[5,4]) {
  %0 = scatter(%x, %i, %s) {axis=0, reduce="add"} : f32[8,4]
  return (%0)
}"""


def test_text_round_trips():
    g = parse_graph(TEXT, {})
    assert g.nodes[-1].attr("reduce") == "add"
    assert print_graph(g).strip() == TEXT


@pytest.mark.parametrize("line, message", [
    ('scatter(%x, %i, %s) {axis=0, reduce="max"} : f32[8,4]', "reduce must be absent or"),
    ('scatter(%x, %i, %t) {axis=0, reduce="add"} : f32[8,4]', r"source must be f32\[5,4\]"),
    ('scatter(%b, %i, %c) {axis=0, reduce="add"} : bool[8,4]', "does not take a bool tensor"),
    ('scatter(%x, %s, %s) {axis=0, reduce="add"} : f32[8,4]', "index must be a 1-D integer"),
])
def test_verifier_rejects(line: str, message: str):
    text = ("graph @g(%x: f32[8,4], %i: i64[5], %s: f32[5,4], %t: f32[4,4], %b: bool[8,4], %c: bool[5,4]) {\n"
            f"  %0 = {line}\n  return (%0)\n}}")
    with pytest.raises(ParseError, match=message):
        parse_graph(text, {})


def test_builder_and_reference_sum_repeats():
    b = GraphBuilder("g")
    x, i, s = b.input("x", (6, 3), DType.f32), b.input("i", (7,), DType.i64), b.input("s", (7, 3), DType.f32)
    g = b.build([b.scatter(x, 0, i, s, reduce="add")])
    xv, iv, sv = torch.randn(6, 3), torch.tensor([1, 1, 5, 1, 0, 7, -1]), torch.randn(7, 3)
    (out,) = run_graph(g, [xv, iv, sv])
    keep = (iv >= 0) & (iv < 6)  # outside positions are dropped, as the kernels drop them
    torch.testing.assert_close(out, xv.index_add(0, iv[keep], sv[keep]))


# -- lowerings against eager ----------------------------------------------------------------------------
class IndexPutAccumulate(nn.Module):
    def forward(self, x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.index_put(x, (idx,), v, accumulate=True) * 2


@pytest.mark.parametrize("target", TARGETS)
def test_many_tokens_few_rows(target):
    """200 slices into 7 rows: every row is hit ~30 times, negative positions included."""
    _check(IndexPutAccumulate(), lambda: (torch.randn(7, 24), torch.randint(-7, 7, (200,)), torch.randn(200, 24)),
           target)


@pytest.mark.parametrize("target", TARGETS)
def test_nd_index_flattened(target):
    """A 2-D index tensor (a batch of token ids), as the embedding backward has."""
    _check(IndexPutAccumulate(), lambda: (torch.randn(9, 5), torch.randint(0, 9, (3, 17)), torch.randn(3, 17, 5)),
           target)


class InnerDim(nn.Module):
    def forward(self, x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aten.index_put.default(x, [None, idx], v, True)


@pytest.mark.parametrize("target", TARGETS)
def test_index_along_an_inner_dim(target):
    _check(InnerDim(), lambda: (torch.randn(3, 6, 4), torch.randint(0, 6, (11,)), torch.randn(3, 11, 4)), target)


class TwoIndexedDims(nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor, j: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aten.index_put.default(x, [i, None, j], v, True)


@pytest.mark.parametrize("target", TARGETS)
def test_two_indexed_dims_linearised(target):
    _check(TwoIndexedDims(), lambda: (torch.randn(4, 3, 5), torch.randint(0, 4, (30,)), torch.randint(-5, 5, (30,)),
                                      torch.randn(30, 3)), target)


class IndexAdd(nn.Module):
    def forward(self, x: torch.Tensor, idx: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x.index_add(1, idx, s, alpha=0.5)


@pytest.mark.parametrize("target", TARGETS)
def test_index_add(target):
    _check(IndexAdd(), lambda: (torch.randn(5, 4, 3), torch.randint(0, 4, (13,)), torch.randn(5, 13, 3)), target)


class ScatterAdd(nn.Module):
    def forward(self, x: torch.Tensor, idx: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x.scatter_add(1, idx, s) + torch.scatter_reduce(x, 0, idx[:, :3], s, "sum", include_self=False)


@pytest.mark.parametrize("target", TARGETS)
def test_scatter_add_per_element(target):
    """Per-element indices (not whole slices): a scatter of single elements of the flattened tensor;
    the index covers a corner of ``src``, as torch allows."""
    _check(ScatterAdd(), lambda: (torch.randn(6, 5), torch.randint(0, 5, (4, 9)), torch.randn(4, 10)), target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32])
def test_other_dtypes(target, dtype):
    """f16 and i32 add with native atomics on the GPU, bf16 by a compare-exchange loop."""
    def make():
        x = torch.randn(5, 8).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, (5, 8), dtype=dtype)
        v = torch.randn(40, 8).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, (40, 8), dtype=dtype)
        return x, torch.randint(0, 5, (40,)), v

    tol = {"rtol": 0.05, "atol": 0.3} if dtype.is_floating_point else {}
    _check(IndexPutAccumulate(), make, target, **tol)


class EmbeddingBackward(nn.Module):
    def __init__(self, vocab: int, padding_idx: int = -1) -> None:
        super().__init__()
        self.vocab, self.padding_idx = vocab, padding_idx

    def forward(self, grad: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return aten.embedding_dense_backward.default(grad, ids, self.vocab, self.padding_idx, False)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_embedding_dense_backward(target, padding_idx):
    _check(EmbeddingBackward(20, padding_idx), lambda: (torch.randn(2, 33, 16), torch.randint(0, 20, (2, 33))),
           target)


class Histogram(nn.Module):
    """A buffer accumulated in place: the program adds straight into the caller's tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(10, 3))

    def forward(self, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.h.index_put_((idx,), v, accumulate=True)
        return self.h.sum(1)


@pytest.mark.parametrize("target", TARGETS)
def test_buffer_accumulated_in_place(target):
    m, e = Histogram(), Histogram()
    compiled = sextant.compile(m, (torch.arange(4), torch.randn(4, 3)), target=target, cache=False)
    for _ in range(3):
        idx, v = torch.randint(-10, 10, (4,)), torch.randn(4, 3)
        torch.testing.assert_close(compiled(idx, v), e(idx, v))
        torch.testing.assert_close(m.h, e.h)
    assert compiled.full_write_backs == 0
    dump = compiled.stages["program"].describe()
    how = "in position order" if target == "cpu" else "by atomic adds"
    assert f"in place, adding: 4 slices into 10 positions along dim 0 of input %h (0.0 KiB of 0.1 KiB); " \
           f"repeats summed {how}" in dump
    with pytest.raises(InputError, match=r"position 10 .* \(allowed: -10\.\.9\)"):  # as the overwriting scatter
        compiled(torch.tensor([0, 10, 1, 2]), torch.randn(4, 3))


# -- determinism, size, code ----------------------------------------------------------------------------
def test_cpu_sum_is_in_position_order():
    """Bitwise equal between runs, and to adding the slices one after another in position order."""
    x, idx, v = torch.randn(6, 300), torch.randint(0, 6, (500,)), torch.randn(500, 300) * 1e3
    compiled = sextant.compile(IndexPutAccumulate(), (x, idx, v), target="cpu", cache=False)
    first, second = compiled(x, idx, v), compiled(x, idx, v)
    assert torch.equal(first, second)
    serial = x.clone()
    for k in range(len(idx)):
        serial[idx[k]] += v[k]
    assert torch.equal(first, serial * 2)


def test_embedding_backward_at_scale_is_linear_in_the_tokens():
    """vocab 32000 x 512 tokens x dim 768: ~12.6 G comparisons as a one-hot match, ~0.4 M adds here.
    No buffer is larger than the gradient table, and the launches' FLOPs stay near tokens x dim."""
    from sextant.report import program_costs

    vocab, tokens, dim = 32000, 512, 768
    grad, ids = torch.randn(1, tokens, dim), torch.randint(0, 64, (1, tokens))  # 64 rows: heavy repeats
    compiled = sextant.compile(EmbeddingBackward(vocab), (grad, ids), target="cpu", cache=False)
    torch.testing.assert_close(compiled(grad, ids), EmbeddingBackward(vocab)(grad, ids))
    program = compiled.stages["program"]
    assert max(b.node.type.numel for b in program.buffers) <= vocab * dim
    costs = program_costs(program)
    assert sum(c.flops for c in costs) < 16 * tokens * dim
    (scatter,) = [c for c in costs if c.kind == "scatter"]
    assert scatter.flops >= tokens * dim and scatter.bytes_written == tokens * dim * 4


def test_gpu_kernel_is_atomic_and_assembles():
    from sextant.codegen.ptxas import assemble
    from sextant.kernel.printer import print_kernel

    args = (torch.randn(7, 24), torch.randint(0, 7, (50,)), torch.randn(50, 24))
    compiled = sextant.compile(IndexPutAccumulate(), args, target="cuda-sim", arch="sm_80", cache=False)
    program = compiled.stages["program"]
    (kernel,) = [k for k in program.kernels.values() if k.name.startswith("scatter")]
    assert "atomic_add(&out0[" in print_kernel(kernel) and kernel.buffer("out0").role == "inout"
    ptx = compiled.stages["ptx"].ptx
    assert "atom.global.add.f32" in ptx or "red.global.add.f32" in ptx
    assert assemble(ptx, "sm_80").kernels[kernel.name].registers > 0


def test_dense_fallback_refuses_huge_matches():
    """What is not a sum (amax here) keeps the one-hot lowering only while it stays small."""
    from sextant.frontend.lowerings.registry import Unsupported
    from sextant.frontend.lowerings.scatter import scatter_reduce

    b = GraphBuilder("g")
    x, i, s = (b.input("x", (32000, 768), DType.f32), b.input("i", (512, 768), DType.i64),
               b.input("s", (512, 768), DType.f32))
    with pytest.raises(Unsupported, match="DENSE_LIMIT"):
        scatter_reduce(b, x, 0, i, s, "amax")
    assert scatter_reduce(b, x, 0, i, s, "sum").inputs[0].op == "scatter"  # a sum never needs the match


# -- training under torch.compile -----------------------------------------------------------------------
class EmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids))).square().mean()


@pytest.mark.parametrize("target", TARGETS)
def test_embedding_gradient_under_torch_compile(target):
    torch._dynamo.reset()
    dyn.STATS.reset()
    try:
        torch.manual_seed(0)
        eager = EmbeddingModel()
        mine = copy.deepcopy(eager)
        compiled = torch.compile(mine, backend="sextant", options={"target": target, "fallback": False})
        ids = torch.randint(0, 6, (3, 20))  # 60 tokens over 6 rows
        torch.testing.assert_close(compiled(ids), eager(ids))
        compiled(ids).backward()
        eager(ids).backward()
        for (name, p), q in zip(mine.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
        backward = [r for r in dyn.STATS.graphs if r.role == "backward"]
        assert backward and not backward[-1].externs and not dyn.STATS.graphs[-1].externs
    finally:
        torch._dynamo.reset()
