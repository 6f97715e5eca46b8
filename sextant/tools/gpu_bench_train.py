"""gpu_bench's training case: one SGD step (forward, backward, optimizer) of a GPT-2 LM.

Eager, ``torch.compile(backend="sextant")`` (forward and backward graphs through AOTAutograd,
the optimizer step compiled too) and Inductor train copies of the same weights on the same batch.
The row's error is the larger of the first step's loss difference and the largest parameter
difference after it, against eager. With ``--dry-run`` the model is tiny and sextant runs through
cuda-sim (torch.compile is left out: too slow on a CPU).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
from torch import nn

import sextant.frontend.dynamo as dyn


def train_inputs(tiny: bool) -> tuple[nn.Module, tuple]:
    """A 4-layer GPT-2-small-width LM at batch 8 × 256 (2 layers × 64 when ``tiny``), dropout 0 so
    every path computes the same loss; the batch's ids are its labels."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    size = ({"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 500, "n_positions": 64} if tiny
            else {"n_layer": 4})
    config = GPT2Config(attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, **size)
    batch, seq = (2, 16) if tiny else (8, 256)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return GPT2LMHeadModel(config).train(), (ids,)


class _Trainer:
    """``step()``: forward with the ids as labels, backward, SGD with momentum; returns the loss."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, backend: str | None, options: dict | None) -> None:
        self.model, self.ids = model, ids
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if backend is None:
            self.forward, self.opt_step = model, self.opt.step
        else:
            kw: dict[str, Any] = {"backend": backend} if backend != "inductor" else {}
            if options:
                kw["options"] = options
            self.forward, self.opt_step = torch.compile(model, **kw), torch.compile(self.opt.step, **kw)

    def step(self) -> torch.Tensor:
        loss = self.forward(self.ids, labels=self.ids).loss
        loss.backward()
        self.opt_step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _first_step(trainer: _Trainer, ref_loss: torch.Tensor, ref_params: list[torch.Tensor],
                dry_run: bool) -> tuple[float, float]:
    """(seconds, error) of a compiled path's first step — its compiles included — where the error is
    the larger of the loss difference and the largest weight difference after it, against eager."""
    t0 = time.perf_counter()
    loss = trainer.step()
    if not dry_run:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    worst = float((loss.float() - ref_loss.float()).abs())
    for p, q in zip(trainer.model.parameters(), ref_params):
        worst = max(worst, float((p.detach().float() - q.float()).abs().max()))
    return seconds, worst


def run_train(case: Any, dry_run: bool, row: Any) -> tuple | None:
    """Eager and sextant for the training case; returns what :func:`run_train_inductor` needs."""
    from sextant.tools.gpu_bench import _fail_note, _time_ms

    device, target = ("cpu", "cuda-sim") if dry_run else ("cuda", "cuda")
    cpu_model, (cpu_ids,) = case.build(dry_run)
    start = copy.deepcopy(cpu_model)  # every path starts from these weights
    ids = cpu_ids.to(device)
    eager = _Trainer(cpu_model.to(device), ids, None, None)
    ref_loss = eager.step()
    ref_params = [p.detach().clone() for p in eager.model.parameters()]
    row.eager_ms = _time_ms(eager.step, cuda=not dry_run)
    try:
        torch._dynamo.reset()
        dyn.STATS.reset()
        mine = _Trainer(copy.deepcopy(start).to(device), ids, "sextant", {"target": target, "fallback": False})
        row.sextant_compile_s, row.max_err = _first_step(mine, ref_loss, ref_params, dry_run)
        roles = [r.role for r in dyn.STATS.graphs]
        externs = sorted({e for r in dyn.STATS.graphs for e in r.externs})
        row.kernels = f"{len(roles)} graphs ({', '.join(sorted(set(roles)))})"
        if externs:
            row.notes.append(f"extern calls: {', '.join(externs)}")
        row.sextant_ms = _time_ms(mine.step, cuda=not dry_run)
    except Exception as e:
        row.notes.append(_fail_note("sextant", e))
    finally:
        torch._dynamo.reset()
    return start, ids, ref_loss, ref_params


def run_train_inductor(start: nn.Module, ids: torch.Tensor, ref_loss: torch.Tensor, ref_params: list,
                       dry_run: bool, row: Any) -> None:
    """Inductor (default mode) on the same weights and batch."""
    from sextant.tools.gpu_bench import _fail_note, _time_ms

    try:
        torch._dynamo.reset()
        theirs = _Trainer(copy.deepcopy(start).to(ids.device), ids, "inductor", None)
        row.inductor_compile_s, err = _first_step(theirs, ref_loss, ref_params, dry_run)
        if err > 0 and row.max_err is not None:
            row.notes.append(f"torch.compile max err {err:.1e}")
        row.inductor_ms = _time_ms(theirs.step, cuda=not dry_run)
    except Exception as e:
        row.notes.append(_fail_note("torch.compile", e))
    finally:
        torch._dynamo.reset()
