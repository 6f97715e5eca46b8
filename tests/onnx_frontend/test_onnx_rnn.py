"""ONNX RNN/GRU/LSTM against onnxruntime, for the attributes ONNX's node tests leave out:
bidirectional and reverse directions, layout=1, clip, sequence_lens (constant and a graph input),
peepholes, input_forget, linear_before_reset, non-default activations, and omitted outputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import sextant

from .models import make, value

ort = pytest.importorskip("onnxruntime")

T, N, IN, H = 4, 3, 5, 6  # sequence length, batch, input width, hidden size
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _model(op: str, layout: int = 0, *, direction: str = "forward", lens: list[int] | None = None,
           lens_input: bool = False, peephole: bool = False, outputs: tuple[str, ...] = ("Y", "Y_h", "Y_c"),
           seed: int = 0, **attrs: object):
    """One recurrent node with weights, bias and initial state(s); ``seed`` fixes the weights, so a layout=1
    model and its layout=0 twin (what onnxruntime runs: it lacks layout=1) compute the same function."""
    rng = np.random.default_rng(seed)
    dirs, g = (2 if direction == "bidirectional" else 1), GATES[op]
    inits = {"W": rng.standard_normal((dirs, g * H, IN)).astype(np.float32) / 2,
             "R": rng.standard_normal((dirs, g * H, H)).astype(np.float32) / 2,
             "B": rng.standard_normal((dirs, 2 * g * H)).astype(np.float32) / 2}
    state = [N, dirs, H] if layout else [dirs, N, H]
    inputs = [value("X", [N, T, IN] if layout else [T, N, IN]), value("h0", state)]
    names = ["X", "W", "R", "B", "", "h0"]
    if lens is not None:
        names[4] = "L"
        if lens_input:
            inputs.append(value("L", [N], TensorProto.INT32))
        else:
            inits["L"] = np.array(lens, np.int32)
    if op == "LSTM":
        inputs.append(value("c0", state))
        names.append("c0")
        if peephole:
            inits["P"] = rng.standard_normal((dirs, 3 * H)).astype(np.float32) / 2
            names.append("P")
    outputs = tuple(o for o in outputs if op == "LSTM" or o != "Y_c")
    node = helper.make_node(op, names, list(outputs), hidden_size=H, direction=direction, layout=layout, **attrs)
    shapes = {"Y": [N, T, dirs, H] if layout else [T, dirs, N, H], "Y_h": state, "Y_c": state}
    return make([node], inputs, [value(o, shapes[o]) for o in outputs if o], inits)


def _feeds(model, lens: list[int] | None, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = np.array(lens, np.int32) if vi.name == "L" else rng.standard_normal(shape).astype(np.float32)
    return feeds


def _onnxruntime(model, feeds: dict[str, np.ndarray], twin=None) -> list[np.ndarray]:
    if twin is None:
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    seq_major = {k: v.transpose(1, 0, 2) if v.ndim == 3 else v for k, v in feeds.items()}
    outs = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, seq_major)
    return [o.transpose(2, 0, 1, 3) if o.ndim == 4 else o.transpose(1, 0, 2) for o in outs]


CASES = [
    ("RNN", dict(direction="bidirectional", clip=0.8)),
    ("RNN", dict(direction="reverse", activations=["Relu"])),
    ("GRU", dict(direction="bidirectional", linear_before_reset=1)),
    ("GRU", dict(direction="reverse", clip=0.5, activations=["HardSigmoid", "Softsign"], activation_alpha=[0.3],
                 activation_beta=[0.6])),
    ("LSTM", dict(direction="bidirectional", peephole=True)),
    ("LSTM", dict(direction="forward", peephole=True, input_forget=1, clip=1.0)),
    ("LSTM", dict(direction="reverse", activations=["Sigmoid", "ScaledTanh", "Elu"], activation_alpha=[0.9, 0.7],
                  activation_beta=[1.2])),
]
CASE_IDS = ["rnn-bidirectional-clip", "rnn-reverse-relu", "gru-bidirectional-lbr", "gru-reverse-clip-activations",
            "lstm-bidirectional-peepholes", "lstm-input_forget-clip", "lstm-reverse-activations"]
LENS = [4, 2, 3]  # no zero lengths: for those onnxruntime's forward pass gives Y_h = 0, its reverse pass initial_h


@pytest.mark.parametrize("target", ["reference", "cpu"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize(("op", "attrs"), CASES, ids=CASE_IDS)
def test_matches_onnxruntime(op: str, attrs: dict, layout: int, target: str) -> None:
    model = _model(op, layout, **attrs)
    twin = _model(op, 0, **attrs) if layout else None
    feeds = _feeds(model, None, np.random.default_rng())
    _compare(sextant.compile_onnx(model, target=target)(**feeds), _onnxruntime(model, feeds, twin))


@pytest.mark.parametrize("target", ["reference", "cpu"])
@pytest.mark.parametrize("lens_input", [False, True], ids=["constant", "input"])
@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_sequence_lens(op: str, lens_input: bool, target: str) -> None:
    """Rows shorter than the sequence: zero outputs past their length, Y_h/Y_c from their last step."""
    model = _model(op, direction="bidirectional", lens=LENS, lens_input=lens_input)
    feeds = _feeds(model, LENS, np.random.default_rng())
    _compare(sextant.compile_onnx(model, target=target)(**feeds), _onnxruntime(model, feeds))


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_omitted_outputs(op: str) -> None:
    """Only Y_h requested (Y left empty): the translation builds just that output."""
    model = _model(op, direction="bidirectional", outputs=("", "Y_h"))
    feeds = _feeds(model, None, np.random.default_rng())
    _compare(sextant.compile_onnx(model, target="reference")(**feeds), _onnxruntime(model, feeds))


def _compare(got, want: list[np.ndarray]) -> None:
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4)
