"""Bad input gets a clear error naming the cause."""

import pytest
import torch
from torch import nn

import sextant


class Sorts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cummin(x, 0).values  # line with an op sextant does not lower
        z = torch.fft.fft(y).real
        return z + x.cummax(0).values


def test_what_cannot_be_an_extern_call_is_still_refused() -> None:
    """cummin and cummax run as extern calls; the FFT's complex result cannot live in a buffer."""
    with pytest.raises(sextant.UnsupportedOpError) as info:
        sextant.capture(Sorts(), (torch.randn(8),))
    msg = str(info.value)
    assert "aten._fft_r2c.default" in msg and "complex" in msg and "test_errors.py:" in msg
    assert "aten.cummin.default" not in msg and "aten.cummax.default" not in msg


def test_all_unsupported_ops_reported_at_once() -> None:
    with pytest.raises(sextant.UnsupportedOpError) as info:
        sextant.capture(Sorts(), (torch.randn(8),), strict=True)
    msg = str(info.value)
    for op in ("aten.cummin.default", "aten._fft_r2c.default", "aten.cummax.default"):
        assert op in msg
    assert "test_errors.py:" in msg
    assert "torch.cummin(x, 0).values" in msg  # the user's source line
    assert "sextant/frontend/lowerings/" in msg  # where support would go
    ops = {item.op for item in info.value.items}
    assert {"aten.cummin.default", "aten.cummax.default"} <= ops


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


def test_export_failure_is_explained() -> None:
    with pytest.raises(sextant.ExportError) as info:
        sextant.capture(DataDependent(), (torch.randn(4),))
    assert "torch.export could not capture DataDependent" in str(info.value)
    assert info.value.__cause__ is not None


def test_float64_is_reported() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    with pytest.raises(sextant.UnsupportedOpError, match="float64"):
        sextant.capture(M(), (torch.randn(3, dtype=torch.float64),))


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        sextant.capture(lambda x: x, (torch.randn(2),))  # type: ignore[arg-type]


def test_unknown_target() -> None:
    with pytest.raises(ValueError, match="unknown target"):
        sextant.compile(nn.ReLU(), (torch.randn(2),), target="tpu")
