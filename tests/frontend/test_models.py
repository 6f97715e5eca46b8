"""Every example model: captured, optimised, run by the reference executor, compared with eager."""

import pytest
import torch

import sextant
from sextant.examples import EXAMPLES
from sextant.graph.reference import run_graph
from sextant.graph.verifier import verify


def _fresh_like(args: tuple) -> tuple:
    """New random inputs of the example's shapes and dtypes (not the ones we compiled with)."""
    out = []
    for a in args:
        if a.dtype.is_floating_point:
            out.append(torch.randn_like(a))
        else:
            out.append(torch.randint(0, int(a.max()) + 1, a.shape, dtype=a.dtype))
    return tuple(out)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_matches_eager(name: str) -> None:
    model, args = EXAMPLES[name]()
    compiled = sextant.compile(model, args, target="reference")
    verify(compiled.graph)
    for _ in range(2):
        fresh = _fresh_like(args)
        with torch.no_grad():
            expected = model(*fresh)
        torch.testing.assert_close(compiled(*fresh), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_capture_is_faithful_before_passes(name: str) -> None:
    """The raw capture (no passes) already matches eager: lowerings are right on their own."""
    model, args = EXAMPLES[name]()
    graph = sextant.capture(model, args)
    fresh = _fresh_like(args)
    (out,) = run_graph(graph, list(fresh))
    with torch.no_grad():
        torch.testing.assert_close(out, model(*fresh), rtol=1e-4, atol=1e-5)


def test_passes_shrink_gpt2() -> None:
    model, args = EXAMPLES["gpt2"]()
    compiled = sextant.compile(model, args, target="reference")
    before = len(compiled.stages["captured"].nodes)
    after = len(compiled.graph.nodes)
    assert after < before, (before, after)


def test_parameters_become_named_constants() -> None:
    model, args = EXAMPLES["mlp"]()
    graph = sextant.capture(model, args)
    names = {n.attr("name") for n in graph.nodes if n.op == "param"}
    assert names == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(graph.params[name], p.detach())


def test_buffers_become_constants() -> None:
    model, args = EXAMPLES["cnn"]()
    graph = sextant.capture(model, args)
    names = {n.attr("name") for n in graph.nodes if n.op == "param"}
    assert "bn1.running_mean" in names and "bn2.running_var" in names


def test_source_locations_point_at_user_code() -> None:
    model, args = EXAMPLES["transformer-block"]()
    graph = sextant.capture(model, args)
    locs = {n.loc for n in graph.nodes if n.loc}
    assert any(loc.startswith("examples.py:") for loc in locs), locs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_transformer_block(dtype: torch.dtype) -> None:
    model, (x,) = EXAMPLES["transformer-block"]()
    model = model.to(dtype)
    x = x.to(dtype)
    compiled = sextant.compile(model, (x,), target="reference")
    fresh = torch.randn_like(x)
    with torch.no_grad():
        expected = model(fresh)
    torch.testing.assert_close(compiled(fresh), expected, rtol=2e-2, atol=2e-2)


def test_huggingface_model_output_is_kept() -> None:
    """GPT-2 called directly (no wrapper) returns a transformers ModelOutput; so does the compiled one."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                        eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding in the first sequence
    compiled = sextant.compile(model, (ids,), {"attention_mask": mask, "use_cache": False}, target="reference")
    fresh = torch.randint(0, 100, (2, 8))
    out = compiled(fresh, attention_mask=mask, use_cache=False)
    with torch.no_grad():
        ref = model(fresh, attention_mask=mask, use_cache=False)
    assert type(out) is type(ref)
    assert list(out.keys()) == list(ref.keys())
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)


def test_eval_batch_norm_takes_the_saved_stats_shape_torch_recorded() -> None:
    """On CUDA torch records eval batch norm's (unused) saved mean/invstd as [C], on the CPU as [0]:
    the lowering must follow the recorded shape (a real-GPU run found the [0] assumption)."""
    from sextant.frontend.capture import export, translate

    model, args = EXAMPLES["cnn"]()
    ep = export(model.eval(), args)
    patched = 0
    for node in ep.graph.nodes:
        if node.op == "call_function" and "batch_norm_legit_no_training" in str(node.target):
            out, mean, invstd = node.meta["val"]
            channels = out.shape[1]
            node.meta["val"] = (out, mean.new_empty(channels), invstd.new_empty(channels))
            patched += 1
    assert patched
    graph = translate(ep, "cnn")
    fresh = _fresh_like(args)
    with torch.no_grad():
        expected = model(*fresh)
    (got,) = run_graph(graph, fresh)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
