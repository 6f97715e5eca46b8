"""One compile for many sizes: ``sextant.compile(dynamic_shapes=...)`` and ``torch.compile(dynamic=True)``
capture a model once with symbolic batch/sequence sizes; every size in range then matches eager. On
cpu and cuda-sim one program serves every size (kernels take the sizes as arguments: one capture,
one LLVM compile, counted); where a mapping needs static sizes (the GPU's tensor-core kernels)
each new binding is compiled below the graph IR on first use."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import sextant
import sextant.api
import sextant.frontend.dynamo as dyn
from sextant.errors import ArtifactError, InputError

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sextant.zoo import _Logits

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return _Logits(LlamaForCausalLM(cfg).eval(), "logits", use_cache=False)


def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetModel

    from sextant.zoo import _calibrated, _Logits

    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
    return _calibrated(_Logits(ResNetModel(cfg), "pooler_output"), torch.randn(4, 3, 32, 32))


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts torch.export captures made through ``sextant.compile``."""
    count = [0]
    real = sextant.api.capture

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(sextant.api, "capture", counted)
    return count


@pytest.fixture
def llvm_compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts CPU code generations (``compile_kernels`` calls: one per program)."""
    import sextant.codegen.llvm_cpu as llvm_cpu

    count = [0]
    real = llvm_cpu.compile_kernels

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(llvm_cpu, "compile_kernels", counted)
    return count


def _one_program(cm: sextant.CompiledModule, llvm_compiles: list[int]) -> None:
    """The cpu module is one program whose kernels read the sizes as arguments, compiled once."""
    program = cm.stages["program"]
    assert "specializer" not in cm.stages and program.symbols
    assert any(k.sizes for k in program.kernels.values())
    assert llvm_compiles[0] == 1


LLAMA_SIZES = [(1, 1), (3, 7), (1, 64), (3, 129)]  # every batch in {1, 3} and seq in {1, 7, 64, 129}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_llama_one_compile_many_sizes(target: str, captures: list[int], llvm_compiles: list[int]) -> None:
    model = _llama()
    dims = {"args": ({0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=256)},)}
    cm = sextant.compile(model, (torch.randint(0, 1000, (2, 16)),), target=target, dynamic_shapes=dims)
    assert str(cm.graph).splitlines()[0].endswith("where batch in [1, 4], seq in [1, 256] {")
    with torch.no_grad():
        for batch, seq in LLAMA_SIZES + [(3, 7)]:  # the last one reuses its compile
            ids = torch.randint(0, 1000, (batch, seq))
            torch.testing.assert_close(cm(ids), model(ids), rtol=1e-4, atol=1e-4)
    assert captures[0] == 1
    _one_program(cm, llvm_compiles)  # cuda-sim: the GPU kernels (fp32: CUDA-core GEMMs), PTX assembled once
    with pytest.raises(InputError, match=r"dimension 1 is 300, outside the range .*seq in \[1, 256\]"):
        cm(torch.randint(0, 1000, (1, 300)))


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_resnet_one_compile_two_batches(target: str, captures: list[int], llvm_compiles: list[int]) -> None:
    model = _resnet()
    cm = sextant.compile(model, (torch.randn(2, 3, 32, 32),), target=target,
                         dynamic_shapes={"args": ({0: Dim("batch", min=1, max=8)},)})
    with torch.no_grad():
        for batch in (1, 5):
            x = torch.randn(batch, 3, 32, 32)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
    assert captures[0] == 1
    _one_program(cm, llvm_compiles)
    with pytest.raises(ArtifactError, match="symbolic sizes cannot be saved"):
        cm.save("unused")


@pytest.mark.slow
def test_llama_through_torch_compile_dynamic() -> None:
    """Dynamo's ``dynamic=True`` graph is captured once by sextant (Dynamo itself recompiles once
    when the batch leaves 1, which it specialises)."""
    dyn.STATS.reset()
    model = _llama()
    compiled = torch.compile(model, backend="sextant", dynamic=True)
    with torch.no_grad():
        for batch, seq in [(3, 7), (3, 64), (5, 129)]:
            ids = torch.randint(0, 1000, (batch, seq))
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4, atol=1e-4)
    assert [g.reason for g in dyn.STATS.graphs] == ["symbolic shapes: one capture"]
    torch._dynamo.reset()


@pytest.mark.slow
def test_gpu_mappings_at_ragged_symbolic_sizes(llvm_compiles: list[int]) -> None:
    """fp16 GPT-2 with symbolic batch and sequence on cuda-sim: one program whose tensor-core GEMMs
    and flash attention (its tail tile decided per launch) serve 1, 7, 129 and 160 tokens."""
    from sextant.examples import gpt2

    model, (ids,) = gpt2(batch=2, seq=160)  # an example size of 1 would be specialised by torch.export
    model = model.half()
    dims = {"input_ids": {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=160)}}
    cm = sextant.compile(model, (ids,), target="cuda-sim", dynamic_shapes=dims)
    with torch.no_grad():
        for batch, seq in [(1, 7), (3, 129), (1, 1), (4, 160)]:
            x = torch.randint(0, 1000, (batch, seq))
            torch.testing.assert_close(cm(x).float(), model.float()(x), rtol=2e-2, atol=3e-2)
            model.half()
    _one_program(cm, llvm_compiles)
    program = cm.stages["program"]
    assert {"tensor-core", "flash-attention-tensor-core"} <= {k.meta.get("mapping") for k in program.kernels.values()}


def test_size_torch_export_specialises_is_explained() -> None:
    """An example of batch 1 makes torch.export specialise the batch: the error keeps torch's
    explanation and suggested fix."""
    model = nn.Linear(4, 4)
    with pytest.raises(sextant.errors.ExportError, match=r"(?s)Constraints violated \(batch\).*Suggested fixes"):
        sextant.compile(model, (torch.randn(1, 4),), target="reference",
                        dynamic_shapes={"input": {0: Dim("batch", min=1, max=8)}})
