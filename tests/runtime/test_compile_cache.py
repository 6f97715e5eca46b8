"""The compile cache: hits, misses, what the key sees, corrupted entries, concurrent writers."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import sextant
from sextant.runtime import compile_cache


class Block(nn.Module):
    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16, eps=eps), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SEXTANT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SEXTANT_COMPILE_CACHE", "1")
    return tmp_path / "compiled"


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def test_miss_then_hit(cache_dir: Path) -> None:
    model, x = Block().eval(), torch.randn(4, 16)
    first = sextant.compile(model, (x,), target="cpu")
    assert first.stages["cache"]["hit"] is False and len(_entries(cache_dir)) == 1
    second = sextant.compile(model, (x,), target="cpu")
    assert second.stages["cache"]["hit"] is True
    fresh = torch.randn(4, 16)
    torch.testing.assert_close(second(fresh), model(fresh))
    torch.testing.assert_close(second(fresh), first(fresh), rtol=0, atol=0)


@pytest.mark.parametrize("change", ["weights", "shape", "target", "attribute", "training"])
def test_the_key_sees_what_decides_the_graph(cache_dir: Path, change: str) -> None:
    model, x = Block().eval(), torch.randn(4, 16)
    k = compile_cache.key(model, (x,), None, "cpu", None, "default")
    if change == "weights":
        with torch.no_grad():
            model.fc.bias[0] += 1
    elif change == "shape":
        x = torch.randn(5, 16)
    elif change == "attribute":
        model.norm.eps = 1e-3
    elif change == "training":
        model.train()
    target = "cuda-sim" if change == "target" else "cpu"
    assert compile_cache.key(model, (x,), None, target, None, "default") != k


def test_graph_modules_are_keyed_by_their_code(cache_dir: Path) -> None:
    a = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    b = torch.fx.symbolic_trace(nn.Sequential(nn.Tanh()))
    x = torch.randn(3)
    assert compile_cache.key(a, (x,), None, "cpu", None, "default") != \
        compile_cache.key(b, (x,), None, "cpu", None, "default")


def test_corrupted_entry_is_rejected_and_rebuilt(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, x = Block().eval(), torch.randn(4, 16)
    sextant.compile(model, (x,), target="cpu")
    (entry,) = _entries(cache_dir)
    weights = entry / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a weight
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="sextant.cache"):
        again = sextant.compile(model, (x,), target="cpu")
    assert "corrupted" in caplog.text
    assert again.stages["cache"]["hit"] is False  # rebuilt, never loaded
    torch.testing.assert_close(again(x), model(x))
    assert compile_cache.lookup(entry.name) is not None  # the rebuilt entry is sound


def test_a_second_writer_leaves_one_sound_entry(cache_dir: Path) -> None:
    model, x = Block().eval(), torch.randn(4, 16)
    compiled = sextant.compile(model, (x,), target="cpu")
    k = compiled.stages["cache"]["key"]
    compile_cache.store(k, compiled)  # as a concurrent process finishing second would
    assert [p.name for p in _entries(cache_dir)] == [k]
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # its temporary dir is gone
    assert compile_cache.lookup(k) is not None


def test_off_switches(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = Block().eval(), torch.randn(4, 16)
    sextant.compile(model, (x,), target="cpu", cache=False)
    assert not _entries(cache_dir)
    monkeypatch.setenv("SEXTANT_CACHE", "0")
    sextant.compile(model, (x,), target="cpu")
    assert not _entries(cache_dir)
    monkeypatch.setenv("SEXTANT_CACHE", "1")
    sextant.compile(model, (x,), target="reference")  # nothing to cache: no kernels
    assert not _entries(cache_dir)


def test_second_process_skips_capture_and_llvm(cache_dir: Path) -> None:
    code = ("import contextlib, torch, sextant\nfrom sextant.examples import EXAMPLES\n"
            "m, args = EXAMPLES['mlp']()\nstages = []\n"
            "hook = lambda s: (stages.append(s), contextlib.nullcontext())[1]\n"
            "c = sextant.compile(m, args, target='cuda-sim', progress=hook)\n"
            "torch.testing.assert_close(c(*args), m(*args))\nprint(stages, c.stages['cache']['hit'])\n")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert "'capture'" in runs[0].stdout and "False" in runs[0].stdout
    assert runs[1].stdout.strip() == "['cache'] True"  # no capture, no ptxas, no LLVM


class Product(nn.Module):
    """A product over a symbolic K: the CPU GEMM needs static K and N, so it compiles per binding."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(a @ b)


def test_symbolic_sizes_one_entry_per_binding(cache_dir: Path) -> None:
    """A module compiled per binding of its sizes stores each binding; a second compile (as a second
    process would) loads the bindings it has seen and compiles only the new one."""
    from torch.export import Dim

    model = Product()
    k = Dim("k", min=1, max=64)
    dims = {"a": {1: k}, "b": {0: k}}

    def args(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, n), torch.randn(n, 16)

    first = sextant.compile(model, args(8), target="cpu", dynamic_shapes=dims)
    assert "static N and K" in first.stages["per_binding"]
    for n in (3, 17):
        first(*args(n))
    assert len(_entries(cache_dir)) == 2
    second = sextant.compile(model, args(8), target="cpu", dynamic_shapes=dims)
    for n in (3, 17, 5):
        xs = args(n)
        torch.testing.assert_close(second(*xs), model(*xs))
    hits = {b: m.stages["cache"]["hit"] for b, m in second.stages["specializer"].modules.items()}
    assert hits == {(("k", 3),): True, (("k", 17),): True, (("k", 5),): False}
    other = sextant.compile(model, args(8), target="cpu",
                            dynamic_shapes={"a": {1: Dim("k", min=1, max=32)}, "b": {0: Dim("k", min=1, max=32)}})
    other(*args(3))  # other ranges: other entries
    assert other.stages["specializer"].modules[(("k", 3),)].stages["cache"]["hit"] is False


def test_symbolic_cpu_program_reuses_cached_objects(cache_dir: Path) -> None:
    """On the cpu target one program serves every size (its kernels take the sizes as arguments): it
    is not a compile-cache entry (an artifact holds a static program), but a second compile finds
    every kernel's machine code in the object cache and skips LLVM."""
    from torch.export import Dim

    model = Block().eval()
    dims = {"x": {0: Dim("rows", min=1, max=64)}}
    first = sextant.compile(model, (torch.randn(4, 16),), target="cpu", dynamic_shapes=dims)
    assert "specializer" not in first.stages and _entries(cache_dir) == []
    second = sextant.compile(model, (torch.randn(4, 16),), target="cpu", dynamic_shapes=dims)
    kernels = second.stages["program"].kernels
    assert second.stages["cpu_module"].cached_objects == len(kernels) > 0
    for rows in (1, 3, 64):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(second(x), model(x))


def test_dynamo_baked_constants_are_keyed(cache_dir: Path) -> None:
    """torch.compile(dynamic=True) passes a LayerNorm's eps as a float64 scalar input that sextant
    bakes into the graph: two graphs differing only in it must not share an entry."""
    import torch._dynamo

    import sextant.frontend.dynamo as dyn

    outs = []
    for eps in (1e-5, 0.5):
        torch._dynamo.reset()
        model = nn.LayerNorm(16, eps=eps).eval()
        x = torch.randn(3, 16)
        with torch.no_grad():
            got = torch.compile(model, backend="sextant", dynamic=True)(x)
            torch.testing.assert_close(got, model(x))
        outs.append(got)
    assert not torch.allclose(outs[0], outs[1])
    torch._dynamo.reset()
    dyn.STATS.reset()
