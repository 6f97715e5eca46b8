"""ONNX models through the whole pipeline, checked against onnxruntime and eager PyTorch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import sextant
from sextant.examples import EXAMPLES
from sextant.frontend.onnx.eager import OnnxModel
from sextant.frontend.onnx.importer import graph_inputs

from .models import export, mlp_with_shape_glue

pytest.importorskip("onnxruntime")
TARGETS = ("cpu", "cuda-sim")


def _ort(model: onnx.ModelProto, feeds: list[np.ndarray]) -> list[np.ndarray]:
    names = [vi.name for vi in graph_inputs(model)]
    out = OnnxModel(model, names)(*[torch.from_numpy(f) for f in feeds])
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("target", TARGETS)
def test_helper_built_model_matches_onnxruntime(target: str) -> None:
    model = mlp_with_shape_glue()
    compiled = sextant.compile_onnx(model, target=target)
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    (want,) = _ort(model, [x])
    got = compiled(x)
    assert isinstance(got, np.ndarray) and got.shape == (4, 4, 8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the Shape → Gather → Concat chain is evaluated at compile time: no integer ops survive the passes
    assert not any(n.dtype.is_int for n in compiled.graph.nodes), compiled.graph


def _example(name: str) -> tuple[torch.nn.Module, tuple]:
    kwargs = {"n_layer": 1, "n_embd": 64, "n_head": 2, "seq": 16} if name == "gpt2" else {}
    module, args = EXAMPLES[name](**kwargs)[:2]
    return module.eval(), args if isinstance(args, tuple) else (args,)


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def exported(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, tuple, onnx.ModelProto]:
    module, args = _example(request.param)
    return request.param, module, args, export(module, args)


def _fresh(args: tuple) -> tuple:
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randn(a.shape, generator=g) if a.dtype.is_floating_point else
                 torch.randint(0, 50, a.shape, generator=g, dtype=a.dtype) for a in args)


@pytest.mark.parametrize("target", TARGETS)
def test_exported_examples_match_onnxruntime_and_eager(exported, target: str) -> None:
    name, module, args, model = exported
    compiled = sextant.compile_onnx(model, target=target)
    inputs = _fresh(args)
    got = compiled(*inputs)  # torch tensors in, torch tensors out
    got = list(got) if isinstance(got, tuple) else [got]
    want_ort = _ort(model, [a.numpy() for a in inputs])
    with torch.no_grad():
        eager = module(*inputs)
    eager = [t for t in torch.utils._pytree.tree_leaves(eager) if isinstance(t, torch.Tensor)]
    assert len(got) == len(want_ort)
    for g, w in zip(got, want_ort):
        np.testing.assert_allclose(g.numpy(), w, rtol=2e-4, atol=2e-4, err_msg=name)
    np.testing.assert_allclose(got[0].numpy(), eager[0].numpy(), rtol=2e-4, atol=2e-4, err_msg=name)


def test_f16_model_matches_onnxruntime() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64)).half()
    x = torch.randn(8, 32).half()
    model = export(module, (x,))
    compiled = sextant.compile_onnx(model, target="cpu")
    x = torch.randn(8, 32).half()
    (want,) = _ort(model, [x.numpy()])
    np.testing.assert_allclose(compiled(x).float().numpy(), want.astype(np.float32), rtol=1e-2, atol=1e-2)
