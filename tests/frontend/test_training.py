"""Training under ``torch.compile(backend="sextant")``: forward and backward graphs compiled, gradients kept.

Two copies of a model are trained side by side, one eagerly and one compiled; every loss and the
final weights and buffers (BatchNorm's running statistics included) must agree to fp32 tolerances,
and ``STATS`` must show both halves compiled, not run eagerly.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant.frontend.dynamo as dyn


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    dyn.STATS.reset()
    yield
    torch._dynamo.reset()


class TinyLM(nn.Module):
    """The issue's example: embedding, a transformer encoder layer, LayerNorm, a head, cross entropy."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln(self.layer(self.emb(ids))))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


class BatchNormCNN(nn.Module):
    """Convolutions (one grouped), BatchNorm in training mode, max and average pooling, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.c1(x))), 2)
        h = F.avg_pool2d(F.relu(self.bn2(self.c2(h))), 2)
        return F.cross_entropy(self.fc(h.flatten(1)), y)


def _lm_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 12, (2, 8), generator=g)  # a small id range: repeated tokens sum their gradients
    return ids, torch.randint(0, 50, (2, 8), generator=g)


def _cnn_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


def _train_side_by_side(model: nn.Module, batch, target: str, steps: int = 3) -> None:
    torch.manual_seed(0)
    eager = model.train()
    mine = copy.deepcopy(eager)
    compiled = torch.compile(mine, backend="sextant", options={"target": target, "fallback": False})
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_c = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        args = batch(g)
        want = eager(*args)
        want.backward()
        got = compiled(*args)
        assert got.grad_fn is not None, "the compiled loss must stay attached to autograd"
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, s=step: f"step {s} loss: {m}")
        for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name, s=step: f"step {s} grad {n}: {m}")
        opt_e.step(), opt_c.step()
        opt_e.zero_grad(), opt_c.zero_grad()
    for (name, a), b in zip(eager.state_dict().items(), mine.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"final {n}: {m}")
    roles = {(r.role, r.target) for r in dyn.STATS.graphs}
    assert roles == {("forward", target), ("backward", target)}, dyn.STATS.graphs


def test_compiled_loss_keeps_autograd() -> None:
    """The issue's first report: the compiled loss had no grad_fn and backward() raised."""
    _train_side_by_side(TinyLM(), _lm_batch, "cpu", steps=1)


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda-sim", marks=pytest.mark.slow)])
def test_transformer_lm_trains_like_eager(target: str) -> None:
    _train_side_by_side(TinyLM(), _lm_batch, target)


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda-sim", marks=pytest.mark.slow)])
def test_batchnorm_cnn_trains_like_eager(target: str) -> None:
    """BatchNorm in training mode: batch statistics in the forward graph, the running statistics
    written back into the module's buffers (compared in the final state dict)."""
    _train_side_by_side(BatchNormCNN(), _cnn_batch, target)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_hf_model_trains_like_eager(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(cfg)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, labels=labels).loss

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, 64, (2, 12), generator=g)
        return ids, ids.clone()

    _train_side_by_side(Loss(), batch, "cpu", steps=2)


def test_inference_graphs_keep_the_inference_path() -> None:
    """Under no_grad (or with no input requiring grad) a graph is compiled as before, with no AOTAutograd."""
    model = TinyLM().eval()
    ids, targets = _lm_batch(torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="sextant", options={"fallback": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, targets), model(ids, targets), rtol=1e-4, atol=1e-5)
    assert [r.role for r in dyn.STATS.graphs] == ["inference"]


def test_a_backward_graph_sextant_cannot_compile_runs_eagerly(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A backward graph that fails to compile costs only that graph: it runs eagerly with the reason
    logged and recorded, and the gradients are still right."""
    real = dyn._compile_static

    def no_backward(gm, args, opts, target):
        if any("tangents" in n.name for n in gm.graph.nodes if n.op == "placeholder"):
            raise KeyError("no backward today")
        return real(gm, args, opts, target)

    monkeypatch.setattr(dyn, "_compile_static", no_backward)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    mine = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="sextant.dynamo"):
        torch.compile(mine, backend="sextant")(x).sum().backward()
    model(x).sum().backward()
    for p, q in zip(model.parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    records = {r.role: r for r in dyn.STATS.graphs}
    assert records["forward"].target == "cpu"
    assert records["backward"].target is None and "KeyError: 'no backward today'" in records["backward"].reason
    assert "running a backward graph of" in caplog.text


def test_a_graph_aot_autograd_cannot_split_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    import sextant.frontend.training as training

    def broken(*args, **kwargs):
        raise RuntimeError("cannot split")

    monkeypatch.setattr(training, "compile_training", broken)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    mine = copy.deepcopy(model)
    x = torch.randn(3, 8)
    torch.compile(mine, backend="sextant")(x).sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(mine[0].weight.grad, model[0].weight.grad)
    (record,) = dyn.STATS.graphs
    assert record.target is None and record.role == "training" and "cannot split" in record.reason


def test_double_backward_is_refused_clearly() -> None:
    """create_graph=True through a compiled backward: torch's AOTAutograd refuses it with its own
    error (sextant compiles first-order backward graphs only)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    y = torch.compile(model, backend="sextant")(x).sum()
    (gx,) = torch.autograd.grad(y, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


def test_batchnorm_training_mode_through_sextant_compile() -> None:
    """Outside autograd, ``sextant.compile`` of a train-mode BatchNorm uses the batch's statistics
    and writes the new running mean, variance and batch count back into the module's buffers."""
    import sextant

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    ref = copy.deepcopy(model)
    compiled = sextant.compile(model, (torch.randn(2, 3, 8, 8),))
    for step in range(2):
        x = torch.randn(2, 3, 8, 8)
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-4, atol=1e-5)
        bn, ref_bn = model[1], ref[1]
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=1e-4, atol=1e-6)
        assert int(bn.num_batches_tracked) == step + 1
