"""CompiledModule: calling conventions, pytree outputs, and clear errors for bad calls."""

import threading

import pytest
import torch
from torch import nn

import sextant


class Multi(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, *, scale: float = 2.0, mask=None) -> dict:
        h = self.lin(x) * scale
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return {"h": h, "extra": (h.sum(-1), ids * 2)}


def _args():
    return (torch.randn(2, 4), torch.arange(5)), {"scale": 3.0, "mask": torch.rand(2, 3) > 0.5}


def test_pytree_outputs_and_kwargs() -> None:
    model = Multi().eval()
    args, kwargs = _args()
    compiled = sextant.compile(model, args, kwargs, target="reference")
    x, ids = torch.randn(2, 4), torch.arange(5) + 3
    mask = torch.rand(2, 3) > 0.5
    out = compiled(x, ids, scale=3.0, mask=mask)
    ref = model(x, ids, scale=3.0, mask=mask)
    assert out.keys() == ref.keys()
    torch.testing.assert_close(out, ref)
    assert out["extra"][1].dtype == torch.int64


def test_kwargs_order_does_not_matter() -> None:
    model = Multi().eval()
    args, kwargs = _args()
    compiled = sextant.compile(model, args, kwargs, target="reference")
    out = compiled(*args, mask=kwargs["mask"], scale=3.0)
    torch.testing.assert_close(out, model(*args, **kwargs))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c, a, k: c(a[0], **k), "expected 2 positional argument"),
        (lambda c, a, k: c(torch.randn(3, 4), a[1], **k), "argument 'x': expected shape [2, 4], got [3, 4]"),
        (lambda c, a, k: c(a[0].double(), a[1], **k), "argument 'x': expected dtype torch.float32"),
        (lambda c, a, k: c(a[0], [1, 2], **k), "argument 'ids': expected a tensor"),
        (lambda c, a, k: c(*a, scale=5.0, mask=k["mask"]), "'scale' was 3.0 when the model was compiled"),
        (lambda c, a, k: c(*a, scale=3.0), "missing keyword argument"),
        (lambda c, a, k: c(*a, **k, bogus=1), "unexpected keyword argument"),
    ],
)
def test_bad_calls_raise_clear_errors(call, message: str) -> None:
    args, kwargs = _args()
    compiled = sextant.compile(Multi().eval(), args, kwargs, target="reference")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        call(compiled, args, kwargs)


def test_repeatable_and_thread_safe() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).eval()
    x = torch.randn(4, 8)
    compiled = sextant.compile(model, (x,), target="reference")
    first = compiled(x)
    results: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: results.append(compiled(x))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results:
        assert torch.equal(r, first)
    torch.testing.assert_close(first, model(x))


def test_inputs_are_not_modified() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    x = torch.randn(4, 8)
    keep = x.clone()
    sextant.compile(model, (x,), target="reference")(x)
    assert torch.equal(x, keep)


def test_default_target_is_the_inputs_device() -> None:
    model = torch.nn.Linear(4, 4).eval()
    x = torch.randn(2, 4)
    compiled = sextant.compile(model, (x,))
    assert compiled.target == "cpu"  # CPU tensors: native CPU code, not the reference interpreter
    torch.testing.assert_close(compiled(x), model(x))
