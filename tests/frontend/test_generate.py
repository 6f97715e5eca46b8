"""Hugging Face ``generate(cache_implementation="static")`` with ``torch.compile(backend="sextant")``.

The static cache's K/V tensors are arguments of Dynamo's graphs that ``forward()`` updates with
``index_copy_``: every graph (prefill and decode) must compile — no eager fallback — and the
tokens must equal eager's, at batch 1 and at batch 2 with left padding; the decode step's cache
rows are written in place (no full write-back of the K/V caches).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sextant.frontend import dynamo  # noqa: E402
from sextant.runtime.compiled import CompiledModule  # noqa: E402


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=128, num_hidden_layers=2, max_position_embeddings=128)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_positions=128, vocab_size=128, n_layer=2,
                                      bos_token_id=1, eos_token_id=2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    configs = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
               "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 16})}
    config, cls, extra = configs[family]
    cfg = config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 bos_token_id=1, eos_token_id=2, **common, **extra)
    return cls(cfg).eval()


@pytest.fixture
def compiled_modules(monkeypatch):
    made: list[CompiledModule] = []
    init = CompiledModule.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(CompiledModule, "__init__", record)
    dynamo.register()
    torch._dynamo.reset()
    dynamo.STATS.reset()
    yield made
    torch._dynamo.reset()


@pytest.mark.parametrize("family,target,batch", [
    ("llama", "cpu", 1), ("llama", "cpu", 2), ("qwen2", "cpu", 2), ("gemma", "cpu", 1), ("gpt2", "cpu", 2),
    pytest.param("llama", "cuda-sim", 2, marks=pytest.mark.slow),  # ~38 s; make test-slow
])
def test_static_cache_generate_compiles_every_graph(compiled_modules, family, target, batch):
    model = _model(family)
    ids = torch.randint(3, 128, (batch, 7))
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding, as generate() expects for decoder-only models
        ids[1, :3], mask[1, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        model.forward = torch.compile(model.forward, backend="sextant", options={"target": target})
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert dynamo.STATS.graphs and dynamo.STATS.fallbacks == 0, [g.reason for g in dynamo.STATS.graphs]
    decode = [c for c in compiled_modules if c.graph.inputs and c.graph.inputs[0].shape[-1] == 1]
    assert decode, "no one-token graph was compiled"
    for c in decode:  # the K/V caches (4-D) are updated in place; only small bookkeeping tensors are copied
        caches = [u for u in c.graph.mutations if c.graph.inputs[u.input].type.rank == 4]
        assert len(caches) == 2 * 2  # K and V of both layers
        assert c.stages["program"].describe().count("in place: 1 of") == len(caches)
