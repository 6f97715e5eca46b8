"""The tensor-core tile choice's cost model (``schedule/gemm_cost.py``): occupancy from registers,
shared memory and threads; waves over the SMs; and the ranking it gives familiar shapes."""

from __future__ import annotations

from sextant.schedule import gpu_mma, gpu_tf32
from sextant.schedule.gemm_cost import estimate, gpu_of, occupancy
from sextant.schedule.gpu_mma import CANDIDATES, choose_tile, rank_tiles
from sextant.schedule.target import gpu_target

H100, A100 = gpu_target("sm_90"), gpu_target("sm_80")
BIG, MID, SMALL = CANDIDATES  # 128×128, 128×64, 64×64


def test_occupancy_is_the_tightest_of_registers_shared_memory_and_threads() -> None:
    assert occupancy(256, 128, 38_912, H100) == 2  # 8 warps × 32 × 128 registers = half the register file
    assert occupancy(128, 96, 19_456, H100) == 5  # registers again: 12 288 a block of 65 536
    assert occupancy(128, 32, 20_000, H100) == 11  # few registers: 228 KiB of shared memory / 20 000 B
    assert occupancy(128, 32, 20_000, A100) == 8  # the A100's 164 KiB
    assert occupancy(1024, 16, 0, H100) == 2  # threads: 2048 per SM
    assert occupancy(256, 255, 1 << 20, H100) == 1  # never below one block


def test_waves_and_estimates() -> None:
    e = estimate(128, 128, 256, 128, 38_912, 4096, 4096, 1, H100)
    assert (e.blocks, e.occupancy, e.waves) == (1024, 2, 4)  # 1024 blocks over 132 SMs × 2
    assert gpu_of(H100).name.startswith("H100") and gpu_of(A100).name.startswith("A100")
    # twice the batch is twice the work: the estimate doubles once the GPU is full
    one, two = (estimate(128, 128, 256, 128, 38_912, 2048, 2048, b, H100).seconds for b in (4, 8))
    assert two == 2 * one


def test_ranking_prefers_big_tiles_when_blocks_are_plenty_and_small_ones_when_not() -> None:
    assert choose_tile(4096, 4096, 1, H100) == BIG  # least operand traffic per FLOP, GPU full either way
    assert choose_tile(4096, 2304, 1, H100) == BIG  # GPT-2's fused QKV at batch 8 × 512
    assert choose_tile(1024, 1024, 1, H100) == MID  # 64 big tiles idle half the SMs; 128 mid tiles do not
    assert choose_tile(512, 768, 1, H100) == SMALL  # 24 big tiles would idle 108 SMs
    ranked = rank_tiles(1024, 1024, 1, H100)
    assert next(t for _, t in ranked) == MID and {t for _, t in ranked} == set(CANDIDATES)
    assert [e.seconds for e, _ in ranked] == sorted(e.seconds for e, _ in ranked)


def test_tf32_candidates_rank_with_four_byte_operands() -> None:
    tile = choose_tile(4096, 4096, 1, H100, gpu_tf32.CANDIDATES, itemsize=4)
    assert tile == gpu_tf32.CANDIDATES[0]
    assert choose_tile(256, 256, 1, H100, gpu_tf32.CANDIDATES, itemsize=4) == gpu_tf32.CANDIDATES[-1]
    assert [t.stages for t in gpu_mma.CANDIDATES] == [2, 3, 3]  # within 48 KiB of static shared memory
