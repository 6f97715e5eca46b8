"""torch.compile(model, backend="sextant"): graphs from Dynamo, graph breaks, fallbacks, shape changes."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
import sextant.frontend.dynamo as dyn
from sextant.examples import EXAMPLES


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    dyn.STATS.reset()
    yield
    torch._dynamo.reset()


def _tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _check(module: nn.Module, args: tuple, **compile_kwargs) -> None:
    compiled = torch.compile(module, backend="sextant", **compile_kwargs)
    g = torch.Generator().manual_seed(3)
    fresh = tuple(torch.randn(a.shape, generator=g) if a.dtype.is_floating_point
                  else torch.randint(0, 50, a.shape, generator=g, dtype=a.dtype) for a in args)
    with torch.no_grad():
        got, want = _tensor(compiled(*fresh)), _tensor(module(*fresh))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples(name: str, target: str) -> None:
    kwargs = {"n_layer": 1, "n_embd": 64, "n_head": 2, "seq": 16} if name == "gpt2" else {}
    module, args = EXAMPLES[name](**kwargs)[:2]
    _check(module.eval(), args, options={"target": target})
    assert dyn.STATS.fallbacks == 0 and dyn.STATS.compiled >= 1
    assert {g.target for g in dyn.STATS.graphs} == {target}


def _small_resnet() -> tuple[nn.Module, tuple]:
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
    return ResNetModel(cfg).eval(), (torch.randn(1, 3, 32, 32),)


@pytest.mark.parametrize("name", ["llama", "bert", "resnet"])
def test_hf_models(name: str) -> None:
    from sextant.zoo import ZOO

    module, args = _small_resnet() if name == "resnet" else ZOO[name]()[:2]
    _check(module, args)  # the default target: the inputs' device (cpu here)
    assert dyn.STATS.fallbacks == 0
    assert {g.target for g in dyn.STATS.graphs} == {"cpu"}


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        print("a graph break")  # Dynamo cannot trace print: the graph is split here
        if y.sum() > 0:  # data-dependent branch: another break
            return self.b(y) * 2
        return self.b(y) - 1


def test_graph_breaks(capsys: pytest.CaptureFixture[str]) -> None:
    _check(Breaks().eval(), (torch.randn(4, 8),))
    assert "a graph break" in capsys.readouterr().out
    assert dyn.STATS.compiled >= 2 and dyn.STATS.fallbacks == 0


class Sorts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x * 2).abs() + 1  # a complex result: no lowering, and no extern call can hold it


def test_unsupported_graph_falls_back_with_a_logged_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sextant.dynamo"):
        _check(Sorts(), (torch.randn(4, 8),))
    assert dyn.STATS.fallbacks == 1 and "aten._fft_r2c" in dyn.STATS.graphs[0].reason
    assert "running a graph of" in caplog.text and "aten._fft_r2c" in caplog.text


def test_fallback_off_raises() -> None:
    compiled = torch.compile(Sorts(), backend="sextant", options={"fallback": False})
    with pytest.raises(Exception, match="cannot compile this graph"):
        compiled(torch.randn(4, 8))


def test_unknown_option() -> None:
    compiled = torch.compile(Sorts(), backend="sextant", options={"targte": "cpu"})
    with pytest.raises(Exception, match="unknown sextant backend option"):
        compiled(torch.randn(4, 8))


def test_shape_changes_capture_once() -> None:
    """Dynamo's automatic dynamic makes the graph shape-generic after a change: sextant captures it
    once with a symbolic batch, and compiles each new batch size below the graph IR once."""
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16)).eval()
    compiled = torch.compile(module, backend="sextant")
    with torch.no_grad():
        for batch in (2, 3, 5, 3, 5):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
    assert dyn.STATS.fallbacks == 0
    symbolic = [g for g in dyn.STATS.graphs if g.reason == "symbolic shapes: one capture"]
    assert len(symbolic) == 1 and not [g for g in dyn.STATS.graphs if "per concrete shape" in g.reason]


def test_size_input_not_a_tensor_dim_compiles_per_shape() -> None:
    """A size Dynamo passes that no tensor dimension holds cannot become a torch.export Dim: that
    graph still runs, compiled per concrete shape."""
    plan = dyn._size_plan(_graph_with_free_size())
    assert plan is None


def _graph_with_free_size() -> torch.fx.GraphModule:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n = env.create_unbacked_symint()
    g = torch.fx.Graph()
    p = g.placeholder("n")
    p.meta["example_value"] = n
    g.output(p)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_dynamic_true() -> None:
    module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)).eval()
    compiled = torch.compile(module, backend="sextant", dynamic=True)
    with torch.no_grad():
        for batch in (2, 7):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
    assert dyn.STATS.fallbacks == 0


def test_backend_callable_and_name() -> None:
    module = nn.Linear(4, 4).eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(module, backend=sextant.backend)(torch.ones(2, 4)),
                                   module(torch.ones(2, 4)))
    assert "sextant" in torch._dynamo.list_backends()


def test_entry_point_in_a_fresh_process() -> None:
    """backend="sextant" works without importing sextant first (the torch_dynamo_backends entry point)."""
    code = ("import torch\nm = torch.nn.Linear(4, 4)\nx = torch.randn(2, 4)\n"
            "y = torch.compile(m, backend='sextant')(x)\nassert torch.allclose(y, m(x), atol=1e-5)\n"
            "import sextant.frontend.dynamo as d\nassert d.STATS.compiled == 1, d.STATS\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


class _ConcatThenBreak(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, x * 2], 1)
        print("graph break")  # the point of the test
        return x.softmax(1) * x.shape[1]


def test_derived_sizes_after_a_graph_break_capture_once() -> None:
    """The graph after the break takes a tensor of size 2*s (a derived torch.export Dim) and uses
    its size as a float scale: both graphs are captured once and serve every size."""
    model = _ConcatThenBreak()
    compiled = torch.compile(model, backend="sextant", dynamic=True)
    for n in (3, 5, 8):
        x = torch.randn(2, n)
        torch.testing.assert_close(compiled(x), model(x))
    assert [g.reason for g in dyn.STATS.graphs] == ["symbolic shapes: one capture"] * 2


class _TensorPad(nn.Module):
    """Reflect padding by an amount held in a 0-d tensor, as Encodec's convolutions pad: torch.export
    reads the amount with ``.item()`` (a data-dependent size), so sextant cannot capture this graph."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pad", torch.tensor(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (self.pad, self.pad), mode="reflect")
        return x[..., : x.shape[-1] - 1] * 2


