"""The wide f32 register tile (``kernels.wide_tile``: 6 rows × 4 vectors) for GEMMs on weights laid
out at compile time — a Linear's panels, a convolution's strips — compiled for AVX-512 whatever the
host (the JIT-compiled code runs on any x86-64), checked against eager on fresh random inputs, and
its k loop checked to stay in registers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.graph.passes import run_pipeline
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.cpu_conv import conv_columns
from sextant.schedule.kernels import panel_tile, tile_rows
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target

AVX512, AVX2 = cpu_target(cores=2, vector_bytes=64), cpu_target(cores=2, vector_bytes=32)


@pytest.mark.parametrize(("target", "n", "tile"), [
    (AVX512, 768, (6, 64)), (AVX512, 64, (6, 64)), (AVX512, 50257, (6, 64)),  # ragged but wide: < 1/8 padding
    (AVX512, 96, (8, 32)), (AVX512, 40, (8, 32)), (AVX512, 12, (8, 4)),  # a ragged 64-strip would pad a third
    (AVX2, 768, (6, 16)),  # 16 ymm registers: no room for four vectors of B
])
def test_wide_tile_where_the_weight_is_wide(target, n, tile) -> None:
    assert panel_tile(target, n) == tile
    assert tile_rows(target, tile[1]) == tile[0]


def _run(model: nn.Module, x: torch.Tensor, target) -> tuple[object, torch.Tensor, torch.Tensor]:
    program = schedule(run_pipeline(sextant.capture(model.eval(), (x,))), target)
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)
    fresh = torch.randn_like(x)
    (got,) = runner([fresh])
    return program, got, fresh


@pytest.mark.parametrize(("m", "k", "hidden", "n"), [
    (37, 64, 128, 64),  # ragged M: the last 6-row tile clamps
    (5, 48, 576, 520),  # N = 520: a padded last strip; 5 rows, under one tile
    (70, 1100, 192, 64),  # K = 1100 walked in K blocks
])
def test_linear_layers_on_the_wide_tile_match_eager(m, k, hidden, n) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, hidden), nn.GELU(), nn.Linear(hidden, n))
    program, got, x = _run(model, torch.randn(m, k), AVX512)
    tiles = [kr.meta.get("weight") for kr in program.kernels.values() if kr.meta.get("weight")]
    assert all(t.endswith(", 64] in panels") for t in tiles) and len(tiles) == 2, tiles
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("cin", "cout", "ks", "hw", "stride"), [
    (16, 64, 3, 9, 1), (32, 128, 1, 7, 1), (8, 192, 3, 11, 2),
])
def test_convolutions_on_the_wide_tile_match_eager(cin, cout, ks, hw, stride) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(cin, cout, ks, stride=stride, padding=ks // 2), nn.ReLU())
    program, got, x = _run(model, torch.randn(1, cin, hw, hw), AVX512)
    assert conv_columns(next(n for n in program.graph.nodes if n.op == "conv"), AVX512) == 64
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)


def test_wide_k_loop_keeps_its_tile_in_registers() -> None:
    """The panel GEMM's k loop compiled for an AVX-512 Xeon: 24 FMAs (6 rows × 4 vectors), no
    stack access — 24 accumulators, 4 vectors of B and a broadcast fit the 32 zmm registers."""
    import llvmlite.binding as llvm

    from sextant.codegen.llvm_cpu import DEFAULT_OPTIONS, emit_module
    from sextant.codegen.objects import optimize

    program = schedule(run_pipeline(sextant.capture(nn.Linear(256, 768).eval(), (torch.randn(128, 256),))), AVX512)
    (kernel,) = [kr for kr in program.kernels.values() if kr.meta.get("weight")]
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(cpu="icelake-server", opt=3)
    asm = tm.emit_assembly(optimize(str(emit_module([kernel], tm, vector_bytes=64)), tm, DEFAULT_OPTIONS))
    blocks = [blk.split("\n\tj")[0] for blk in asm.split("\n.LBB")]
    blocks = [blk for blk in blocks if blk.count("vfmadd231ps") >= 24]
    assert blocks, "no block with 24 FMAs in the panel matmul"
    inner = min(blocks, key=len)
    assert inner.count("vfmadd231ps") == 24
    assert "rsp" not in inner, f"the wide k loop spills:\n{inner}"
