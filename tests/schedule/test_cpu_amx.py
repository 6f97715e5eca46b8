"""bf16 matmuls on AMX tiles (schedule/cpu_amx.py), compiled for a CPU with AMX: on this machine's
AMX where it has them, else each tile matmul expanded into pair dots (kernel/tiles.py) — the same
kernels either way, checked against eager's bf16 on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import sextant
import sextant.schedule.target as target_mod
from sextant.host import host_amx
from sextant.kernel.ir import TileMatmul, iter_stmts

from .test_cpu_pairs import BF16_TOL
from .test_cpu_panels import Mlp  # Linear, GELU, Linear, plus a residual of the input's first columns


def compiled(model: nn.Module, *args: torch.Tensor, monkeypatch, amx: bool = True):
    """``model`` compiled for a CPU with AMX (``amx``), whatever this one has."""
    monkeypatch.setattr(target_mod, "host_amx", lambda: amx)
    monkeypatch.setenv("SEXTANT_CACHE", "0")
    return sextant.compile(model, args, target="cpu", cache=False)


def tile_matmuls(cm) -> list[str]:
    """Names of the kernels holding a tile matmul."""
    kernels = cm.stages["program"].kernels
    return [n for n, k in kernels.items() if any(isinstance(s, TileMatmul) for s in iter_stmts(k.body))]


def check(cm, model: nn.Module, *args: torch.Tensor) -> None:
    with torch.no_grad():
        torch.testing.assert_close(cm(*args), model(*args), **BF16_TOL)
        fresh = tuple(torch.randn_like(a) for a in args)  # not only the inputs it was compiled with
        torch.testing.assert_close(cm(*fresh), model(*fresh), **BF16_TOL)


@pytest.mark.parametrize("shape", [
    (1, 70, 64, 96, 64),  # ragged M: the last row tile starts earlier
    (2, 40, 96, 64, 80),  # batch as a reshape of the input read in place; N = 80 pads a column tile
    (1, 128, 256, 512, 256),  # whole tiles, several blocks
])
def test_bf16_mlp_on_amx_tiles_matches_eager(shape, monkeypatch):
    torch.manual_seed(0)
    b, m, k, hidden, n = shape
    model = Mlp(k, hidden, n).to(torch.bfloat16).eval()
    x = torch.randn(b, m, k).bfloat16()
    cm = compiled(model, x, monkeypatch=monkeypatch)
    assert len(tile_matmuls(cm)) == 2
    check(cm, model, x)


def test_tile_kernel_text(monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(64, 96).to(torch.bfloat16).eval()
    cm = compiled(model, torch.randn(70, 64).bfloat16(), monkeypatch=monkeypatch)
    (name,) = tile_matmuls(cm)
    kernel = cm.stages["program"].kernels[name]
    assert kernel.meta["mapping"] == "cpu-amx"
    assert kernel.meta["weight"] == "[6, 32, 16, 2] in pairs of K"
    from sextant.kernel.printer import print_kernel

    text = print_kernel(kernel)
    assert "tile_matmul_32x32x64(&tile[0], &in0[" in text
    assert "min(i0" in text  # the last row tile moved back inside M = 70


class Scaled(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * 2)


@pytest.mark.parametrize("model, x, why", [
    (nn.Linear(48, 64), torch.randn(64, 48), "K not a multiple of 32"),
    (nn.Linear(64, 64), torch.randn(16, 64), "fewer than 32 rows"),
    (Scaled(64, 64), torch.randn(64, 64), "A computed in the kernel"),
])
def test_other_bf16_matmuls_keep_the_vector_path(model, x, why, monkeypatch):
    torch.manual_seed(0)
    model = model.to(torch.bfloat16).eval()
    x = x.bfloat16()
    cm = compiled(model, x, monkeypatch=monkeypatch)
    assert not tile_matmuls(cm), why
    check(cm, model, x)


def test_f32_and_cpus_without_amx_keep_the_vector_path(monkeypatch):
    model = nn.Linear(64, 64).eval()
    assert not tile_matmuls(compiled(model, torch.randn(64, 64), monkeypatch=monkeypatch))
    bf = nn.Linear(64, 64).to(torch.bfloat16).eval()
    assert not tile_matmuls(compiled(bf, torch.randn(64, 64).bfloat16(), monkeypatch=monkeypatch, amx=False))


@pytest.mark.skipif(not host_amx(), reason="this CPU has no AMX tiles (amx-tile/amx-bf16), or Linux did not "
                                          "grant this process their state: the tests above ran them as pair dots")
def test_this_cpu_runs_bf16_matmuls_on_amx_by_default():
    torch.manual_seed(0)
    model = Mlp(256, 512, 256).to(torch.bfloat16).eval()
    x = torch.randn(1, 128, 256).bfloat16()
    cm = sextant.compile(model, (x,), target="cpu", cache=False)
    assert len(tile_matmuls(cm)) == 2
    check(cm, model, x)
