"""GraphBuilder conveniences and the reference executor's primitive semantics, against torch."""

import pytest
import torch

from sextant.graph.builder import GraphBuilder, broadcast_shapes
from sextant.graph.dtypes import DType
from sextant.graph.reference import run_graph


def _run(build, *inputs: torch.Tensor) -> torch.Tensor:
    b = GraphBuilder("t")
    xs = [b.input(f"x{i}", tuple(t.shape), DType.from_torch(t.dtype)) for i, t in enumerate(inputs)]
    return run_graph(b.build([build(b, *xs)]), list(inputs))[0]


def test_broadcast_shapes() -> None:
    assert broadcast_shapes((3, 1), (4,)) == (3, 4)
    assert broadcast_shapes((), (2, 2)) == (2, 2)
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_shapes((3,), (4,))


def test_binary_broadcasts_and_casts() -> None:
    a, c = torch.randn(3, 1), torch.randint(0, 5, (4,))
    out = _run(lambda b, x, y: b.binary("add", x, y), a, c)
    torch.testing.assert_close(out, a + c.float())


def test_slice_negative_step_and_pad() -> None:
    x = torch.randn(5, 6)
    out = _run(lambda b, v: b.pad(b.slice(v, 1, 5, 3, -2), (1, 0), (0, 2), -1.0), x)
    picked = x[:, [5, 3, 1]]  # x[:, 5::-2] in numpy terms (torch has no negative-step slicing)
    expected = torch.nn.functional.pad(picked, (0, 2, 1, 0), value=-1.0)
    torch.testing.assert_close(out, expected)


def test_pad_negative_crops() -> None:
    x = torch.randn(4, 4)
    out = _run(lambda b, v: b.pad(v, (-1, 2), (0, -3), 0.0), x)
    torch.testing.assert_close(out, torch.nn.functional.pad(x, (2, -3, -1, 0)))


def test_take_matches_index_select() -> None:
    x, idx = torch.randn(4, 5, 6), torch.tensor([[3, 0], [4, 4]])
    out = _run(lambda b, v, i: b.take(v, 1, i), x, idx)
    torch.testing.assert_close(out, x[:, idx])


@pytest.mark.parametrize(("sa", "sb"), [((3,), (3,)), ((2, 3), (3,)), ((3,), (3, 4)), ((5, 2, 3), (3, 4)),
                                         ((1, 2, 3), (4, 3, 2))])
def test_matmul_torch_semantics(sa, sb) -> None:
    a, c = torch.randn(sa), torch.randn(sb)
    torch.testing.assert_close(_run(lambda b, x, y: b.matmul(x, y), a, c), torch.matmul(a, c))


def test_reduce_keepdim_and_mean() -> None:
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(_run(lambda b, v: b.reduce("max", v, [0, 2], keepdim=False), x), x.amax((0, 2)))
    torch.testing.assert_close(_run(lambda b, v: b.mean(v, [-1]), x), x.mean(-1, keepdim=True))


def test_integer_division_truncates_and_floordiv_floors() -> None:
    a, c = torch.tensor([7, -7, 7, -7]), torch.tensor([2, 2, -2, -2])
    torch.testing.assert_close(_run(lambda b, x, y: b.binary("div", x, y), a, c), torch.tensor([3, -3, -3, 3]))
    torch.testing.assert_close(_run(lambda b, x, y: b.binary("floordiv", x, y), a, c), torch.tensor([3, -4, -4, 3]))


def test_gather_and_iota() -> None:
    x = torch.randn(3, 5)
    idx = torch.randint(0, 5, (3, 2))
    torch.testing.assert_close(_run(lambda b, v, i: b.gather(v, 1, i), x, idx), torch.gather(x, 1, idx))
    b = GraphBuilder("iota")
    (out,) = run_graph(b.build([b.iota((2, 3), 1, DType.i32)]), [])
    assert torch.equal(out, torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32))


def test_half_precision_matmul_matches_torch() -> None:
    a, c = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(_run(lambda b, x, y: b.matmul(x, y), a, c), a @ c)


def test_param_name_taken_by_another_tensor_gets_a_suffix() -> None:
    b = GraphBuilder()
    w1 = b.param("w", torch.zeros(2))
    w2 = b.param("w", torch.ones(2))  # e.g. an ONNX initializer and a lowering's constant
    assert (w1.attr("name"), w2.attr("name")) == ("w", "w.1")
    assert torch.equal(b.params["w"], torch.zeros(2)) and torch.equal(b.params["w.1"], torch.ones(2))
