"""The CPU matmul's register tile follows the target's vector width (6×16 for AVX2, 8×32 for
AVX-512); both tilings are checked here whatever the host, at ragged sizes and in f16, so the
one the host does not pick is still tested (the JIT-compiled code runs on any x86-64 host)."""

from __future__ import annotations

import pytest
import torch

from sextant.codegen.llvm_cpu import compile_kernels
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.passes import run_pipeline
from sextant.graph.reference import run_graph
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.kernels import micro_tile, narrow_columns
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target


@pytest.mark.parametrize(("vector_bytes", "tile"), [(32, (6, 16)), (64, (8, 32))])
def test_micro_tile_follows_the_vector_width(vector_bytes: int, tile: tuple[int, int]) -> None:
    assert micro_tile(cpu_target(cores=2, vector_bytes=vector_bytes)) == tile


def test_narrow_matrices_get_a_narrow_tile() -> None:
    assert [narrow_columns(n, 32) for n in (3, 4, 8, 12, 16, 24, 31, 32, 50257)] == [32, 4, 8, 4, 16, 8, 32, 32, 32]


@pytest.mark.parametrize("vector_bytes", [32, 64])
@pytest.mark.parametrize(("batch", "m", "k", "n", "dtype"), [
    ((), 1, 1, 1, DType.f32),
    ((), 7, 13, 33, DType.f32),  # every edge path: rows and columns not whole tiles
    ((3,), 65, 40, 70, DType.f32),
    ((), 130, 24, 1024, DType.f32),  # row stride a multiple of 4 KiB: B packed by the first row tile
    ((), 37, 19, 45, DType.f16),
    ((4,), 37, 40, 8, DType.f32),  # narrower than a strip: an 8-column register tile (attention's P·V)
    ((2,), 19, 9, 12, DType.f32),  # ... 4 columns, 3 strips
    ((), 11, 5, 24, DType.f16),
])
def test_matmul_with_bias_matches_reference(vector_bytes: int, batch: tuple[int, ...], m: int, k: int, n: int,
                                            dtype: DType) -> None:
    b = GraphBuilder("mm")
    x = b.input("x", (*batch, m, k), dtype)
    w = b.input("w", (*batch, k, n), dtype)
    bias = b.input("bias", (n,), dtype)
    graph = run_pipeline(b.build([b.add(b.matmul(x, w), bias)]))
    program = schedule(graph, cpu_target(cores=2, vector_bytes=vector_bytes))
    runner = ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)
    torch.manual_seed(m * n + k)
    inputs = [torch.randn(node.shape, dtype=node.dtype.torch) for node in graph.inputs]
    (got,) = runner(inputs)
    (want,) = run_graph(graph, inputs)
    tol = {} if dtype == DType.f32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize(("vector_bytes", "cpu", "fmas"), [(32, "znver3", 12), (32, "haswell", 12),
                                                           (64, "skylake-avx512", 16)])
def test_micro_kernel_keeps_its_tile_in_registers(vector_bytes: int, cpu: str, fmas: int) -> None:
    """The k loop of the matmul, compiled for a CPU of each vector width (whatever the host): its
    ``mr·nr / lanes`` FMAs and no stack access. Binding all of A's rows before B (the order until
    2026-12) held 19 values in AVX2's 16 registers and spilled three accumulators per k step."""
    import llvmlite.binding as llvm

    from sextant.codegen.llvm_cpu import DEFAULT_OPTIONS, emit_module
    from sextant.codegen.objects import optimize

    b = GraphBuilder("mm")
    x, w = b.input("x", (128, 256), DType.f32), b.input("w", (256, 768), DType.f32)
    graph = run_pipeline(b.build([b.matmul(x, w)]))
    program = schedule(graph, cpu_target(cores=2, vector_bytes=vector_bytes))
    (kernel,) = program.kernels.values()
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, opt=3)
    text = str(emit_module([kernel], tm, vector_bytes=vector_bytes))
    asm = tm.emit_assembly(optimize(text, tm, DEFAULT_OPTIONS))
    # basic blocks up to their branch: the code after a loop's back edge falls through into the label
    blocks = [blk.split("\n\tj")[0] for blk in asm.split("\n.LBB")]
    blocks = [blk for blk in blocks if blk.count("vfmadd231ps") >= fmas]
    assert blocks, f"no block with {fmas} FMAs in the matmul compiled for {cpu}"
    inner = min(blocks, key=len)  # the k loop: the FMAs and little else
    assert inner.count("vfmadd231ps") == fmas
    assert "rsp" not in inner, f"the k loop spills on {cpu}:\n{inner}"
