"""Real architectures with symbolic sizes (``sextant/zoo.py``: transformers models from small
configs, random weights): captured once, run on the reference target at two sizes against eager —
what the capture and the lowerings must handle beyond the Llama and ResNet of
``test_dynamic_shapes.py`` (sequence-length masks, two independent sequences, a length derived
from a convolution stack's stride, depthwise convolutions over a symbolic batch)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import sextant

pytest.importorskip("transformers")

BATCH = Dim("batch", min=1, max=8)
CASES = {
    # model: (dynamic_shapes for its *args, the sizes to call it at: one (batch, length) per input)
    "bert": (lambda: ({0: BATCH, 1: Dim("seq", min=2, max=128)},), [[(1, 5)], [(3, 37)]]),
    "t5": (lambda: {"input_ids": {0: BATCH, 1: Dim("src", min=2, max=64)},
                    "decoder_input_ids": {0: BATCH, 1: Dim("tgt", min=2, max=64)}},
           [[(1, 5), (1, 3)], [(3, 9), (3, 17)]]),
    "wav2vec2": (lambda: ({0: BATCH, 1: 20 * Dim("frames", min=3, max=204)},), [[(1, 60)], [(3, 140)]]),
    "mobilenet-v2": (lambda: ({0: BATCH},), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_model_with_symbolic_sizes(name: str) -> None:
    from sextant.zoo import ZOO

    model, args = ZOO[name]()
    spec, sizes = CASES[name]
    dims = spec()
    if isinstance(dims, tuple):
        dims = {"args": dims}
    if name == "mobilenet-v2":  # batch only: examples of batch 2, called at 1 and 3
        args = (torch.cat([args[0]] * 2),)
    cm = sextant.compile(model, args, target="reference", dynamic_shapes=dims)
    assert " where " in str(cm.graph).splitlines()[0]
    calls = sizes or [[(1, None)], [(3, None)]]
    with torch.no_grad():
        for call in calls:
            xs = []
            for a, (batch, length) in zip(args, call):
                if length is None:
                    xs.append(torch.randn(batch, *a.shape[1:]))
                elif a.dtype.is_floating_point:
                    xs.append(torch.randn(batch, length))
                else:
                    xs.append(torch.randint(0, 100, (batch, length)))
            torch.testing.assert_close(cm(*xs), model(*xs), rtol=1e-4, atol=1e-4)
    assert len(cm.stages["specializer"].modules) == len(calls)
