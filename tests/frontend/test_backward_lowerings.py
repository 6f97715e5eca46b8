"""Backward ops Core ATen keeps whole (lowerings/backward.py): each lowered natively and equal to eager.

Direct tests call the ATen op itself in a module compiled with ``strict=True`` (an extern call
would be refused) and compare on fresh inputs; end-to-end tests train a step under
``torch.compile(backend="sextant")`` and check the gradients and that no graph calls an op as itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
import sextant.frontend.dynamo as dyn

aten = torch.ops.aten
TARGETS = ["cpu", pytest.param("cuda-sim", marks=pytest.mark.slow)]
# cases also run on cuda-sim in the fast suite (the rest there are marked slow)
SIM_FAST = {"2d-strided-grouped", "transposed-grouped", "avg2d-overlap-ceil-exclude-pad", "max3d-overlap-pad-ceil",
            "adaptive-max2d", "gqa-causal"}


def cases(names: list[str]) -> list[Any]:
    """(name, target) for every case on cpu and cuda-sim; cuda-sim slow unless in ``SIM_FAST``."""
    return [pytest.param(n, t, id=f"{n}-{t}", marks=() if t == "cpu" or n in SIM_FAST else pytest.mark.slow)
            for n in names for t in ("cpu", "cuda-sim")]
TOL = {"rtol": 1e-4, "atol": 1e-4}


class Op(nn.Module):
    """Calls ``op(*tensors[:lead], *fixed, *tensors[lead:], **kwargs)``: an ATen op with its
    non-tensor arguments fixed, so that export records them as constants."""

    def __init__(self, op: Any, *fixed: Any, lead: int = 2, **kwargs: Any) -> None:
        super().__init__()
        self.op, self.fixed, self.lead, self.kwargs = op, fixed, lead, kwargs

    def forward(self, *t: torch.Tensor) -> Any:
        return self.op(*t[:self.lead], *self.fixed, *t[self.lead:], **self.kwargs)


def _check(module: Op, make: Callable[[], tuple[torch.Tensor, ...]], target: str, **tol: float) -> None:
    """Compiled natively (``strict``) for one sample, equal to eager on another."""
    compiled = sextant.compile(module, make(), target=target, strict=True)
    args = make()
    got, want = compiled(*args), module(*args)
    if isinstance(want, torch.Tensor):
        got, want = (got,), (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, **(tol or TOL))


# -- convolution_backward ----------------------------------------------------------------------------
CONV = {  # name: (spatial dims, Cin, Cout, kernel, stride, padding, dilation, groups, transposed, out padding)
    "2d": (2, 3, 4, 3, 1, 1, 1, 1, False, 0),
    "2d-strided-grouped": (2, 4, 6, 3, 2, 1, 1, 2, False, 0),
    "2d-depthwise-dilated": (2, 4, 4, 3, 2, 0, 2, 4, False, 0),
    "2d-depthwise-multiplier": (2, 4, 8, 3, 1, 1, 1, 4, False, 0),
    "2d-1x1-strided": (2, 3, 4, 1, 2, 0, 1, 1, False, 0),
    "1d": (1, 3, 4, 5, 3, 2, 1, 1, False, 0),
    "3d": (3, 2, 4, 3, 2, 1, 1, 1, False, 0),
    "transposed-grouped": (2, 4, 6, 3, 2, 1, 1, 2, True, 1),
    "transposed-1d": (1, 4, 2, 4, 2, 1, 1, 1, True, 0),
    "transposed-output-padding-over-stride": (2, 2, 4, 3, 1, 1, 2, 1, True, 1),
}
MASKS = {"all": (True, True, True), "weight": (False, True, False), "input": (True, False, False),
         "bias": (False, False, True)}


def _conv_case(name: str, mask: tuple[bool, bool, bool]) -> tuple[Op, Callable[[], tuple[torch.Tensor, ...]]]:
    sp, cin, cout, k, s, p, d, g, transposed, op = CONV[name]
    size = 5 if sp == 3 else 7
    x = torch.randn(2, cin, *([size] * sp))
    if transposed:
        w = torch.randn(cin, cout // g, *([k] * sp))
        y = getattr(F, f"conv_transpose{sp}d")(x, w, None, s, p, op, g, d)
    else:
        w = torch.randn(cout, cin // g, *([k] * sp))
        y = getattr(F, f"conv{sp}d")(x, w, None, s, p, d, g)
    module = Op(aten.convolution_backward.default, lead=3, bias_sizes=[cout], stride=[s] * sp, padding=[p] * sp,
                dilation=[d] * sp, transposed=transposed, output_padding=[op] * sp, groups=g,
                output_mask=list(mask))
    return module, lambda: (torch.randn(y.shape), torch.randn(x.shape), torch.randn(w.shape))


@pytest.mark.parametrize(("name", "target"), cases(list(CONV)))
def test_convolution_backward(name: str, target: str) -> None:
    _check(*_conv_case(name, MASKS["all"]), target)


@pytest.mark.parametrize("mask", [m for m in MASKS if m != "all"])
def test_convolution_backward_output_mask(mask: str) -> None:
    """A gradient not asked for is None, and not computed (eager's CPU kernel computes the weight gradient
    along with the bias's anyway: only the gradients asked for are compared)."""
    module, make = _conv_case("2d-strided-grouped", MASKS[mask])
    compiled = sextant.compile(module, make(), target="cpu", strict=True)
    args = make()
    for asked, got, want in zip(MASKS[mask], compiled(*args), module(*args)):
        if asked:
            torch.testing.assert_close(got, want, **TOL)
        else:
            assert got is None
    graph = sextant.capture(module, make(), strict=True)
    assert [n.op for n in graph.nodes].count("conv") == sum(MASKS[mask][:2])


def test_convolution_backward_is_two_convs() -> None:
    """Input and weight gradients are convolutions (implicit GEMMs), the bias gradient a reduction."""
    module, make = _conv_case("2d-strided-grouped", MASKS["all"])
    ops = [n.op for n in sextant.capture(module, make(), strict=True).nodes]
    assert ops.count("conv") == 2 and "extern" not in ops and "reduce" in ops


# -- pooling -----------------------------------------------------------------------------------------
def _avg(sp: int, size: tuple[int, ...], k: int, s: int, p: int, ceil: bool, include: bool, div: int | None = None):
    x = torch.randn(2, 3, *size)
    y = getattr(F, f"avg_pool{sp}d")(x, k, s, p, ceil, include, div)
    op = aten.avg_pool2d_backward.default if sp == 2 else aten.avg_pool3d_backward.default
    module = Op(op, [k] * sp, [s] * sp, [p] * sp, ceil, include, div)
    return module, lambda: (torch.randn(y.shape), torch.randn(x.shape))


def _max(sp: int, size: tuple[int, ...], k: int, s: int, p: int, d: int, ceil: bool):
    def make() -> tuple[torch.Tensor, ...]:
        x = torch.randn(2, 3, *size).round()  # ties: the saved index picks which input gets the gradient
        y, idx = getattr(F, f"max_pool{sp}d")(x, k, s, p, d, ceil, return_indices=True)
        return torch.randn(y.shape), x, idx

    op = aten.max_pool2d_with_indices_backward.default if sp == 2 else aten.max_pool3d_with_indices_backward.default
    return Op(op, [k] * sp, [s] * sp, [p] * sp, [d] * sp, ceil), make


def _adaptive(kind: str, size: tuple[int, ...], out: tuple[int, ...]):
    sp = len(size)

    def make() -> tuple[torch.Tensor, ...]:
        x = torch.randn(2, 3, *size).round()
        if kind == "avg":
            return torch.randn(getattr(F, f"adaptive_avg_pool{sp}d")(x, out).shape), x
        y, idx = getattr(F, f"adaptive_max_pool{sp}d")(x, out, return_indices=True)
        return torch.randn(y.shape), x, idx

    op = {"avg": f"_adaptive_avg_pool{sp}d_backward", "max": f"adaptive_max_pool{sp}d_backward"}[kind]
    return Op(getattr(aten, op).default), make


POOLS: dict[str, Callable[[], tuple[Op, Callable[[], tuple[torch.Tensor, ...]]]]] = {
    "avg2d-tiling": lambda: _avg(2, (8, 8), 2, 2, 0, False, True),
    "avg2d-overlap-ceil-exclude-pad": lambda: _avg(2, (7, 9), 3, 2, 1, True, False),
    "avg2d-overlap-ceil-include-pad": lambda: _avg(2, (7, 9), 3, 2, 1, True, True),
    "avg2d-divisor-override": lambda: _avg(2, (6, 6), 3, 1, 1, False, True, 5),
    "avg3d": lambda: _avg(3, (4, 5, 6), 2, 2, 1, True, True),
    "max2d": lambda: _max(2, (8, 8), 2, 2, 0, 1, False),
    "max2d-overlap-pad-ceil": lambda: _max(2, (9, 7), 3, 2, 1, 1, True),
    "max2d-dilated": lambda: _max(2, (9, 9), 3, 1, 1, 2, False),
    "max3d-overlap-pad-ceil": lambda: _max(3, (5, 6, 7), 3, 2, 1, 1, True),
    "adaptive-avg2d": lambda: _adaptive("avg", (7, 10), (3, 4)),
    "adaptive-avg2d-tiling": lambda: _adaptive("avg", (8, 8), (4, 1)),
    "adaptive-avg3d": lambda: _adaptive("avg", (4, 5, 6), (2, 3, 4)),
    "adaptive-max2d": lambda: _adaptive("max", (7, 10), (3, 4)),
    "adaptive-max3d": lambda: _adaptive("max", (4, 5, 6), (2, 3, 4)),
}


@pytest.mark.parametrize(("name", "target"), cases(list(POOLS)))
def test_pool_backward(name: str, target: str) -> None:
    _check(*POOLS[name](), target, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pads", [(2, 3), (1, 2, 3, 0), (1, 1, 0, 2, 2, 1)], ids=["1d", "2d", "3d"])
def test_replication_pad_backward(pads: tuple[int, ...]) -> None:
    sp = len(pads) // 2
    x = torch.randn(2, 3, *[5, 4, 3][:sp])
    y = F.pad(x, pads, mode="replicate")
    op = getattr(aten, f"replication_pad{sp}d_backward").default
    _check(Op(op, list(pads)), lambda: (torch.randn(y.shape), torch.randn(x.shape)), "cpu")


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_cdist_backward(p: float) -> None:
    def make() -> tuple[torch.Tensor, ...]:
        a, c = torch.randn(2, 5, 3), torch.randn(2, 4, 3)
        c[0, 0] = a[0, 0]  # a zero distance
        c[1, 1, 0] = a[1, 2, 0]  # a zero difference in one coordinate
        return torch.randn(2, 5, 4), a, c, torch.cdist(a, c, p)

    _check(Op(aten._cdist_backward.default, p, lead=3), make, "cpu", rtol=1e-4, atol=1e-5)


# -- attention ---------------------------------------------------------------------------------------
def _fully_masked_row(dtype: torch.dtype) -> torch.Tensor:
    m = torch.randn(2, 1, 5, 6).to(dtype)
    m[:, :, 1] = -float("inf")
    return m


SDPA: dict[str, tuple[int, int, bool, float | None, Any, torch.dtype]] = {
    # name: (key/value heads, key length, is_causal, scale, mask factory, dtype); 4 query heads, 5 queries
    "plain": (4, 6, False, None, None, torch.float32),
    "causal": (4, 5, True, None, None, torch.float32),
    "causal-longer-keys-scale": (4, 9, True, 0.3, None, torch.float32),
    "gqa-causal": (2, 6, True, None, None, torch.float32),
    "float-mask-hidden-row": (4, 6, False, None, _fully_masked_row, torch.float32),
    "bf16-causal": (4, 6, True, None, None, torch.bfloat16),
}


@pytest.mark.parametrize(("name", "target"), cases(list(SDPA)))
def test_sdpa_flash_cpu_backward(name: str, target: str) -> None:
    hk, s, causal, scale, mask, dtype = SDPA[name]

    def make() -> tuple[torch.Tensor, ...]:
        q = torch.randn(2, 4, 5, 8, dtype=dtype)
        k, v = torch.randn(2, hk, s, 8, dtype=dtype), torch.randn(2, hk, s, 8, dtype=dtype)
        extra = () if mask is None else (mask(dtype),)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale,
                                                                    attn_mask=extra[0] if extra else None)
        return (torch.randn(out.shape, dtype=dtype), q, k, v, out, lse) + extra

    class Backward(nn.Module):
        def forward(self, go, q, k, v, out, lse, *mask: torch.Tensor):
            return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
                go, q, k, v, out, lse, 0.0, causal, attn_mask=mask[0] if mask else None, scale=scale)

    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else TOL
    _check(Backward(), make, target, **tol)  # type: ignore[arg-type]


