"""Autotuning: tile problems, the store, compiles that read it, and every candidate against eager.

The timings themselves need a GPU; here a timer that prefers a chosen candidate stands in for
it, so what is checked is everything around the measurement: which problems a model has, that
each round really builds its candidate, that the fastest one is stored, and that a later compile
uses it (and still matches eager through cuda-sim).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

import sextant
from sextant.frontend.capture import capture
from sextant.runtime import compile_cache, tuning_store
from sextant.schedule.dump import describe_program
from sextant.schedule.gpu_mma import CANDIDATES as MMA_CANDIDATES
from sextant.schedule.gpu_wgmma import CANDIDATES as WG_CANDIDATES
from sextant.schedule.tuning import NO_TILES, TileProblem, TileTable, pick
from sextant.tools import tune

TOL = 3e-2


class Block(torch.nn.Module):
    """A Linear with a fused epilogue (bias, GELU, residual) at ragged sizes."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(k, n)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x)) + r


def _block(m: int = 200, k: int = 96, n: int = 136) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    return Block(k, n).half(), (torch.randn(m, k).half(), torch.randn(m, n).half())


def _tiles(cm: sextant.CompiledModule) -> list[dict]:
    program = cm.stages["program"]
    return [k.meta for k in program.kernels.values() if "problem" in k.meta]


def preferring(name: str) -> tune.Timer:
    """A stand-in for the GPU: launches built on ``name`` take 1 µs, other tiles 2 µs, the rest 0."""

    def timer(compiled: sextant.CompiledModule, args: tuple) -> list[float]:
        program = compiled.stages["program"]
        out = []
        for launch in program.launches:
            meta = program.kernels[launch.kernel].meta if launch.extern is None else {}
            out.append(0.0 if "problem" not in meta else 1e-6 if meta["tile_name"] == name else 2e-6)
        return out

    return timer


def test_problem_keys_round_trip_and_bad_keys_are_named() -> None:
    p = TileProblem("wgmma", 4096, 2304, 768, 1, "f16", "sm_90a")
    assert p.key == "wgmma/sm_90a/f16/4096x2304x768*1"
    assert TileProblem.parse(p.key) == p
    with pytest.raises(ValueError, match="not a tile problem: 'wgmma/4096'"):
        TileProblem.parse("wgmma/4096")


def test_pick_uses_the_table_only_for_a_current_candidate() -> None:
    p = TileProblem("wgmma", 500, 500, 64, 1, "f16", "sm_90a")
    other = TileProblem("wgmma", 501, 500, 64, 1, "f16", "sm_90a")
    table = TileTable.of({p: WG_CANDIDATES[3].name})
    assert pick(p, table, WG_CANDIDATES, WG_CANDIDATES[0]) == (
        WG_CANDIDATES[3], {"problem": p.key, "candidates": tuple(t.name for t in WG_CANDIDATES),
                           "tile_name": WG_CANDIDATES[3].name, "tile_source": "tuned"})
    assert pick(other, table, WG_CANDIDATES, WG_CANDIDATES[0])[1]["tile_source"] == "model"
    stale = TileTable.of({p: "512x512/s9"})  # measured before the candidate set changed
    assert pick(p, stale, WG_CANDIDATES, WG_CANDIDATES[1])[0] == WG_CANDIDATES[1]


