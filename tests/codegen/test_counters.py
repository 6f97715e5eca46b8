"""cuda-sim's memory and tensor-core counters (``codegen.counters``): hand-written access
patterns with known costs, then the figures the mappings are held to — a conflict-free,
coalesced tensor-core GEMM mainloop with the expected MMA count, coalesced elementwise and
reduction loads."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import sextant
from sextant.codegen import compile_kernels
from sextant.codegen.counters import KernelCounters
from sextant.examples import EXAMPLES
from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Barrier,
    Binary,
    Buffer,
    Expr,
    For,
    Kernel,
    LdMatrix,
    Load,
    Special,
    Store,
    Var,
    add,
    c,
    mul,
)
from sextant.kernel.verifier import verify_kernel
from sextant.runtime.counting import count_program

F32, F16 = DType.f32, DType.f16
TID = Special("tid", "x")


def _count(kernel: Kernel, *tensors: torch.Tensor) -> KernelCounters:
    verify_kernel(kernel)
    module = compile_kernels([kernel], count_accesses=True)
    module.launch(kernel.name, list(tensors))
    return module.counters[kernel.name]


def copy_kernel(name: str, src_index: Expr, size: int, shared_index: Expr | None = None) -> Kernel:
    """64 threads: y[tid] = x[src_index] (through shared memory at ``shared_index`` if given)."""
    body: tuple = (Store("y", TID, Load("x", src_index, F32)),)
    shared: tuple = ()
    if shared_index is not None:
        body = (Store("s", shared_index, Load("x", TID, F32)), Barrier(), Store("y", TID, Load("s", shared_index, F32)))
        shared = (Buffer("s", F32, 64 * 64, "shared"),)
    return Kernel(name, (Buffer("x", F32, size), Buffer("y", F32, 64, role="out")), (1, 1, 1), (64, 1, 1), body,
                  shared=shared)


@pytest.mark.parametrize("stride,conflicts", [(1, 0), (2, 1), (32, 31), (33, 0)])
def test_bank_conflicts_of_strided_shared_accesses(stride: int, conflicts: int) -> None:
    """Lane l at word l·stride: the busiest of 32 banks holds gcd-many words (stride 2: 2, 32: all)."""
    k = copy_kernel(f"s{stride}", TID, 64, shared_index=mul(TID, c(stride)))
    got = _count(k, torch.randn(64), torch.zeros(64))
    assert got.shared_requests == 4  # a store and a load, by each of 2 warps
    assert got.bank_conflicts == 4 * conflicts


def test_a_broadcast_is_no_conflict() -> None:
    k = copy_kernel("bcast", TID, 64, shared_index=Binary("floordiv", TID, c(64), DType.i32))
    got = _count(k, torch.randn(64), torch.zeros(64))
    assert got.bank_conflicts == 0


@pytest.mark.parametrize("stride,efficiency", [(1, 1.0), (2, 0.5), (8, 0.125), (64, 0.125)])
def test_coalescing_of_strided_global_loads(stride: int, efficiency: float) -> None:
    k = copy_kernel(f"g{stride}", mul(TID, c(stride)), 64 * stride)
    got = _count(k, torch.randn(64 * stride), torch.zeros(64))
    assert got.global_load_requests == 2
    assert got.load_efficiency == pytest.approx(efficiency)
    assert got.store_efficiency == 1.0


def test_an_unrolled_vector_loop_is_one_wide_coalesced_access() -> None:
    """Each lane loads 4 consecutive f32 (what the vectoriser makes one ld.v4): 100 %, 1 request."""
    j = Var("j")
    body = (For(j, c(0), c(4), 1, (Store("y", add(mul(TID, c(4)), j), Load("x", add(mul(TID, c(4)), j), F32)),),
                unroll=True),)
    k = Kernel("vec4", (Buffer("x", F32, 128), Buffer("y", F32, 128, role="out")), (1, 1, 1), (32, 1, 1), body)
    got = _count(k, torch.randn(128), torch.zeros(128))
    assert (got.global_load_requests, got.load_efficiency) == (1, 1.0)
    assert (got.global_store_requests, got.store_efficiency) == (1, 1.0)


@pytest.mark.parametrize("row_halves,conflicts", [(40, 0), (32, 3), (64, 7)])
def test_ldmatrix_conflicts_depend_on_the_row_stride(row_halves: int, conflicts: int) -> None:
    """ldmatrix.x4 of 32 rows: 8 lanes (rows) a wavefront. An 80-byte stride (the GEMM's padded
    rows) spreads 8 rows over 8 bank groups; 64 bytes puts them in 2 (4 wavefronts), 128 in 1."""
    at = add(mul(Var("i"), c(32)), TID)  # the staging copy: consecutive lanes, consecutive halves
    body = (For(Var("i"), c(0), c(row_halves), 1, (Store("s", at, Load("x", at, F16)),)),
            Barrier(), LdMatrix("f", c(0), "s", mul(TID, c(row_halves)), 4),
            *(Store("y", add(mul(TID, c(8)), c(i)), Load("f", c(i), F16)) for i in range(8)))
    k = Kernel(f"ldm{row_halves}", (Buffer("x", F16, 32 * row_halves), Buffer("y", F16, 256, role="out")),
               (1, 1, 1), (32, 1, 1), body, shared=(Buffer("s", F16, 32 * row_halves, "shared"),),
               local=(Buffer("f", F16, 8, "local"),))
    got = _count(k, torch.randn(32 * row_halves).half(), torch.zeros(256).half())
    # the staging stores: 2 lanes a word, conflict-free at every stride; the ldmatrix: 4 phases
    ldm_phases = 4
    assert got.bank_conflicts == ldm_phases * conflicts


class QK(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.relu(q @ k.transpose(1, 2))


class MM(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


@pytest.mark.parametrize("model,shapes", [(MM(), ((2, 96, 64), (2, 64, 128))), (QK(), ((2, 72, 64), (2, 88, 64)))],
                         ids=["row-major-B", "transposed-B"])
def test_tensor_core_gemm_mainloop_is_conflict_free_and_coalesced(model: nn.Module, shapes: tuple) -> None:
    args = tuple(torch.randn(s).half() for s in shapes)
    cm = sextant.compile(model, args, target="cuda-sim", cache=False)
    program = cm.stages["program"]
    counters = count_program(program, args)
    (name, kernel), = program.kernels.items()
    assert kernel.meta["mapping"] == "tensor-core"
    got = counters[name]
    assert got.bank_conflicts == 0  # cp.async chunk stores and ldmatrix rows alike
    m, n, k = shapes[0][1], (shapes[1][2] if isinstance(model, MM) else shapes[1][1]), shapes[0][2]
    bm, bn, bk = kernel.meta["tile"]
    wm, wn = kernel.meta["warps"]
    blocks = math.ceil(m / bm) * math.ceil(n / bn) * shapes[0][0]
    per_warp = math.ceil(k / bk) * (bk // 16) * (bm // wm // 16) * (bn // wn // 8)
    assert got.mma_instructions == blocks * wm * wn * per_warp
    assert got.mma_flops == got.mma_instructions * 2 * 16 * 8 * 16
    tile_loads = got.global_load_requests  # the epilogue loads nothing here: all loads are cp.async chunks
    assert tile_loads and got.load_efficiency == 1.0
    # the C tile is staged through shared memory and stored row by row: whole sectors when rows are
    # 32-byte aligned (n = 128); n = 88 starts rows mid-sector, still well above the 50 % of storing
    # each lane's accumulator pairs where the C layout puts them
    assert got.store_efficiency == 1.0 if n % 16 == 0 else got.store_efficiency >= 0.75


@pytest.mark.slow  # ~70 s of cuda-sim counters
def test_elementwise_and_reduction_loads_are_coalesced() -> None:
    for name in ("transformer-block", "cnn"):
        model, args = EXAMPLES[name]()
        cm = sextant.compile(model, args, target="cuda-sim", cache=False)
        program = cm.stages["program"]
        counters = count_program(program, args)
        kinds = {launch.kernel: program.groups[launch.group].kind for launch in program.launches}
        checked = [k for k, kind in kinds.items() if kind in ("elementwise", "reduce")]
        assert checked
        for k in checked:
            assert counters[k].load_efficiency == 1.0, (name, k, counters[k].summary())
            assert counters[k].bank_conflicts == 0, (name, k, counters[k].summary())
