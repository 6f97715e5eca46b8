"""Roofline estimates: how fast a launch could run on a given NVIDIA GPU, and what limits it.

A launch that does ``F`` FLOPs and must move ``B`` bytes (:mod:`sextant.report.cost`) takes at
least ``max(F / peak, B / bandwidth)``; we add a fixed launch overhead, since for small models
that is most of the time. The *bound* says which term won; the *ridge point* (peak / bandwidth,
FLOP per byte) is the arithmetic intensity above which a kernel is compute-bound.

Two refinements keep the estimate a lower bound that means something for small launches:

- the compute peak is the rate of the units the kernel computes on: the dense tensor-core rate
  for an f16/bf16 matmul mapped onto tensor cores (``mma.sync``), otherwise the CUDA cores'
  *non-tensor* rate of the kernel's element type (``fma.rn.f32``…);
- a block runs on one SM, so a launch with fewer blocks than the GPU has SMs can use at most
  that share of the compute peak. Memory bandwidth is not scaled: a few SMs can keep many loads
  in flight, and how many is the schedule's business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sextant.kernel.devices import GPUS, TERA, GpuSpec
from sextant.report.cost import LaunchCost

__all__ = ["GPUS", "TERA", "Estimate", "GpuSpec", "estimate", "gpu_spec", "kernel_totals", "time_by_bound"]

LAUNCH_OVERHEAD_S = 3e-6  # an assumption, not a datasheet figure: back-to-back launches from a stream cost ~2-5 µs


def gpu_spec(name: str | GpuSpec) -> GpuSpec:
    """Look up a GPU by its short name (``"H100"``, case-insensitive; ``"h100-sxm"`` works too)."""
    if isinstance(name, GpuSpec):
        return name
    key = name.upper().split("-")[0].split(" ")[0]
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; the roofline knows {', '.join(GPUS)}")
    return GPUS[key]


@dataclass(frozen=True)
class Estimate:
    """The roofline prediction for one launch on one GPU."""

    cost: LaunchCost
    gpu: GpuSpec
    peak_flops: float  # the compute roof this launch can reach (non-tensor rate × SM share)
    compute_s: float
    memory_s: float
    overhead_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def roofline_bound(self) -> str:
        """"compute" or "memory": which roof the launch sits under."""
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def bound(self) -> str:
        """What most of the predicted time is: "launch" overhead, or the roofline's bound."""
        return "launch" if self.overhead_s > max(self.compute_s, self.memory_s) else self.roofline_bound

    @property
    def sm_share(self) -> float:
        return min(1.0, self.cost.blocks / self.gpu.sms)

    @property
    def ridge(self) -> float:
        """Ridge point of this launch's roofs, FLOP/byte."""
        return self.peak_flops / self.gpu.bandwidth

    @property
    def attainable_flops(self) -> float:
        """FLOP/s the roofline allows at this launch's arithmetic intensity (overhead excluded)."""
        return min(self.peak_flops, self.cost.intensity * self.gpu.bandwidth)


def estimate(cost: LaunchCost, gpu: str | GpuSpec = "H100", launch_overhead_s: float = LAUNCH_OVERHEAD_S) -> Estimate:
    spec = gpu_spec(gpu)
    peak = spec.peak_flops(cost.dtype, cost.tensor_core) * min(1.0, max(cost.blocks, 1) / spec.sms)
    return Estimate(cost, spec, peak, cost.flops / peak, cost.bytes / spec.bandwidth, launch_overhead_s)


@dataclass(frozen=True)
class KernelTotal:
    """Where predicted time goes, per unique kernel (all its launches together)."""

    kernel: str
    kind: str
    launches: int
    time_s: float
    overhead_s: float
    flops: int
    bytes: int
    bounds: tuple[str, ...]  # each launch's bound, in launch order
    share: float  # of the whole program's predicted time

    @property
    def bound(self) -> str:
        """The bound most of this kernel's launches hit."""
        return max(dict.fromkeys(self.bounds), key=self.bounds.count)


def kernel_totals(estimates: Sequence[Estimate]) -> list[KernelTotal]:
    """Per-kernel sums of predicted time, largest first."""
    total = sum(e.time_s for e in estimates) or math.inf
    by_kernel: dict[str, list[Estimate]] = {}
    for e in estimates:
        by_kernel.setdefault(e.cost.kernel, []).append(e)
    rows = []
    for name, es in by_kernel.items():
        t = sum(e.time_s for e in es)
        rows.append(KernelTotal(name, es[0].cost.kind, len(es), t, sum(e.overhead_s for e in es),
                                sum(e.cost.flops for e in es), sum(e.cost.bytes for e in es),
                                tuple(e.bound for e in es), t / total))
    return sorted(rows, key=lambda r: -r.time_s)


def time_by_bound(estimates: Sequence[Estimate]) -> dict[str, float]:
    """Predicted seconds split into launch overhead, and compute- or memory-bound roofline time."""
    out = {"launch overhead": 0.0, "compute-bound": 0.0, "memory-bound": 0.0}
    for e in estimates:
        out["launch overhead"] += e.overhead_s
        out[f"{e.roofline_bound}-bound"] += max(e.compute_s, e.memory_s)
    return out
