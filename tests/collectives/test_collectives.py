"""Collectives across processes: 2 ranks over gloo (tp_scenarios.py), each rank's output compared
with the unsharded model's; schedules overlap transfers with kernels; ranks that compiled different
collectives fail with an error instead of hanging.

The ranks run once per module (spawning and compiling dominates); each test reads its scenario's
report from both ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from .ranks import run_ranks

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available in this torch build"),
              pytest.mark.slow]  # ~80 s: every scenario runs once in spawned ranks (the module's fixture)
SCRIPT = Path(__file__).with_name("tp_scenarios.py")
TOL = 1e-4


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ranks")
    return run_ranks(SCRIPT, tmp, world=2, timeout_s=900, env={"SEXTANT_TEST_CACHE_DIR": str(tmp / "cache")})


def scenario(reports: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = [r[name] for r in reports]
    for rank, r in enumerate(out):
        assert r["ok"], f"rank {rank}: {r['error']}\n{r.get('trace', '')}"
    return out


def test_tp_mlp_all_reduce_matches_unsharded_on_cpu_and_cuda_sim(reports):
    for r in scenario(reports, "tp_mlp"):
        assert r["cpu"] < TOL and r["cuda-sim"] < TOL
        for target in ("cpu", "cuda-sim"):
            facts = r[f"{target}_facts"]
            assert facts["externs"] == []  # compiled, not called as extern ops
            assert facts["host_calls"] == ["all_reduce", "wait all_reduce"]
            assert 'collective(' in facts["graph"] and 'kind="all_reduce", reduce="sum"' in facts["graph"]


def test_all_gather_and_reduce_scatter_patterns(reports):
    for r in scenario(reports, "gather_and_scatter"):
        assert r["all_gather"] < TOL and r["reduce_scatter"] < TOL
        assert r["gather_facts"]["host_calls"] == ["all_gather", "wait all_gather"]
        assert r["scatter_facts"]["host_calls"] == ["reduce_scatter", "wait reduce_scatter"]


def test_all_to_all_and_broadcast(reports):
    for r in scenario(reports, "all_to_all_and_broadcast"):
        assert r["even"] < TOL and r["uneven"] < TOL and r["broadcast"] < TOL


def test_eager_style_in_place_all_reduce(reports):
    for r in scenario(reports, "in_place_all_reduce"):
        assert r["err"] < TOL
        assert "all_reduce" in r["facts"]["host_calls"]


def test_export_path_reference_executor_and_cached_artifact(reports):
    for r in scenario(reports, "export_and_reference"):
        assert r["cpu"] < TOL and r["reference"] < TOL
        assert r["cached"] < TOL and r["cache_hit"]


def test_dtensor_llama_forward_on_cpu_and_cuda_sim_and_training_steps(reports):
    for r in scenario(reports, "dtensor_llama"):
        fwd = r["forward"]
        assert fwd["err"] < 1e-4 and fwd["cuda-sim"] < 1e-4, fwd
        assert fwd["graphs"] and all(target is not None and externs == [] for _, target, externs in fwd["graphs"])
        assert fwd["collectives"] >= 4  # per layer: one after attention's o, one after the MLP's down
        assert all(target is not None for _, target, _ in r["train_graphs"]), r["train_graphs"]
        assert {"forward", "backward"} <= {role for role, _, _ in r["train_graphs"]}
        assert r["loss_err"] < 1e-4 and r["grad_rel_err"] < 1e-4
        assert r["step_graphs"] and all(target is not None for _, target, _ in r["step_graphs"]), r["step_graphs"]
        assert r["param_err_after_2_steps"] < 1e-5


def test_schedule_overlaps_the_transfer_with_independent_kernels(reports):
    """tp_mlp's schedule has nothing independent; gather_and_scatter's neither — the overlap is
    checked on a graph built for it in test_overlap.py; here: the dump says what was in flight."""
    for r in scenario(reports, "tp_mlp"):
        assert "collectives in flight" in r["cpu_facts"]["schedule"]


def test_ranks_that_compiled_different_collectives_fail_instead_of_hanging(reports):
    for rank, r in enumerate(scenario(reports, "mismatch")):
        assert r["error"] is not None, f"rank {rank} ran a mismatched program"
        assert "CollectiveError" in r["error"] and "different collectives" in r["error"], r["error"]
        assert "all_reduce" in r["error"] and "all_gather" in r["error"]


def test_a_rank_that_never_compiles_the_program_is_reported(reports):
    r0, r1 = scenario(reports, "missing_rank")
    assert r0["error"] is not None and "compiled no program" in r0["error"] and "[1]" in r0["error"], r0["error"]
    assert r1["error"] is None


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                    reason="the CUDA path runs collectives through NCCL and needs a GPU (world size 1 on one GPU)")
def test_cuda_all_reduce_through_nccl(tmp_path):
    import os

    import torch.distributed._functional_collectives as funcol

    import sextant

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.randn(64, 64, device="cuda")
        f = torch.compile(lambda x: funcol.all_reduce(x @ x, "sum", dist.group.WORLD) + 1, backend="sextant",
                          fullgraph=True, options={"fallback": False})
        torch.testing.assert_close(f(x), x @ x + 1, rtol=1e-3, atol=1e-3)
        assert sextant.frontend.dynamo.STATS.graphs[-1].target == "cuda"
    finally:
        dist.destroy_process_group()
