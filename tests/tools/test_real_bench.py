"""The real-size benchmark's plumbing on a tiny model (the real set runs in ``make bench``): the
measured FMA peak, the per-launch profile summed by kind, contraction shapes with MKL's figure."""

from __future__ import annotations

import pytest
import torch

from sextant.host import host_amx, host_pair_dot
from sextant.tools import real_bench
from sextant.tools.fma_peak import measure


def test_fma_peak_is_measured():
    peak = measure(seconds=0.05)
    assert peak.lanes in (8, 16) and peak.one_core > 1 and peak.all_cores > 1
    assert "GFLOP/s on one core" in str(peak)


@pytest.mark.parametrize(("cpu", "lanes"), [("znver3", 8), ("haswell", 8), ("skylake-avx512", 16)])
def test_fma_peak_loop_stays_in_registers(cpu, lanes):
    """The peak loop compiled for CPUs of both vector widths (whatever the host): one FMA per chain
    and nothing on the stack. 16 chains on AVX2 (16 registers) spilled and measured half the peak."""
    import llvmlite.binding as llvm

    from sextant.tools.fma_peak import _ir, chains

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, opt=3)
    asm = tm.emit_assembly(llvm.parse_assembly(_ir(lanes)))
    loop = next(blk.split("\n\tj")[0] for blk in asm.split("\n.LBB") if "vfmadd" in blk)
    assert loop.count("vfmadd") == chains(lanes)
    assert "rsp" not in loop, loop


def test_profile_of_a_small_resnet():
    row = real_bench.run_model("tiny", iters=1, inductor=False)
    assert row["rel_err"] < 1e-4
    assert {"conv", "matmul"} <= set(row["kinds"])
    assert 0 < row["contraction_ms"] <= row["kernels_ms"]
    assert row["gemms"] and all(g["gflops"] > 0 for g in row["gemms"])
    matmuls = [g for g in row["gemms"] if g["what"].startswith("matmul")]
    assert all(g["mkl_gflops"] > 0 for g in matmuls)
    table = real_bench.to_markdown([row], peak_gflops=500.0)
    assert "| tiny |" in table and "conv →" in table


@pytest.mark.skipif(not host_pair_dot(), reason="this CPU has no AVX-512-BF16 (vdpbf16ps)")
def test_pair_dot_peak_is_measured():
    peak = measure(seconds=0.05, kind="bf16 dot")
    assert peak.one_core > 1 and "vdpbf16ps" in str(peak)


def test_profile_of_a_small_resnet_in_bf16():
    row = real_bench.run_model("tiny", iters=1, inductor=False, dtype=torch.bfloat16)
    assert row["rel_err"] < 3e-2
    assert row["gemms"] and all(g["gflops"] > 0 for g in row["gemms"])


def test_amx_peak_loop_keeps_its_tiles_in_registers():
    """The AMX peak loop compiled for Sapphire Rapids (whatever the host): four tdpbf16ps a trip and
    no tile load or store inside the loop."""
    import llvmlite.binding as llvm

    from sextant.tools.fma_peak import _amx_ir

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(cpu="sapphirerapids",
                                                                 features="+amx-tile,+amx-bf16", opt=3)
    asm = tm.emit_assembly(llvm.parse_assembly(_amx_ir()))
    loop = next(blk.split("\n\tj")[0] for blk in asm.split("\n.LBB") if "tdpbf16ps" in blk)
    assert loop.count("tdpbf16ps") % 4 == 0 and loop.count("tdpbf16ps") >= 4
    assert "tileloadd" not in loop and "tilestored" not in loop, loop
    assert "ldtilecfg" in asm


@pytest.mark.skipif(not host_amx(), reason="this CPU has no AMX tiles (or Linux did not grant them)")
def test_amx_peak_is_measured():
    peak = measure(seconds=0.05, kind="amx")
    assert peak.one_core > 1 and "tdpbf16ps" in str(peak)