def test_store_round_trip_merge_and_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SEXTANT_TUNING", str(tmp_path))
    a = TileProblem("mma", 4096, 4096, 4096, 1, "f16", "sm_80")
    b = TileProblem("mma", 512, 768, 768, 1, "f16", "sm_80")
    empty = tuning_store.fingerprint()
    tuning_store.save("sm_80", {a: tuning_store.Measured({"x": 2.0, "y": 1.5}, "GPU")})
    assert tuning_store.fingerprint() != empty
    tuning_store.save("sm_80", {b: tuning_store.Measured({"x": 1.0, "y": 1.5}, "GPU")})  # merged
    assert tuning_store.load_table("sm_80") == TileTable.of({a: "y", b: "x"})
    assert tuning_store.load_table("sm_90a") == NO_TILES
    entry = json.loads((tmp_path / "sm_80.json").read_text())["entries"][a.key]
    assert entry["times_ms"] == {"x": 2.0, "y": 1.5} and entry["device"] == "GPU"
    (tmp_path / "sm_80.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="sextant.tuning"):
        assert tuning_store.load_table("sm_80") == NO_TILES
    assert "ignoring the tuning file" in caplog.text
    monkeypatch.setenv("SEXTANT_TUNING", "0")
    assert tuning_store.load_table("sm_80") == NO_TILES
    with pytest.raises(RuntimeError, match="tuning store is off"):
        tuning_store.save("sm_80", {a: tuning_store.Measured({"x": 1.0}, "GPU")})


def test_compile_cache_key_follows_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEXTANT_TUNING", str(tmp_path))
    model, args = _block(64, 32, 32)

    def keys() -> tuple[str | None, ...]:
        return tuple(compile_cache.key(model, args, None, target, arch, "default")
                     for target, arch in (("cuda-sim", "sm_90a"), ("cuda-sim", "sm_80"), ("cpu", None)))

    before = keys()
    (tmp_path / ".sm_90a-cut-short.json").write_text("{")  # a save killed before its rename
    assert keys() == before
    p = TileProblem("wgmma", 64, 32, 32, 1, "f16", "sm_90a")
    tuning_store.save("sm_90a", {p: tuning_store.Measured({"64x64/s4": 1.0, "64x128/s4": 2.0}, "GPU")})
    after = keys()
    assert after[0] != before[0]  # sm_90a's entries recompile
    assert after[1:] == before[1:]  # another arch's and the CPU's stay


@pytest.mark.slow  # ~55 s of cuda-sim: 12 race-checked compiles
@pytest.mark.parametrize("arch,mapping,candidates", [("sm_90a", "wgmma", WG_CANDIDATES),
                                                     ("sm_80", "mma", MMA_CANDIDATES)])
def test_every_candidate_compiles_and_matches_eager(arch: str, mapping: str, candidates: tuple,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One round per candidate, each checked against eager through cuda-sim with the race checker
    on: 200 rows give the 128-row Hopper tiles work, and the 64-row ones (which the heuristic
    keeps for M ≤ 64) a ragged M past one tile."""
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    model, args = _block()
    results = tune.tune(model, args, target="cuda-sim", arch=arch, timer=None)
    assert [r.problem.mapping for r in results] == [mapping]
    r = results[0]
    assert r.problem == TileProblem(mapping, 200, 136, 96, 1, "f16", arch)
    assert r.candidates == tuple(t.name for t in candidates) and r.launches == 1
    assert r.failed == {} and r.checked == list(r.candidates)


@pytest.mark.slow  # ~40 s of cuda-sim; make test-slow
def test_the_fastest_candidate_is_stored_and_later_compiles_use_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEXTANT_TUNING", str(tmp_path))
    model, args = _block()
    default = sextant.compile(model, args, target="cuda-sim", arch="sm_90a", cache=False)
    [meta] = _tiles(default)
    model_choice = meta["tile_name"]
    assert meta["tile_source"] == "model" and model_choice == "128x256/s4/ws"
    wanted = "64x64/s4"  # the model's last choice for 200 rows: the stand-in timer prefers it
    results = tune.tune(model, args, target="cuda-sim", arch="sm_90a", timer=preferring(wanted))
    [r] = results
    assert r.model_choice == model_choice and r.times_ms[wanted] == pytest.approx(1e-3)
    assert all(ms == pytest.approx(2e-3) for name, ms in r.times_ms.items() if name != wanted)
    tuning_store.save("sm_90a", tune.measured(results, "stand-in"))
    assert "| wgmma/sm_90a/f16/200x136x96*1 | 1 | 128x256/s4/ws | 0.002 | 64x64/s4 | 0.001 | 2.00× |" in \
        tune.table("block", results)

    tuned = sextant.compile(model, args, target="cuda-sim", arch="sm_90a", cache=False)
    [meta] = _tiles(tuned)
    assert (meta["tile_name"], meta["tile_source"], meta["tile"][:2]) == (wanted, "tuned", (64, 64))
    assert "mapping wgmma-tma; tile 64x64/s4 (measured)" in describe_program(tuned.stages["program"])
    assert "(measured)" not in describe_program(default.stages["program"])
    for fresh in (args, tuple(torch.randn_like(a) for a in args)):
        expected = copy.deepcopy(model).float()(*(a.float() for a in fresh))
        torch.testing.assert_close(tuned(*fresh).float(), expected, rtol=TOL, atol=TOL)
    # another architecture's compile is untouched; and the store off, the model decides again
    [meta80] = _tiles(sextant.compile(model, args, target="cuda-sim", arch="sm_80", cache=False))
    assert meta80["tile_source"] == "model"
    monkeypatch.setenv("SEXTANT_TUNING", "0")
    [meta] = _tiles(sextant.compile(model, args, target="cuda-sim", arch="sm_90a", cache=False))
    assert meta["tile_name"] == model_choice


def test_a_wrong_candidate_is_reported_not_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round whose output is wrong fails its candidates; what failed is never timed or stored."""
    model, args = _block(64, 32, 32)
    real = tune._close
    calls = iter(range(10))
    monkeypatch.setattr(tune, "_close", lambda got, exp, dt: "max error 9 (scale 1)" if next(calls) == 1
                        else real(got, exp, dt))
    [r] = tune.tune(model, args, target="cuda-sim", arch="sm_90a", timer=preferring("64x64/s4"))
    assert r.candidates == ("64x128/s4", "64x64/s4")  # 64 rows: the 64-row tiles only
    assert r.failed == {"64x64/s4": "max error 9 (scale 1)"} and list(r.times_ms) == ["64x128/s4"]
    assert tune.measured([r], "GPU") == {}  # one candidate timed: nothing to choose
    assert "| ↳ 64x64/s4 failed | | max error 9 (scale 1) |" in tune.table("x", [r])


@pytest.mark.slow  # ~13 s; make test-slow
def test_problems_of_a_conv_net_on_both_mappings() -> None:
    """Convolutions name their implicit GEMM's problem: mma.sync (sm_80) and wgmma (sm_90a)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 64, 1)).half()
    x = torch.randn(2, 16, 10, 10).half()
    captured = capture(model, (x,))
    for arch, mapping in (("sm_80", "conv-mma"), ("sm_90a", "conv-wgmma")):
        found = tune.problems_of(sextant.compile_graph(captured, target="cuda-sim", arch=arch, tiles=NO_TILES))
        assert {p.mapping for p in found} == {mapping}, found
        ks = sorted(p.k for p in found)
        assert ks == [32, 144], found  # 32 channels × 1×1, 16 × 3×3


def test_dry_run_command_checks_without_storing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("SEXTANT_TUNING", str(tmp_path / "store"))
    monkeypatch.delenv("OUT", raising=False)
    assert tune.main(["--dry-run", "--cases", "matmul-4096-fp16", "--out", str(tmp_path / "t.md")]) == 0
    text = (tmp_path / "t.md").read_text()
    assert "(dry run: checked, not timed)" in text and text in capsys.readouterr().out
    assert "| wgmma/sm_90a/f16/64x64x64*1 | 1 | 64x64/s4 | — | 2/2 match eager |" in text
    assert not (tmp_path / "store").exists()
    with pytest.raises(SystemExit):
        tune.main(["--dry-run", "--cases", "no-such-case"])
    assert "unknown or non-forward cases ['no-such-case']" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("arch,mapping", [("sm_90a", "conv-wgmma"), ("sm_80", "conv-mma")])
def test_every_conv_candidate_matches_eager(arch: str, mapping: str) -> None:
    """The implicit-GEMM convolutions' candidates too (200 output positions: the Hopper conv's
    64-row tiles, which the heuristic keeps for M ≤ 64, run ragged past one tile). The Hopper
    tiles are narrowed to the 40 channels before they are candidates: three 128-row tiles are
    one kernel, so one candidate (a round each would time the same kernel)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 40, 3, padding=1), torch.nn.ReLU()).half()
    x = torch.randn(2, 16, 10, 10).half()
    [r] = tune.tune(model, (x,), target="cuda-sim", arch=arch, timer=None)
    assert r.problem.mapping == mapping and r.problem.k == 144
    expected = {"conv-wgmma": ["128x40/s4/ws", "64x40/s4"], "conv-mma": [t.name for t in MMA_CANDIDATES]}[mapping]
    assert list(r.candidates) == expected
    assert r.failed == {} and r.checked == expected