def test_failed_capture_leaves_dynamos_shape_env_alone() -> None:
    """The capture runs under its own fake mode: a graph it cannot capture falls back, and Dynamo's
    ShapeEnv gains no symbols or guards from the attempt. Before, torch.export ran in Dynamo's
    ShapeEnv, left unbacked symbols with no source there, and Dynamo's guard building for the frame
    failed ("sources must not be empty for symbol s78", or an IndexError), so the call raised."""
    changed = []

    def spy(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        env = torch._guards.TracingContext.get().fake_mode.shape_env
        before = set(env.var_to_range), len(env.guards)
        fn = dyn.sextant_backend(gm, example_inputs)
        changed.append((set(env.var_to_range), len(env.guards)) != before)
        return fn

    model = _TensorPad()
    for backend in (spy, "sextant"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        for n in (16, 20):  # the second length: Dynamo's automatic dynamic, symbolic sizes
            x = torch.randn(1, 2, n)
            torch.testing.assert_close(compiled(x), model(x))
    assert changed and not any(changed)
    assert dyn.STATS.fallbacks >= 1
    assert all("_local_scalar_dense" in g.reason for g in dyn.STATS.graphs if g.target is None)


@pytest.mark.slow  # ~27 s: a whole audio encoder through Dynamo
def test_encodec_encoder() -> None:
    """Encodec's encoder (transformers, small config, random weights): convolutions padded by
    data-dependent amounts (``_pad1d``), then an LSTM. torch.export cannot capture the padding, so
    Dynamo's graphs around it fall back and the rest compile; the model runs and matches eager, also
    at a second length (automatic dynamic)."""
    from transformers import EncodecConfig, EncodecModel

    torch.manual_seed(0)
    cfg = EncodecConfig(hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[2, 2],
                        codebook_size=32, codebook_dim=16, num_lstm_layers=1, audio_channels=1)
    encoder = EncodecModel(cfg).encoder.eval()
    compiled = torch.compile(encoder, backend="sextant")
    with torch.no_grad():
        for n in (200, 301):
            x = torch.randn(1, 1, n)
            torch.testing.assert_close(compiled(x), encoder(x), rtol=1e-4, atol=1e-4)
    assert dyn.STATS.compiled >= 1 and dyn.STATS.fallbacks >= 1


def test_an_internal_error_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception while compiling a graph — a bug in sextant, not only its own errors (a symbolic
    reshape it cannot prove, say) — costs that graph its compilation, never the user's call: the
    static graph, then the symbolic one after a shape change (per shape, then eagerly)."""
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(sextant, "compile", broken)
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    compiled = torch.compile(module, backend="sextant")
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), module(x))
    assert dyn.STATS.fallbacks == 2 and dyn.STATS.graphs
    assert all("internal error: KeyError: 'a bug'" in g.reason for g in dyn.STATS.graphs)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"cannot compile this (forward )?graph: internal error"):
        torch.compile(module, backend="sextant", options={"fallback": False})(torch.randn(2, 8))
