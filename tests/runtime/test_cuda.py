"""target="cuda" on a real NVIDIA GPU (run by scripts/gpu-check); skipped, with the reason, elsewhere.

Each example model is compiled for the GPU and compared with eager PyTorch on the same GPU, in
fp32 and fp16, on fresh inputs; the tests also check that inputs are used in place, that
outputs are CUDA tensors, and that CUDA-graph replay stays right when the tensors change.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sextant
from sextant.examples import EXAMPLES, gpt2


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__})"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        try:
            from cuda import cuda  # noqa: F401
        except ImportError:
            return "no CUDA GPU runtime: cuda-python is not installed (pip install cuda-python)"
    return None


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")]

TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.float16: {"rtol": 2e-2, "atol": 3e-2}}
MODELS = {**EXAMPLES, "gpt2": lambda: gpt2(n_layer=2, batch=2, seq=32)}


@functools.cache
def _compiled(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple, sextant.CompiledModule]:
    """The example on the GPU in ``dtype`` (integer inputs such as token ids keep theirs), compiled once."""
    model, args = MODELS[name]()
    model = model.to("cuda", dtype)
    args = tuple(a.to("cuda", dtype) if a.is_floating_point() else a.to("cuda") for a in args)
    return model, args, sextant.compile(model, args, target="cuda")


def _fresh(args: tuple) -> tuple:
    out = []
    for a in args:
        if a.is_floating_point():
            out.append(torch.randn_like(a))
        else:
            out.append(torch.randint_like(a, 0, int(a.max()) + 1))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer-block", "gpt2"])
def test_matches_eager_on_the_gpu(name: str, dtype: torch.dtype) -> None:
    model, args, compiled = _compiled(name, dtype)
    for _ in range(3):  # new input tensors each call: the graph's input/output nodes are rebound
        fresh = _fresh(args)
        with torch.no_grad():
            expected = model(*fresh)
        got = compiled(*fresh)
        assert got.is_cuda and got.device == fresh[0].device and got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, **TOL[dtype])


def test_inputs_used_in_place_and_replay_is_deterministic() -> None:
    model, args, compiled = _compiled("transformer-block", torch.float32)
    runner = compiled.stages["runner"]
    x = torch.randn_like(args[0])
    first = compiled(x)
    input_buffer = next(b.index for b in runner.program.buffers if b.kind == "input")
    assert runner.bound_address(input_buffer) == x.data_ptr()  # the kernels read the caller's memory
    again = compiled(x)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    y = torch.randn_like(x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(y), model(y), **TOL[torch.float32])
    assert runner.bound_address(input_buffer) == y.data_ptr()
    assert runner.stats["graph_builds"] == 1 and runner.stats["node_updates"] > 0


def test_graph_and_launch_by_launch_agree() -> None:
    _, args, compiled = _compiled("mlp", torch.float32)
    runner = compiled.stages["runner"]
    x = torch.randn_like(args[0])
    with_graph = compiled(x)
    runner.use_graph = False
    try:
        launched = compiled(x)
    finally:
        runner.use_graph = True
    torch.testing.assert_close(with_graph, launched, rtol=0, atol=0)


def test_runs_on_a_side_stream_and_a_cpu_compiled_model() -> None:
    model, args = EXAMPLES["mlp"]()  # compiled from the CPU model: weights are uploaded by the runtime
    compiled = sextant.compile(model, args, target="cuda")
    x = torch.randn_like(args[0]).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = compiled(x)
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        torch.testing.assert_close(got.cpu(), model(x.cpu()), **TOL[torch.float32])


def test_cpu_input_is_refused_with_the_reason() -> None:
    _, args, compiled = _compiled("mlp", torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        compiled(args[0].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_symbolic_sizes_on_the_gpu(dtype: torch.dtype) -> None:
    """GPT-2 (the built-in example) compiled once with symbolic batch and sequence sizes — one
    program, its kernels taking the sizes as parameters — at ragged sizes (1, 7, 129 tokens)
    through the GPU's mappings: tensor cores and flash attention in fp16."""
    from torch.export import Dim

    model, (ids,) = gpt2(batch=2, seq=160)  # an example size of 1 would be specialised by torch.export
    model = model.to(dtype).cuda()
    dims = {"input_ids": {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=160)}}
    compiled = sextant.compile(model, (ids.cuda(),), target="cuda", dynamic_shapes=dims)
    with torch.no_grad():
        for batch, seq in [(1, 7), (3, 129), (1, 1)]:
            x = torch.randint(0, 1000, (batch, seq), device="cuda")
            torch.testing.assert_close(compiled(x).float(), model(x).float(), **TOL[dtype])
    from sextant.runtime.cuda import SymbolicCudaRunner

    runner = compiled.stages["runner"]
    assert isinstance(runner, SymbolicCudaRunner) and len(runner._runners) == 3
    assert any(k.sizes for k in compiled.stages["program"].kernels.values())
