"""The AMX tile matmul (kernel.ir.TileMatmul) written directly in kernel IR: run on every machine
through its expansion into pair dots (kernel/tiles.py), compiled to AMX instructions for an AMX
CPU on any machine (the assembly checked), and run natively where this CPU has AMX."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sextant.codegen import compile_kernels, cpu_amx
from sextant.graph.dtypes import DType
from sextant.host import host_amx
from sextant.kernel.ir import Assign, Buffer, For, Kernel, Load, Special, Store, TileMatmul, Var, add, c, mul
from sextant.kernel.printer import print_kernel
from sextant.kernel.serialize import kernel_from_json, kernel_to_json
from sextant.kernel.tiles import expand_tiles
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

F32, BF16 = DType.f32, DType.bf16


def tiles_kernel(k: int, blocks: int = 2, row_tiles: int = 2, col_tiles: int = 2) -> Kernel:
    """Block ``b``: ``out[b] = A[b·R : (b+1)·R] @ B`` through one tile matmul (B in pairs of K,
    strips of 16 columns), copied out of the local result row by row."""
    rows, cols = 16 * row_tiles, 16 * col_tiles
    blk, u = Var("blk"), Var("u")
    tm = TileMatmul("acc", "a", mul(blk, c(rows * k)), k, "bp", c(0), k * 16, k, row_tiles, col_tiles)
    body = (
        Assign(blk, Special("bid", "x")),
        tm,
        For(u, c(0), c(rows * cols), 1, (Store("out", add(mul(blk, c(rows * cols)), u), Load("acc", u, F32)),)),
    )
    params = (Buffer("a", BF16, blocks * rows * k), Buffer("bp", BF16, k * cols),
              Buffer("out", F32, blocks * rows * cols, role="out"))
    return Kernel(f"tiles_{row_tiles}x{col_tiles}", params, (blocks, 1, 1), (1, 1, 1), body,
                  local=(Buffer("acc", F32, rows * cols, "local"),))


def operands(k: int, blocks: int = 2, row_tiles: int = 2, col_tiles: int = 2):
    a = torch.randn(blocks * 16 * row_tiles, k).bfloat16()
    b = torch.randn(k, 16 * col_tiles).bfloat16()
    # [strips, K/2, 16, 2]: each strip of 16 columns contiguous, pairs of K next to each other
    bp = b.view(k // 2, 2, col_tiles, 16).permute(2, 0, 3, 1).contiguous()
    return a, b, bp


def run(kern: Kernel, k: int, check: bool = False, **shape) -> None:
    a, b, bp = operands(k, **shape)
    out = torch.full((a.shape[0], b.shape[1]), float("nan"))
    compile_kernels([kern], check_races=check).launch(kern.name, [a, bp, out])
    torch.testing.assert_close(out, a.float() @ b.float(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("how", ["pair dots", "checked"])
@pytest.mark.parametrize("row_tiles, col_tiles", [(2, 2), (1, 3), (3, 1)])
def test_tile_matmul_as_pair_dots_matches_f32_sums(how, row_tiles, col_tiles, monkeypatch):
    monkeypatch.setattr(cpu_amx, "native_amx", lambda: False)  # as a CPU without AMX: in this process
    monkeypatch.setenv("SEXTANT_CACHE", "0")
    monkeypatch.setenv("SEXTANT_COMPILE_JOBS", "1")
    kern = tiles_kernel(96, row_tiles=row_tiles, col_tiles=col_tiles)
    verify_kernel(kern)
    run(kern, 96, check=how == "checked", row_tiles=row_tiles, col_tiles=col_tiles)


def test_expansion_is_pair_dots_over_pairs_of_k():
    text = print_kernel(expand_tiles(tiles_kernel(64)))
    assert "tile_matmul" not in text
    assert "for (tm0_kp = 0; tm0_kp < 32; tm0_kp += 1)" in text
    assert text.count("pair_dot_x16(") == 2  # one per strip of 16 columns, per row and pair of K


def test_tile_matmul_compiles_to_amx_tiles():
    asm = cpu_amx.sapphire_rapids_assembly([tiles_kernel(768)])  # whatever this machine is
    assert "ldtilecfg" in asm and "tilerelease" in asm
    assert asm.count("tdpbf16ps") >= 4  # 2×2 accumulators per k step (LLVM may unroll the k loop)
    assert asm.count("tdpbf16ps") % 4 == 0
    assert asm.count("tilestored") == 4  # once each, after the k loop: the accumulators stay in tiles
    assert "tilezero" in asm
    assert "vdpbf16ps" not in asm  # not expanded into pair dots


@pytest.mark.skipif(not host_amx(), reason="this CPU has no AMX tiles (amx-tile/amx-bf16), or Linux did not "
                                          "grant this process their state: the native tiles cannot run here")
@pytest.mark.parametrize("row_tiles, col_tiles", [(2, 2), (1, 3)])
def test_tile_matmul_runs_on_amx(row_tiles, col_tiles, monkeypatch):
    monkeypatch.setenv("SEXTANT_CACHE", "0")
    kern = tiles_kernel(256, row_tiles=row_tiles, col_tiles=col_tiles)
    run(kern, 256, row_tiles=row_tiles, col_tiles=col_tiles)


def test_tile_matmul_text_and_json_round_trip():
    kern = tiles_kernel(64)
    text = print_kernel(kern)
    assert ("tile_matmul_32x32x64(&acc[0], &a[blk * 2048] rows 64 apart, &bp[0] in pairs of K, strips 1024 apart)"
            in text)
    assert kernel_from_json(kernel_to_json(kern)) == kern


@pytest.mark.parametrize("change, message", [
    (dict(k=48), "multiple of 32"),
    (dict(row_tiles=3, col_tiles=2), "needs 11 tile registers"),
    (dict(a_stride=32), "fewer than K"),
    (dict(b="out"), "multiplies bf16 operands"),
    (dict(out="a"), "f32 local buffer"),
    (dict(b="nowhere"), "is not a buffer"),
])
def test_verifier_refuses_bad_tile_matmuls(change, message):
    kern = tiles_kernel(64)
    bad = dataclasses.replace(kern.body[1], **change)
    with pytest.raises(KernelVerificationError, match=message):
        verify_kernel(dataclasses.replace(kern, body=(kern.body[0], bad, kern.body[2])))


def test_verifier_finds_a_tile_matmul_reading_past_a():
    kern = tiles_kernel(64)
    short = tuple(Buffer("a", BF16, 2 * 32 * 64 - 1) if p.name == "a" else p for p in kern.params)
    with pytest.raises(KernelVerificationError, match="out of bounds"):
        verify_kernel(dataclasses.replace(kern, params=short))


def test_object_cache_keys_native_and_expanded_tiles_apart(monkeypatch):
    """An AMX CPU whose process was refused the tile state must not load a native object another
    process cached: the key of a kernel with tile matmuls says which lowering it is."""
    from sextant.codegen.llvm_cpu import host_target_machine, kernel_key
    from sextant.codegen.objects import DEFAULT_OPTIONS

    tm = host_target_machine()
    plain = tiles_kernel(64)
    no_tiles = dataclasses.replace(plain, body=(plain.body[0], plain.body[2]))
    keys = {}
    for native in (True, False):
        monkeypatch.setattr(cpu_amx, "native_amx", lambda native=native: native)
        keys[native] = (kernel_key(plain, tm, DEFAULT_OPTIONS, 32), kernel_key(no_tiles, tm, DEFAULT_OPTIONS, 32))
    assert keys[True][0] != keys[False][0]
    assert keys[True][1] == keys[False][1]
