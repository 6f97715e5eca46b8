"""The persistent Hopper GEMM (a tile candidate the autotuner may pick, never the default): one
block per SM walks its output tiles in grouped order, its producer running on into the next
tile's stages. Checked through cuda-sim with the race checker (mbarrier phases across tile
boundaries included) on a target with few SMs, so that each block computes several tiles, and
assembled by ptxas for sm_90a without spills or serialised wgmmas."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sextant.codegen.llvm_cpu import compile_kernels
from sextant.codegen.llvm_nvptx import emit_ptx
from sextant.codegen.ptxas import assemble
from sextant.frontend.capture import capture
from sextant.graph.passes import run_pipeline
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.gpu_wgmma import CANDIDATES, GROUP_M, choose_wg_tile
from sextant.schedule.program import schedule
from sextant.schedule.target import gpu_target
from sextant.schedule.tuning import TileProblem, TileTable

PERSISTENT = [t for t in CANDIDATES if t.persistent]


class Linear(torch.nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(k, n)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.relu(self.lin(x)) + r


def _program(mod: torch.nn.Module, args: tuple, tiles: dict[TileProblem, str], sms: int) -> tuple[object, torch.Tensor]:
    """Schedule for an sm_90a GPU of ``sms`` SMs with ``tiles`` forced; run through cuda-sim
    (race-checked); the program and the output."""
    graph = run_pipeline(capture(mod, args))
    target = dataclasses.replace(gpu_target("sm_90a"), cores=sms, tiles=TileTable.of(tiles))
    program = schedule(graph, target)
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values()), check_races=True).launch)
    return program, runner(list(args))[0]


def _run(mod: torch.nn.Module, args: tuple, tile: str, problem: TileProblem, sms: int) -> tuple[object, torch.Tensor]:
    """:func:`_program` for a model of one kernel: that kernel and the output."""
    program, out = _program(mod, args, {problem: tile}, sms)
    (kern,) = program.kernels.values()  # type: ignore[attr-defined]
    return kern, out


@pytest.mark.parametrize("m,k,n,tile,sms", [
    (300, 200, 300, "128x128/s4/ws/p", 4),  # 9 tiles over 4 blocks (3, 2, 2, 2); ragged M, N and K
    (300, 64, 300, "128x128/s4/ws/p", 2),   # one K tile: the producer's first copies span two tiles
    (1300, 64, 100, "128x128/s4/ws/p", 3),  # 11 row tiles: a last group of 3 (GROUP_M = 8)
    (2048, 64, 200, "128x128/s4/ws/p", 5),  # 16 row tiles: two whole groups (the static branch)
    (260, 136, 520, "128x256/s4/ws/p", 3),  # the 128 × 256 tile
])
def test_persistent_gemm_matches_eager_over_many_tiles_per_block(m: int, k: int, n: int, tile: str,
                                                                  sms: int) -> None:
    torch.manual_seed(0)
    mod = Linear(k, n).half()
    x, r = torch.randn(m, k).half(), torch.randn(m, n).half()
    kern, got = _run(mod, (x, r), tile, TileProblem("wgmma", m, n, k, 1, "f16", "sm_90a"), sms)
    assert (kern.meta["tile_name"], kern.meta["tile_source"], kern.meta["persistent"]) == (tile, "tuned", True)
    bm, bn = (int(v) for v in tile.split("/")[0].split("x"))
    assert kern.grid == (min(sms, -(-m // bm) * -(-n // bn)), 1, 1)
    expected = mod.float()(x.float(), r.float())
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_batched_persistent_gemm() -> None:
    """Tiles of several batch entries share the blocks (the tile index carries the batch)."""

    class Bmm(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a @ b

    torch.manual_seed(1)
    a, b = torch.randn(3, 150, 96).half(), torch.randn(3, 96, 136).half()
    kern, got = _run(Bmm(), (a, b), "128x128/s4/ws/p", TileProblem("wgmma", 150, 136, 96, 3, "f16", "sm_90a"), 5)
    assert kern.meta.get("persistent") and kern.grid == (5, 1, 1)  # 2 × 2 × 3 = 12 tiles
    torch.testing.assert_close(got.float(), a.float() @ b.float(), atol=3e-2, rtol=3e-2)


class Attention(torch.nn.Module):
    """Causal self-attention whose output projection reads the heads in place (``tma.HeadsOperand``,
    rows per batch, a flat ``[b·n, d]`` output)."""

    def __init__(self, d: int = 64, h: int = 2) -> None:
        super().__init__()
        self.h, self.qkv, self.o = h, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).split(d, -1)
        heads = [t.reshape(b, n, self.h, d // self.h).transpose(1, 2) for t in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        return self.o(o.transpose(1, 2).reshape(b * n, d))


def test_persistent_output_projection_reads_heads_per_batch() -> None:
    """Both GEMMs of an attention block persistent on 3 SMs: the QKV projection (2 × 2 tiles) and
    the output projection, whose A is read head by head and whose row tiles run per batch (2 × 1
    tiles: the tile index carries the batch into the flat output's rows)."""
    torch.manual_seed(3)
    mod, x = Attention().half(), torch.randn(2, 80, 64).half()
    tiles = {TileProblem("wgmma", 160, 192, 64, 1, "f16", "sm_90a"): "128x128/s4/ws/p",
             TileProblem("wgmma", 80, 64, 64, 2, "f16", "sm_90a"): "128x128/s4/ws/p"}
    program, got = _program(mod, (x,), tiles, 3)
    persistent = [k for k in program.kernels.values() if k.meta.get("persistent")]  # type: ignore[attr-defined]
    assert len(persistent) == 2 and all(k.meta["tile_source"] == "tuned" for k in persistent)
    torch.testing.assert_close(got.float(), mod.float()(x.float()), atol=3e-2, rtol=3e-2)


def test_grouped_order_visits_every_tile_once() -> None:
    """The order the kernel computes, replayed in Python: each block's tiles, all blocks together,
    are every (batch, row tile, column tile) exactly once, and consecutive tiles stay in a group of
    ``GROUP_M`` row tiles."""
    for mt, nt, batch in ((11, 3, 1), (8, 5, 2), (3, 7, 1), (17, 1, 1)):
        per, width = mt * nt, GROUP_M * nt
        seen = []
        for tid in range(per * batch):
            r = tid % per
            first = r // width * GROUP_M
            rows = min(mt - first, GROUP_M)
            seen.append((tid // per, first + r % width % rows, r % width // rows))
            assert seen[-1][1] // GROUP_M == first // GROUP_M
        assert sorted(seen) == [(z, i, j) for z in range(batch) for i in range(mt) for j in range(nt)]


@pytest.mark.parametrize("m,k,n", [(512, 768, 2304), (2048, 512, 4096)])  # ≤ 1 tile per block; 2–4
def test_persistent_tiles_assemble_without_spills_or_serialisation(m: int, k: int, n: int) -> None:
    """ptxas serialised these wgmmas (C7514) while any instruction sat between the last K step and
    the final wait — LLVM had sunk the epilogue's address arithmetic there; it now derives from
    values passed through that wait."""
    torch.manual_seed(2)
    mod = Linear(k, n).half()
    args = (torch.randn(m, k).half(), torch.randn(m, n).half())
    graph = run_pipeline(capture(mod, args))
    for tile in PERSISTENT:
        target = dataclasses.replace(gpu_target("sm_90a"), tiles=TileTable.of(
            {TileProblem("wgmma", m, n, k, 1, "f16", "sm_90a"): tile.name}))
        (kern,) = schedule(graph, target).kernels.values()
        tiles = m // tile.bm * -(-n // tile.bn)
        assert kern.meta["tile_name"] == tile.name and kern.grid == (min(132, tiles), 1, 1)
        res = assemble(emit_ptx([kern], arch="sm_90a").ptx, "sm_90a")
        assert "C7512" not in res.log and "serialized" not in res.log and "C7508" not in res.log, res.log
        (r,) = res.kernels.values()
        assert r.spill_stores == r.spill_loads == 0, (tile, r)


def test_the_heuristic_never_picks_a_persistent_tile() -> None:
    for m in (64, 65, 512, 4096):
        for n in (8, 64, 200, 4096):
            assert not choose_wg_tile(m, n).persistent
