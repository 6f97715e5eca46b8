"""One rank of the multi-process collective tests (run by ``ranks.run_ranks``; see test_collectives.py).

Every scenario builds the full model from one seed on every rank, shards it, runs the sharded
version compiled by sextant and compares with the unsharded model computed locally: each rank's
output must equal the unsharded model's. A scenario reports its figures, or the error it raised.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

torch.set_num_threads(1)
SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {}


def scenario(fn: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _compile(fn: Any, target: str = "cpu") -> Any:
    torch._dynamo.reset()
    return torch.compile(fn, backend="sextant", fullgraph=True, options={"fallback": False, "target": target})


def _last() -> Any:
    from sextant.frontend.dynamo import STATS

    return STATS.graphs[-1]


def _program_facts() -> dict[str, Any]:
    record = _last()
    program = record.compiled.stages["program"]
    kinds = [la.extern.fn for la in program.launches if la.extern is not None]
    return {"host_calls": kinds, "externs": list(record.externs), "schedule": program.describe(),
            "graph": str(program.graph)}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@scenario
def tp_mlp(rank: int, world: int) -> dict[str, Any]:
    """Megatron's MLP: column-sharded W1, row-sharded W2, one all_reduce (sum) of the partial products."""
    g = torch.Generator().manual_seed(0)
    w1, w2, x = torch.randn(16, 64, generator=g), torch.randn(64, 16, generator=g), torch.randn(8, 16, generator=g)
    cols = 64 // world
    w1s, w2s = w1[:, rank * cols:(rank + 1) * cols].contiguous(), w2[rank * cols:(rank + 1) * cols].contiguous()
    group = dist.group.WORLD

    def f(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(torch.relu(x @ a) @ b, "sum", group)

    want = torch.relu(x @ w1) @ w2
    out: dict[str, Any] = {}
    for target in ("cpu", "cuda-sim"):
        compiled = _compile(f, target)
        got = [compiled(x, w1s, w2s) for _ in range(2)]  # the second call reuses the program
        out[target] = max(_err(y, want) for y in got)
        out[f"{target}_facts"] = _program_facts()
    return out


@scenario
def gather_and_scatter(rank: int, world: int) -> dict[str, Any]:
    """A column-sharded Linear whose outputs are all-gathered (last dim), and a row-sharded one whose
    partial sums are reduce-scattered over the batch."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(16, 32, generator=g), torch.randn(8, 16, generator=g)
    cols, rows = 32 // world, 16 // world
    group = dist.group.WORLD

    def gather(x: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        return funcol.all_gather_tensor(torch.tanh(x @ ws), gather_dim=1, group=group) * 2

    def scatter(xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        return funcol.reduce_scatter_tensor(xs @ ws, "sum", scatter_dim=0, group=group) + 1

    got_g = _compile(gather)(x, w[:, rank * cols:(rank + 1) * cols].contiguous())
    facts_g = _program_facts()
    got_s = _compile(scatter)(x[:, rank * rows:(rank + 1) * rows].contiguous(),
                              w[rank * rows:(rank + 1) * rows].contiguous())
    facts_s = _program_facts()
    n = 8 // world
    return {"all_gather": _err(got_g, torch.tanh(x @ w) * 2), "gather_facts": facts_g,
            "reduce_scatter": _err(got_s, (x @ w)[rank * n:(rank + 1) * n] + 1), "scatter_facts": facts_s}


@scenario
def all_to_all_and_broadcast(rank: int, world: int) -> dict[str, Any]:
    """all_to_all_single with equal and with uneven splits, and a broadcast from rank 1."""
    group = dist.group.WORLD
    x = torch.arange(12.0).reshape(6, 2) + 100 * rank

    def even(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_to_all_single(x * 2, None, None, group) - 1

    def uneven(x: torch.Tensor) -> torch.Tensor:  # rank r sends rows [0:2] to rank 0 and [2:6] to rank 1
        return funcol.all_to_all_single(x, [2, 2] if rank == 0 else [4, 4], [2, 4], group)

    def bcast(x: torch.Tensor) -> torch.Tensor:
        return funcol.broadcast(x.exp(), 1, group).log()

    parts = [torch.arange(12.0).reshape(6, 2) + 100 * r for r in range(world)]
    half = 6 // world
    want_even = torch.cat([p[rank * half:(rank + 1) * half] * 2 for p in parts]) - 1
    want_uneven = torch.cat([p[0:2] if rank == 0 else p[2:6] for p in parts])
    return {"even": _err(_compile(even)(x), want_even), "uneven": _err(_compile(uneven)(x), want_uneven),
            "broadcast": _err(_compile(bcast)(x / 100), parts[1] / 100)}


@scenario
def in_place_all_reduce(rank: int, world: int) -> dict[str, Any]:
    """Eager-style ``dist.all_reduce(t)`` (in place) inside the compiled function: Dynamo rewrites it
    into the functional collective and a copy back."""
    x = torch.full((4, 4), float(rank + 1))

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        dist.all_reduce(y)
        return y + 1

    got = _compile(f)(x)
    return {"err": _err(got, torch.full((4, 4), 3.0 * sum(range(1, world + 1)) + 1)), "facts": _program_facts()}


@scenario
def export_and_reference(rank: int, world: int) -> dict[str, Any]:
    """The same collective through ``sextant.compile`` (torch.export) on cpu and on the graph IR's
    reference executor, and the compile cache's artifact round trip."""
    import sextant

    class Reduce(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(x.sin(), "max", dist.group.WORLD) * 2

    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
    xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    want = torch.stack([t.sin() for t in xs]).amax(0) * 2
    out = {t: _err(sextant.compile(Reduce(), (x,), target=t)(x), want) for t in ("cpu", "reference")}
    cache = os.environ.get("SEXTANT_TEST_CACHE_DIR")
    if cache:
        os.environ.update(SEXTANT_COMPILE_CACHE="1", SEXTANT_CACHE_DIR=f"{cache}/rank{rank}")
        try:
            first = sextant.compile(Reduce(), (x,), target="cpu")
            again = sextant.compile(Reduce(), (x,), target="cpu")  # from the artifact the first call stored
            out["cached"] = _err(again(x), want)
            out["cache_hit"] = bool(again.stages.get("cache") == "hit") or "artifact" in again.stages
            del first
        finally:
            os.environ["SEXTANT_COMPILE_CACHE"] = "0"
    return out


@scenario
def dtensor_llama(rank: int, world: int) -> dict[str, Any]:
    """The TP Llama under ``torch.compile(backend="sextant")``: forward under no_grad, then a training
    step (forward and backward compiled) whose gradients match the unsharded model's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from sextant.frontend.dynamo import STATS
    from sextant.tools.tp_llama import TinyLlama, tensor_parallel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = TinyLlama(vocab=64, dim=32, heads=4, hidden=64, layers=2)
    sharded = tensor_parallel(copy.deepcopy(full), mesh)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = full(tokens)
        STATS.reset()
        got = _compile(sharded)(tokens)
    infer = {"err": _err(got, want), "graphs": [(g.role, g.target, list(g.externs)) for g in STATS.graphs],
             "collectives": sum(str(g.compiled.stages["program"].graph).count("collective(")
                                for g in STATS.graphs if g.compiled is not None)}
    with torch.no_grad():
        infer["cuda-sim"] = _err(_compile(sharded, "cuda-sim")(tokens), want)
    STATS.reset()
    loss_full = full(tokens).float().square().mean()
    loss_full.backward()
    compiled = _compile(sharded)
    loss = compiled(tokens).float().square().mean()
    loss.backward()
    grad_err = 0.0
    for (_, p), (_, q) in zip(full.named_parameters(), sharded.named_parameters()):
        g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        grad_err = max(grad_err, _err(g, p.grad) / (p.grad.abs().max().item() + 1e-6))
    roles = [(g.role, g.target, g.reason) for g in STATS.graphs]
    # the optimizer step over the sharded parameters, compiled too; then a second whole step
    opt, opt_full = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (sharded, full))
    step = torch.compile(opt.step, backend="sextant", options={"fallback": False})
    for i in range(2):
        if i:
            opt.zero_grad()
            opt_full.zero_grad()
            compiled(tokens).float().square().mean().backward()
            full(tokens).float().square().mean().backward()
        step()
        opt_full.step()
    param_err = max(_err(q.full_tensor() if isinstance(q, DTensor) else q, p)
                    for p, q in zip(full.parameters(), sharded.parameters()))
    return {"forward": infer, "loss_err": abs(loss.item() - loss_full.item()), "grad_rel_err": grad_err,
            "train_graphs": roles, "param_err_after_2_steps": param_err,
            "step_graphs": [(g.role, g.target, g.reason) for g in STATS.graphs[len(roles):]]}


@scenario
def mismatch(rank: int, world: int) -> dict[str, Any]:
    """Ranks that compile different collectives (rank-dependent Python control flow): an error on
    every rank before any transfer, never a hang."""
    group = dist.group.WORLD

    def f(x: torch.Tensor) -> torch.Tensor:
        if rank == 0:
            return funcol.all_reduce(x, "sum", group)
        return funcol.all_gather_tensor(x, 0, group)[:4]

    try:
        _compile(f)(torch.ones(4, 4))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


@scenario
def missing_rank(rank: int, world: int) -> dict[str, Any]:
    """A rank that compiles a program with collectives the others never compile: an error once the
    check's deadline passes (shortened here), never a hang. Runs last: it leaves the ranks' program
    counts different."""
    import sextant.runtime.collectives as c

    if rank != 0:
        return {"error": None}
    c.CHECK_TIMEOUT_S = 3.0
    try:
        _compile(lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD) + 1)(torch.ones(2))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("scenarios", nargs="*")
    a = ap.parse_args()
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world)
    import sextant  # noqa: F401  (registers the backend)

    report: dict[str, Any] = {}
    for name in a.scenarios or list(SCENARIOS):
        try:
            report[name] = {"ok": True, **SCENARIOS[name](a.rank, a.world)}
        except Exception as e:
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        with open(a.out, "w") as f:  # after each scenario: a later hang still leaves the earlier reports
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
