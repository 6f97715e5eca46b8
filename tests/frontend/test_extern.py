"""Ops with no lowering run as extern calls: captured, printed, scheduled as barriers, run on every target."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
from sextant.graph.parser import parse_graph
from sextant.graph.reference import run_graph
from sextant.runtime.extern import ExternCallError


@torch.library.custom_op("sextant_test::row_scale", mutates_args=())
def row_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """A custom op with only a CPU kernel: each row scaled by its position plus ``factor``."""
    if x.device.type != "cpu":
        raise NotImplementedError("row_scale has a CPU kernel only")
    return x * (torch.arange(x.shape[0], dtype=x.dtype)[:, None] + factor)


@row_scale.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


class Ranked(nn.Module):
    """Ops with no lowering between kernels: kthvalue (two results), cummin over a permuted operand
    (stored first), cummax of an input."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).softmax(-1)
        value, index = torch.kthvalue(logits, 2, dim=-1)
        low = torch.cummin(logits.t(), dim=-1).values  # a permuted operand: stored first
        mixed = value * 3 + index.float() + low[:, -1].sum()
        return mixed, torch.cummax(x, 0).values + 1


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.sextant_test.row_scale(self.fc(x).relu(), 0.5)
        return self.fc(h) + x


MODELS = {"ranked": Ranked, "custom": Custom}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("target", ["reference", "cpu", "cuda-sim"])
def test_extern_ops_match_eager(name: str, target: str) -> None:
    model = MODELS[name]().eval()
    compiled = sextant.compile(model, (torch.randn(12, 16),), target=target, cache=False)
    assert "extern" in compiled.graph.op_counts()
    for _ in range(2):  # fresh inputs each call
        x = torch.randn(12, 16)
        with torch.no_grad():
            expected = model(x)
        got = compiled(x)
        for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple)
                        else (expected,)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_extern_node_text_round_trips_and_runs() -> None:
    model, x = Ranked().eval(), torch.randn(5, 16)
    graph = sextant.capture(model, (x,))
    text = str(graph)
    assert 'extern(' in text and 'fn="aten.kthvalue.default"' in text and "result=1" in text
    again = parse_graph(text, graph.params)
    assert str(again) == text
    for got, want in zip(run_graph(again, [x]), model(x)):
        torch.testing.assert_close(got, want)


def test_multi_result_op_is_one_call_in_the_schedule() -> None:
    compiled = sextant.compile(Ranked().eval(), (torch.randn(12, 16),), target="cpu", cache=False)
    program = compiled.stages["program"]
    calls = [la.extern.fn for la in program.launches if la.extern is not None]
    assert sorted(calls) == ["aten.cummax.default", "aten.cummin.default", "aten.kthvalue.default"]
    kth = next(la for la in program.launches if la.extern is not None and la.extern.fn == "aten.kthvalue.default")
    assert kth.extern.results == (0, 1)  # values and indices from one call
    dump = program.describe()
    assert "3 extern calls" in dump and "host call" in dump and "[aten.kthvalue.default]" in dump
    assert "test_extern.py:" in dump  # the source line of each call


def test_strict_keeps_the_refusal() -> None:
    with pytest.raises(sextant.UnsupportedOpError) as info:
        sextant.compile(Ranked().eval(), (torch.randn(4, 16),), target="cpu", strict=True, cache=False)
    assert "aten.kthvalue.default" in str(info.value) and "aten.cummin.default" in str(info.value)


class NonZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x > 0).float().sum() + x  # output size depends on the data


def test_data_dependent_output_size_is_a_clear_error() -> None:
    with pytest.raises((sextant.UnsupportedOpError, sextant.ExportError)) as info:
        sextant.capture(NonZero(), (torch.randn(6),))
    msg = str(info.value)
    assert "nonzero" in msg
    if isinstance(info.value, sextant.UnsupportedOpError):
        assert "data-dependent" in msg and "test_extern.py:" in msg


def test_an_extern_result_unlike_the_recorded_one_names_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    import sextant.graph.extern as extern

    compiled = sextant.compile(Custom().eval(), (torch.randn(12, 16),), target="cpu", cache=False)
    monkeypatch.setattr(extern, "call_extern", lambda *a, **k: [torch.zeros(3)])
    import sextant.runtime.extern as runtime_extern

    monkeypatch.setattr(runtime_extern, "call_extern", lambda *a, **k: [torch.zeros(3)])
    with pytest.raises(ExternCallError, match=r"sextant_test.row_scale.default.*test_extern.py:\d+.*recorded"):
        compiled(torch.randn(12, 16))


def test_the_report_lists_extern_calls() -> None:
    from sextant.report.html import render_report

    compiled = sextant.compile(Ranked().eval(), (torch.randn(12, 16),), target="cpu", cache=False)
    page = render_report(compiled)
    assert '<section id="externs">' in page and "aten.cummin.default" in page
    assert "torch.kthvalue(logits, 2, dim=-1)" in page  # the source line's code


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_extern_call_over_symbolic_sizes(target: str) -> None:
    """One program for every sequence length: the extern call's buffers take each call's sizes."""
    from torch.export import Dim

    class Cumulative(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cummax(self.fc(x), dim=1).values * 2

    model = Cumulative().eval()
    compiled = sextant.compile(model, (torch.randn(2, 10, 8),), target=target, cache=False,
                               dynamic_shapes={"x": {1: Dim("seq", max=64)}})
    assert compiled.stages.get("per_binding") is None  # one program, not a compile per size
    for seq in (1, 17, 64):
        x = torch.randn(2, seq, 8)
        torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_a_saved_module_keeps_its_extern_calls(target: str, tmp_path) -> None:
    model = Custom().eval()
    compiled = sextant.compile(model, (torch.randn(12, 16),), target=target, cache=False)
    compiled.save(tmp_path / "m")
    loaded = sextant.load(tmp_path / "m")
    assert any(la.extern is not None for la in loaded.stages["program"].launches)
    x = torch.randn(12, 16)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)
