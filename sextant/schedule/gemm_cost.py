"""Which block tile a tensor-core GEMM uses: a small candidate set ranked by an analytic model.

Every candidate is a verified mapping (conflict-free ``ldmatrix``, 0 spills — tests); what
varies per problem is which one wastes least. The model estimates, for an ``m × n`` product
(× ``batch``) on the target's GPU, the time per unit of K (all candidates walk the whole of K):

* **occupancy** — blocks resident per SM: the fewest that the registers (the candidate's ptxas
  figure, recorded in :class:`TcTile` and checked against ptxas by a test, times its threads, of
  64 K per SM), its shared-memory stages (of the SM's shared memory) and its threads (2048
  per SM) allow;
* **waves** — ``⌈blocks / (SMs · occupancy)⌉``; in a wave an SM holds ``r = min(occupancy,
  ⌈blocks / SMs⌉)`` blocks;
* **a wave's time** — the larger of the tensor time, ``r · 2·bm·bn`` FLOPs at the SM's share of
  the tensor-core peak, slowed by ``min(1, r·warps / 8)`` when fewer than 8 warps (two per SM
  sub-partition) are there to hide ``mma.sync``'s latency, and the operand traffic, ``r ·
  (bm + bn)`` elements a K step at the SM's share of L2 bandwidth (taken as twice the device
  memory bandwidth: operand tiles are re-read by neighbouring blocks, mostly from L2). Bytes
  per FLOP fall with the tile (``(bm+bn) / (2·bm·bn)`` elements), which is what favours large
  tiles once there are blocks enough for every SM.

The peaks are the datasheet figures of the architecture's data-centre part
(``kernel.devices.GPUS``: A100 for sm_8x, H100 for sm_90 and later). The constants are
assumptions to be replaced by measurement: :func:`rank_tiles` returns every candidate with its
estimate, so an autotuner on a real GPU can time the same candidates instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sextant.kernel.devices import GPUS, GpuSpec
from sextant.schedule.target import TargetDesc, sm_version

REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
LATENCY_WARPS = 8  # warps an SM needs in flight to keep its tensor cores busy (2 per sub-partition)
L2_OVER_DRAM = 2.0  # L2 bandwidth as a multiple of device memory bandwidth (an assumption)
_SHARED_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}


@dataclass(frozen=True)
class TileEstimate:
    """One candidate's figures for one problem; ``seconds`` per unit of K (ranking only)."""

    blocks: int
    occupancy: int  # blocks resident per SM
    waves: int
    seconds: float


def _arch(target: TargetDesc) -> int:
    return sm_version(target) or 90  # the model is for GPUs; anything else is costed as Hopper


def gpu_of(target: TargetDesc) -> GpuSpec:
    """The data-centre part whose datasheet stands for ``target``'s architecture."""
    return GPUS["A100"] if _arch(target) < 90 else GPUS["H100"]


def occupancy(threads: int, registers: int, shared_bytes: int, target: TargetDesc) -> int:
    """Blocks of ``threads`` threads with ``registers`` each and ``shared_bytes`` that fit on one SM
    (registers allocated per warp in units of 256)."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = REGISTERS_PER_SM // (per_warp * math.ceil(threads / 32))
    by_shared = _SHARED_PER_SM.get(_arch(target), 100 * 1024) // max(1, shared_bytes)
    return max(1, min(by_regs, by_shared, THREADS_PER_SM // threads, BLOCKS_PER_SM))


def estimate(bm: int, bn: int, threads: int, registers: int, shared_bytes: int, m: int, n: int, batch: int,
             target: TargetDesc, itemsize: int = 2) -> TileEstimate:
    """The model above for one candidate tile ``bm × bn`` (``itemsize``: 2 for f16/bf16, 4 for
    tf32, which runs at half the half-precision tensor rate)."""
    gpu = gpu_of(target)
    sms = target.cores
    blocks = math.ceil(m / bm) * math.ceil(n / bn) * batch
    occ = occupancy(threads, registers, shared_bytes, target)
    waves = math.ceil(blocks / (sms * occ))
    resident = min(occ, math.ceil(blocks / sms))
    peak = gpu.tensor_bf16_flops / (1 if itemsize == 2 else 2) / gpu.sms
    busy = min(1.0, resident * threads / 32 / LATENCY_WARPS)
    tensor = resident * 2 * bm * bn / (peak * busy)
    traffic = resident * (bm + bn) * itemsize / (gpu.bandwidth * L2_OVER_DRAM / gpu.sms)
    return TileEstimate(blocks, occ, waves, waves * max(tensor, traffic))
