"""Roofline arithmetic on hand-made launch costs."""

import pytest

from sextant.graph.dtypes import DType
from sextant.report.cost import LaunchCost
from sextant.report.roofline import GPUS, estimate, gpu_spec, kernel_totals, time_by_bound


def _cost(flops: int, nbytes: int, blocks: int = 1000, dtype: DType = DType.f32, kernel: str = "k") -> LaunchCost:
    return LaunchCost(0, kernel, "matmul", dtype, flops, 0, nbytes // 2, nbytes - nbytes // 2, blocks)


def test_specs_lookup() -> None:
    assert gpu_spec("h100") is GPUS["H100"] and gpu_spec("H200-SXM") is GPUS["H200"]
    assert GPUS["H200"].bandwidth > GPUS["H100"].bandwidth > GPUS["A100"].bandwidth
    assert GPUS["A100"].fp32_flops == 19.5e12 and GPUS["H100"].sms == 132
    with pytest.raises(ValueError, match=r"unknown GPU 'V100'.*A100, H100, H200"):
        gpu_spec("V100")


def test_compute_bound_above_the_ridge() -> None:
    e = estimate(_cost(10**10, 10**6), "H100", launch_overhead_s=0)
    h = GPUS["H100"]
    assert e.cost.intensity == 10**4 > e.ridge == pytest.approx(h.fp32_flops / h.bandwidth)
    assert e.compute_s == pytest.approx(1e10 / 66.9e12) and e.memory_s == pytest.approx(1e6 / 3.35e12)
    assert e.bound == e.roofline_bound == "compute" and e.time_s == e.compute_s


def test_memory_bound_below_the_ridge_and_launch_overhead() -> None:
    e = estimate(_cost(10**6, 10**8), "A100")
    assert e.roofline_bound == "memory" and e.memory_s == pytest.approx(1e8 / 2039e9)
    assert e.time_s == pytest.approx(e.memory_s + 3e-6)
    tiny = estimate(_cost(100, 400), "A100")
    assert tiny.bound == "launch" and tiny.roofline_bound == "memory"


def test_few_blocks_use_few_sms_and_half_precision_has_its_own_peak() -> None:
    full, half = estimate(_cost(10**9, 10, blocks=132)), estimate(_cost(10**9, 10, blocks=66))
    assert half.compute_s == pytest.approx(2 * full.compute_s) and half.sm_share == 0.5
    assert estimate(_cost(10**9, 10, dtype=DType.f16)).peak_flops == pytest.approx(133.8e12)


def test_tensor_core_matmuls_get_the_tensor_core_peak() -> None:
    c = LaunchCost(0, "k", "matmul", DType.f16, 10**9, 0, 10, 10, 132, tensor_core=True)
    assert estimate(c, "H100").peak_flops == pytest.approx(989.4e12)
    assert estimate(c, "A100").peak_flops == pytest.approx(312e12 * 108 / 108)
    f32 = LaunchCost(0, "k", "matmul", DType.f32, 10**9, 0, 10, 10, 132, tensor_core=True)
    assert estimate(f32, "H100").peak_flops == pytest.approx(66.9e12)  # no f32 tensor-core mapping


def test_totals_per_kernel() -> None:
    es = [estimate(_cost(10**9, 10**6, kernel="a")), estimate(_cost(10**6, 10**8, kernel="b")),
          estimate(_cost(10**9, 10**6, kernel="a"))]
    rows = kernel_totals(es)
    assert [r.kernel for r in rows] == ["a", "b"] and rows[0].launches == 2
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    assert rows[0].time_s == pytest.approx(es[0].time_s + es[2].time_s) and rows[1].bound == "memory"
    split = time_by_bound(es)
    assert sum(split.values()) == pytest.approx(sum(e.time_s for e in es))
    assert split["launch overhead"] == pytest.approx(3 * 3e-6)