def test_sdpa_backward_refuses_dropout() -> None:
    q = torch.randn(1, 2, 4, 8)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)
    module = Op(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, 0.1, False, lead=6)
    with pytest.raises(sextant.UnsupportedOpError, match=r"dropout_p=0\.1"):
        sextant.compile(module, (torch.randn_like(out), q, q, q, out, lse), target="cpu")


# -- end to end: a training step under torch.compile -----------------------------------------------
class ConvNet(nn.Module):
    """Conv (plain, strided depthwise, 1x1) + batch norm in training + max/avg/adaptive pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw, self.pw = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8), nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 3, 2, 1)
        x = F.avg_pool2d(F.gelu(self.pw(self.dw(x))), 2, ceil_mode=True)
        return self.fc(F.adaptive_avg_pool2d(x, 3).flatten(1))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)).mean(1)


def _train_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, options: dict | None) -> dict[str, Any]:
    """Loss and gradients of one step, compiled (``options``) or eager (None)."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    fn = torch.compile(model, backend="sextant", options=options) if options is not None else model
    loss = F.cross_entropy(fn(x), target)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"loss": loss.detach(), "x": x.grad, **grads}


def _check_training(make: Callable[[], nn.Module], shape: tuple[int, ...], classes: int, target: str) -> None:
    torch._dynamo.reset()
    dyn.STATS.reset()
    model = make()
    x, labels = torch.randn(shape), torch.randint(0, classes, (shape[0],))
    want = _train_step(copy.deepcopy(model), x, labels, None)
    got = _train_step(model, x, labels, {"target": target})
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    roles = {g.role for g in dyn.STATS.graphs}
    assert {"forward", "backward"} <= roles, dyn.STATS.graphs
    assert dyn.STATS.fallbacks == 0, [g.reason for g in dyn.STATS.graphs]
    assert all(not g.externs for g in dyn.STATS.graphs), [g.externs for g in dyn.STATS.graphs]


@pytest.mark.parametrize("target", TARGETS)
def test_train_convnet(target: str) -> None:
    _check_training(lambda: ConvNet().train(), (2, 3, 12, 12), 5, target)


@pytest.mark.parametrize("target", TARGETS)
def test_train_transformer_layer(target: str) -> None:
    _check_training(lambda: Encoder().train(), (2, 6, 16), 4, target)
