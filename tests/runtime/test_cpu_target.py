"""target="cpu": every example model through generated machine code, against eager PyTorch."""

import threading

import pytest
import torch
from torch import nn

import sextant
from sextant.examples import EXAMPLES


def _fresh(args: tuple) -> tuple:
    return tuple(torch.randn_like(a) if a.dtype.is_floating_point else torch.randint_like(a, 0, int(a.max()) + 1)
                 for a in args)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_models_match_eager(name: str) -> None:
    model, args = EXAMPLES[name]()
    compiled = sextant.compile(model, args, target="cpu")
    for _ in range(2):
        fresh = _fresh(args)
        with torch.no_grad():
            expected = model(*fresh)
        torch.testing.assert_close(compiled(*fresh), expected, rtol=1e-4, atol=2e-5)


def test_outputs_are_fresh_tensors_and_calls_repeat() -> None:
    model, args = EXAMPLES["transformer-block"]()
    compiled = sextant.compile(model, args, target="cpu")
    a = compiled(*args)
    b = compiled(*args)
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, b)


def test_two_threads_give_the_same_results() -> None:
    model, args = EXAMPLES["mlp"]()
    compiled = sextant.compile(model, args, target="cpu")
    inputs = [_fresh(args) for _ in range(4)]
    expected = [compiled(*x) for x in inputs]
    results: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        for _ in range(5):
            results[k] = compiled(*inputs[k])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        assert torch.equal(results[k], expected[k])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_transformer_block(dtype: torch.dtype) -> None:
    model, (x,) = EXAMPLES["transformer-block"]()
    model, x = model.to(dtype), x.to(dtype)
    compiled = sextant.compile(model, (x,), target="cpu")
    fresh = torch.randn_like(x)
    with torch.no_grad():
        expected = model(fresh).float()
    torch.testing.assert_close(compiled(fresh).float(), expected, rtol=3e-2, atol=3e-2)


def test_bad_call_on_cpu_target() -> None:
    compiled = sextant.compile(nn.Linear(4, 2), (torch.randn(3, 4),), target="cpu")
    with pytest.raises(ValueError, match=r"argument 'input': expected shape \[3, 4\], got \[2, 4\]"):
        compiled(torch.randn(2, 4))


def test_non_contiguous_inputs() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1)).eval()
    x = torch.randn(8, 4).t()  # a transposed view
    compiled = sextant.compile(model, (x.contiguous(),), target="cpu")
    torch.testing.assert_close(compiled(x), model(x))


def test_planned_peak_memory_is_reported() -> None:
    model, args = EXAMPLES["gpt2"]()
    compiled = sextant.compile(model, args, target="cpu")
    peak = compiled.planned_peak_bytes
    logits = 1 * 32 * 1000 * 4
    assert logits < peak < 64 * logits  # outputs plus a reused arena, far below the sum of all temps
    program = compiled.stages["program"]
    all_temps = sum(b.nbytes for b in program.buffers if b.kind == "temp")
    assert program.arena_bytes < all_temps
    assert "kernels" in repr(compiled)
    assert sextant.compile(model, args, target="reference").planned_peak_bytes is None
