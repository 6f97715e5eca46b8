"""Hopper statements (wgmma, TMA, mbarriers): layouts against the PTX ISA's text, cuda-sim's
emulation against torch and mmasim, the verifier's rules, the checked build's hang detection,
and the NVPTX lowering through ptxas for sm_90a.

The test kernels store each thread's accumulators with index expressions written here from the
ISA's description of the wgmma D fragment (not from ``sextant.kernel.wgmma``), and the expected
shared-memory layouts are built in Python from the ISA's canonical-layout formulas, so a wrong
table in sextant fails a comparison."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from sextant.codegen import CodegenError, compile_kernels
from sextant.codegen.llvm_nvptx import emit_ptx
from sextant.codegen.race_check import MbarrierHangError
from sextant.graph.dtypes import DType
from sextant.kernel import wgmma as wg
from sextant.kernel.ir import (
    Barrier,
    Binary,
    Buffer,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    RegMatrix,
    SmemMatrix,
    Special,
    Stmt,
    Store,
    TmaLoad,
    Var,
    Wgmma,
    WgmmaCommit,
    WgmmaFence,
    WgmmaWait,
    add,
    c,
    mul,
)
from sextant.kernel.printer import print_kernel
from sextant.kernel.serialize import kernel_from_json, kernel_to_json
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

F16, BF16, F32, I32, I64 = DType.f16, DType.bf16, DType.f32, DType.i32, DType.i64
TID = Special("tid", "x")
TORCH = {F16: torch.float16, BF16: torch.bfloat16}


def _op(op: str, a: Expr, k: int) -> Expr:
    return Binary(op, a, c(k), I32)


def is_thread0() -> Expr:
    return Binary("eq", TID, c(0), DType.bool)


# -- layouts --------------------------------------------------------------------------------------
def test_d_fragment_follows_the_isa() -> None:
    """PTX ISA, wgmma .m64nNk16 D: warp w of the warpgroup holds rows 16w..16w+15; in it, thread
    T = lane holds d[i] at row g (+8 for i%4 >= 2), column 8*(i/4) + 2*(lane%4) + i%2."""
    seen = set()
    for thread in range(128):
        for i in range(64):  # N = 128
            w, lane = thread // 32, thread % 32
            want = (16 * w + lane // 4 + (8 if i % 4 >= 2 else 0), 8 * (i // 4) + 2 * (lane % 4) + i % 2)
            assert wg.d_coord(thread, i) == want
            seen.add(want)
    assert len(seen) == 64 * 128  # a bijection onto the 64×128 tile


def test_swizzle_is_the_xor_of_row_into_chunk() -> None:
    """128-byte swizzle: 16-byte chunk j of row r (r = address bits 7-9) moves to chunk j ^ (r % 8)."""
    for r in range(16):
        for j in range(8):
            for byte in (0, 6):
                addr = r * 128 + j * 16 + byte
                assert wg.swizzle_address(addr, 128) == r * 128 + ((j ^ (r % 8)) * 16) + byte
    assert wg.swizzle_address(1000, 0) == 1000
    for span, bits in ((32, 1), (64, 2), (128, 3)):  # as CUTLASS's Swizzle<bits, 4, 3>: bits 7.. into bits 4..
        for addr in range(0, 4096, 2):
            assert wg.swizzle_address(addr, span) == addr ^ ((addr & (((1 << bits) - 1) << 7)) >> 3)


def test_descriptor_bits() -> None:
    """Start >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45, 128-byte swizzle = 1 in 62-63."""
    d = wg.descriptor(0x400 + 32, 128, 16, 1024)
    assert d == ((0x420 >> 4) | (1 << 16) | (64 << 32) | (1 << 62))
    assert wg.descriptor_fields(d) == (0x420, 128, 16, 1024)
    assert wg.descriptor(256, 0, 128, 256) == (16 | (8 << 16) | (16 << 32))


def test_kmajor_layouts() -> None:
    # interleaved: core matrix (8 rows x 16 B) contiguous, next along K at LBO, next 8 rows at SBO
    assert wg.kmajor_offset(9, 10, 2, 0, lbo=1024, sbo=128) == 128 + 1024 + 16 + 4
    # 128-byte swizzle: rows of 128 B, 8-row atoms SBO apart (before the address swizzle)
    assert wg.kmajor_offset(9, 10, 2, 128, lbo=0, sbo=1024) == 1024 + 128 + 20


# -- a one-block GEMM tile through TMA, mbarrier and wgmma ------------------------------------------
def gemm_tile_kernel(n: int, k: int, dt: DType, swizzle: int, *, rows: int = 64, skip_arrive: bool = False,
                     wrong_parity: bool = False, b_mn: bool = False) -> Kernel:
    """D (64×n, f32) = A (rows×k, rows ≤ 64: TMA zero-fills the rest) · Bᵀ (B n×k): each 64-wide
    K tile is loaded by TMA (one 64×64 box, 128-byte swizzle; or, unswizzled, 8 boxes of 8 columns
    = the interleaved core-matrix layout), awaited on an mbarrier whose phase flips every tile,
    multiplied by four wgmmas (k16 steps) and released with a barrier."""
    size = dt.itemsize
    kt = Var("kt")
    tx = (64 + n) * 64 * size
    if swizzle:
        a_desc = lambda kk: SmemMatrix("sA", c(kk * 16), 128, 0, 1024)
        b_desc = lambda kk: SmemMatrix("sB", c(kk * 16), 128, 0, 1024)
        loads: list[Stmt] = [TmaLoad("sA", c(0), "A", c(0), mul(kt, c(64)), (64, 64), (rows, k), k, 128, "bar", c(0)),
                             TmaLoad("sB", c(0), "B", c(0), mul(kt, c(64)), (n, 64), (n, k), k, 128, "bar", c(0))]
    else:  # box j (8 columns) of A at byte 1024·j: core matrices 128 B apart along M, 1024 B along K
        a_desc = lambda kk: SmemMatrix("sA", c(kk * 2 * 512), 0, 64 * 16, 128)
        b_desc = lambda kk: SmemMatrix("sB", c(kk * 2 * n * 8), 0, n * 16, 128)
        loads = [TmaLoad(buf, c(j * rows_ * 8), src, c(0), add(mul(kt, c(64)), c(8 * j)), (rows_, 8),
                         (rows_src, k), k, 0, "bar", c(0))
                 for buf, src, rows_, rows_src in (("sA", "A", 64, rows), ("sB", "B", n, n)) for j in range(8)]
    if b_mn:  # B stored K×N: 64-column boxes of 64 K-rows, 128-byte rows along N (MN-major, LBO between boxes)
        assert swizzle == 128 and n % 64 == 0
        b_desc = lambda kk: SmemMatrix("sB", c(kk * 16 * 64), 128, 64 * 128, 1024, "mn")
        loads = loads[:1] + [TmaLoad("sB", c(j * 64 * 64), "B", mul(kt, c(64)), c(64 * j), (64, 64), (k, n), n, 128,
                                     "bar", c(0)) for j in range(n // 64)]
    issue = [] if skip_arrive else [MbarrierArrive("bar", c(0), tx)]
    parity = _op("bitwise_and", add(kt, c(1 if wrong_parity else 0)), 1)
    mmas = [Wgmma(n, "acc", c(0), a_desc(kk), b_desc(kk)) for kk in range(4)]
    loop = For(kt, c(0), c(k // 64), 1, (
        If(is_thread0(), tuple(issue + loads)),
        MbarrierWait("bar", c(0), parity),
        WgmmaFence(), *mmas, WgmmaCommit(), WgmmaWait(0, ("acc",)),
        Barrier(),
    ))
    warp, lane = _op("shr", TID, 5), _op("bitwise_and", TID, 31)
    g, t = _op("shr", lane, 2), _op("bitwise_and", lane, 3)
    i = Var("i")
    row = add(add(mul(warp, c(16)), g), mul(_op("bitwise_and", _op("shr", i, 1), 1), c(8)))
    col = add(add(mul(_op("shr", i, 2), c(8)), mul(t, c(2))), _op("bitwise_and", i, 1))
    body: tuple[Stmt, ...] = (
        For(i, c(0), c(n // 2), 1, (Store("acc", i, Const(0.0, F32)),), unroll=True),
        If(is_thread0(), (MbarrierInit("bar", c(0), 1),)),
        Barrier(),
        loop,
        For(i, c(0), c(n // 2), 1, (Store("D", add(mul(row, c(n)), col), Load("acc", i, F32)),), unroll=True),
    )
    name = f"wg_tile_{n}_{k}_{dt.value}_{swizzle}_{rows}{'_mn' if b_mn else ''}"
    return Kernel(name, (Buffer("A", dt, rows * k), Buffer("B", dt, n * k), Buffer("D", F32, 64 * n, role="out")),
                  (1, 1, 1), (128, 1, 1), body,
                  shared=(Buffer("sA", dt, 64 * 64, "shared"), Buffer("sB", dt, n * 64, "shared"),
                          Buffer("bar", I64, 1, "shared")),
                  local=(Buffer("acc", F32, n // 2, "local"),))


TILE_CASES = [(64, 128, F16, 128, 64, False), (128, 64, BF16, 128, 64, False), (32, 192, F16, 0, 64, False),
              (64, 64, F16, 128, 50, False), (16, 64, BF16, 0, 37, False), (128, 128, F16, 128, 64, True),
              (64, 64, BF16, 128, 33, True)]


@pytest.mark.parametrize("case", TILE_CASES,
                         ids=lambda cs: f"n{cs[0]}k{cs[1]}{cs[2].value}sw{cs[3]}r{cs[4]}{'mn' if cs[5] else ''}")
def test_wgmma_tile_on_cuda_sim_matches_torch(case: tuple) -> None:
    n, k, dt, swizzle, rows, b_mn = case
    kern = gemm_tile_kernel(n, k, dt, swizzle, rows=rows, b_mn=b_mn)
    verify_kernel(kern)
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(rows, k, generator=gen).to(TORCH[dt])
    B = torch.randn(n, k, generator=gen).to(TORCH[dt])
    D = torch.full((64, n), float("nan"))
    compile_kernels([kern], check_races=True).launch(kern.name, [A, B.T.contiguous() if b_mn else B, D])
    ref = torch.zeros(64, n, dtype=torch.float64)
    ref[:rows] = A.double() @ B.double().T
    torch.testing.assert_close(D.double(), ref, atol=1e-4, rtol=1e-4)
    mmasim = pytest.importorskip("mmasim.nv_ptx")
    hw = torch.zeros(64, n)
    a = torch.zeros(64, k, dtype=TORCH[dt])
    a[:rows] = A
    for k0 in range(0, k, 16):  # the hardware's rounding per k16 instruction, chained as the kernel does
        hw = mmasim.WGMMA("Hopper", f"m64n{n}k16.f32.{dt.value}.{dt.value}")(a[:, k0:k0 + 16], B[:, k0:k0 + 16].T, hw)
    torch.testing.assert_close(D, hw, atol=1e-3, rtol=1e-3)


def test_wrong_descriptor_gives_wrong_numbers() -> None:
    """A swizzled tile read as unswizzled (descriptor swizzle 0) is garbage on the GPU, and here."""
    kern = gemm_tile_kernel(64, 64, F16, 128)
    body = list(kern.body)
    loop = body[3]
    assert isinstance(loop, For)
    wrong = tuple(Wgmma(s.n, s.d, s.d_off, SmemMatrix("sA", s.a.offset, 0, 128, 1024), s.b)
                  if isinstance(s, Wgmma) else s for s in loop.body)
    body[3] = For(loop.var, loop.start, loop.stop, loop.step, wrong)
    kern = Kernel(kern.name + "_wrong", kern.params, kern.grid, kern.block, tuple(body), kern.shared, kern.local)
    A, B = torch.randn(64, 64).half(), torch.randn(64, 64).half()
    D = torch.zeros(64, 64)
    compile_kernels([kern], check_races=True).launch(kern.name, [A, B, D])
    assert (D - A.float() @ B.float().T).abs().max() > 1


@pytest.mark.parametrize("mistake", ["skip_arrive", "wrong_parity"])
def test_checked_build_reports_a_wait_that_would_hang(mistake: str) -> None:
    kern = gemm_tile_kernel(64, 128, F16, 128, **{mistake: True})
    verify_kernel(kern)
    A, B, D = torch.randn(64, 128).half(), torch.randn(64, 128).half(), torch.zeros(64, 64)
    with pytest.raises(MbarrierHangError, match="mbarrier bar"):
        compile_kernels([kern], check_races=True).launch(kern.name, [A, B, D])


def test_text_form_and_serialization_round_trip() -> None:
    kern = gemm_tile_kernel(64, 128, F16, 128)
    text = print_kernel(kern)
    assert ("wgmma_m64n64k16(&acc[0], desc(&sA[16], swizzle=128, sbo=1024), desc(&sB[16], swizzle=128, sbo=1024))"
            in text)
    assert "tma_load(&sA[0], A[64x128, stride 128][0, kt * 64], box=64x64, swizzle=128, &bar[0])" in text
    assert "mbarrier_wait(&bar[0], parity=" in text and "wgmma_wait(0, acc)" in text
    assert kernel_from_json(kernel_to_json(kern)) == kern


# -- verifier -------------------------------------------------------------------------------------
def _with(kern: Kernel, *, body: tuple | None = None, block: tuple = (128, 1, 1)) -> Kernel:
    return Kernel(kern.name, kern.params, kern.grid, block, kern.body if body is None else body, kern.shared,
                  kern.local)


def test_verifier_rejects_misuse() -> None:
    kern = gemm_tile_kernel(64, 64, F16, 128)
    verify_kernel(kern)
    loop = kern.body[3]
    assert isinstance(loop, For)

    def a_desc(m: SmemMatrix) -> Callable[[Stmt], Stmt]:
        return lambda s: Wgmma(s.n, s.d, s.d_off, m, s.b) if isinstance(s, Wgmma) else s

    def replaced(fn: Callable[[Stmt], Stmt]) -> Kernel:
        return _with(kern, body=(*kern.body[:3], For(loop.var, loop.start, loop.stop, loop.step,
                                                       tuple(fn(s) for s in loop.body)), kern.body[4]))

    cases = {
        "full warpgroups": _with(kern, block=(64, 1, 1)),
        "N=60": replaced(lambda s: Wgmma(60, s.d, s.d_off, s.a, s.b) if isinstance(s, Wgmma) else s),
        "not surely 16-byte aligned": replaced(a_desc(SmemMatrix("sA", c(4), 128, 0, 1024))),
        "sbo=1000": replaced(a_desc(SmemMatrix("sA", c(0), 128, 0, 1000))),
        "must fill the 128-byte swizzle span": replaced(
            lambda s: If(s.cond, tuple(TmaLoad(x.dst, x.dst_off, x.src, x.row, x.col, (64, 32), x.shape, x.stride, 128,
                                               x.bar, x.bar_index) if isinstance(x, TmaLoad) else x for x in s.then))
            if isinstance(s, If) else s),
        "not surely 1024-byte aligned": replaced(
            lambda s: If(s.cond, tuple(TmaLoad(x.dst, c(64), x.src, x.row, x.col, x.box, x.shape, x.stride, 128,
                                               x.bar, x.bar_index) if isinstance(x, TmaLoad) else x for x in s.then))
            if isinstance(s, If) else s),
        "mbarrier wait in a loop whose bounds differ between threads": replaced(
            lambda s: For(Var("j"), c(0), TID, 1, (s,)) if isinstance(s, MbarrierWait) else s),
        "wgmma under control flow that differs within a warp": replaced(
            lambda s: If(is_thread0(), (s,)) if isinstance(s, Wgmma) else s),
        "shared i64 buffer": replaced(lambda s: MbarrierWait("sA", s.index, s.parity) if isinstance(s, MbarrierWait)
                                      else s),
    }
    for message, bad in cases.items():
        with pytest.raises(KernelVerificationError, match=message):
            verify_kernel(bad)


# -- NVPTX for sm_90a -------------------------------------------------------------------------------
def test_sm90a_ptx_assembles_without_spills_or_serialised_wgmma() -> None:
    from sextant.codegen.ptxas import assemble
    from sextant.codegen.sass import disassemble, find_disassembler

    kernels = [gemm_tile_kernel(*case[:4], rows=case[4], b_mn=case[5]) for case in TILE_CASES]
    pm = emit_ptx(kernels, arch="sm_90a")
    for text in ("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16",
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16", "p, 1, 1, 0, 1;",
                 "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 0",
                 "mbarrier.init.shared.b64", "mbarrier.arrive.expect_tx", "mbarrier.try_wait.parity",
                 "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
                 "fence.proxy.async.shared::cta", ".align 1024"):
        assert text in pm.ptx, text
    assert ".param .align 64 .b8" in pm.ptx  # the tensor map, by value in the parameter space ...
    assert "cvta.param" in pm.ptx and ".local" not in pm.ptx  # ... never copied to local memory
    k0 = pm.kernel(kernels[0].name)
    assert [tm.src for tm in k0.tensor_maps] == ["A", "B"] and k0.tensor_maps[0].box == (64, 64)
    res = assemble(pm.ptx, "sm_90a")
    assert "C7512" not in res.log and "serialized" not in res.log, res.log  # wgmmas not serialised
    for name, r in res.kernels.items():
        assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (name, r)
    tool = find_disassembler()
    if tool is None:
        pytest.skip("no nvdisasm/cuobjdump to read the SASS")
    sass = disassemble(res.cubin, tool)
    assert "HGMMA.64x64x16.F32" in sass and "UTMALDG" in sass and "SYNCS" in sass


def test_hopper_statements_need_sm90a() -> None:
    with pytest.raises(CodegenError, match=r"Wgmma\w* needs sm_90a"):
        emit_ptx([gemm_tile_kernel(64, 64, F16, 128)], arch="sm_90")


# -- A in registers, a TMA copy with an outer dimension ----------------------------------------------
def test_register_a_fragment_follows_the_isa() -> None:
    """PTX ISA, wgmma .m64nNk16 A in registers: warp w holds rows 16w..; in it the m16n8k16 A
    fragment of mma.sync (an independent statement of it: ``kernel.fragments``)."""
    from sextant.kernel.fragments import MMA_SHAPES

    mma_a = MMA_SHAPES[((16, 8, 16), "f16")].a_coord
    for thread in range(128):
        for i in range(8):
            r, k = mma_a(thread % 32, i)
            assert wg.a_coord(thread, i) == (16 * (thread // 32) + r, k)


def reg_a_kernel(n: int, dt: DType, planes: int, plane: int) -> Kernel:
    """D (64×n) = A (64×64, each thread loading its register fragments from global by
    ``a_coord``'s layout) · B[plane]ᵀ, B[plane] (n×64) copied by a 3-D TMA load: plane ``plane`` of
    ``planes`` n×64 matrices (out of range: zeros)."""
    size = dt.itemsize
    warp, lane = _op("shr", TID, 5), _op("bitwise_and", TID, 31)
    g, t = _op("shr", lane, 2), _op("bitwise_and", lane, 3)
    loads: list[Stmt] = []
    for kk in range(4):
        for i in range(8):  # the layout written out again (rows g/g+8, k pairs 2t and 2t+8)
            row = add(add(mul(warp, c(16)), g), c(8 * ((i >> 1) & 1)))
            col = add(mul(t, c(2)), c(16 * kk + (i & 1) + 8 * (i >> 2)))
            loads.append(Store("fa", c(8 * kk + i), Load("A", add(mul(row, c(64)), col), dt)))
    i = Var("i")
    row = add(add(mul(warp, c(16)), g), mul(_op("bitwise_and", _op("shr", i, 1), 1), c(8)))
    col = add(add(mul(_op("shr", i, 2), c(8)), mul(t, c(2))), _op("bitwise_and", i, 1))
    body: tuple[Stmt, ...] = (
        *loads,
        For(i, c(0), c(n // 2), 1, (Store("acc", i, Const(0.0, F32)),), unroll=True),
        If(is_thread0(), (MbarrierInit("bar", c(0), 1),)),
        Barrier(),
        If(is_thread0(), (MbarrierArrive("bar", c(0), n * 64 * size),
                          TmaLoad("sB", c(0), "B", c(0), c(0), (n, 64), (n, 64), 64, 128, "bar", c(0),
                                  (c(plane),), ((planes, n * 64),)))),
        MbarrierWait("bar", c(0), c(0)),
        WgmmaFence(),
        *(Wgmma(n, "acc", c(0), RegMatrix("fa", c(8 * kk)), SmemMatrix("sB", c(16 * kk), 128, 0, 1024))
          for kk in range(4)),
        WgmmaCommit(),
        WgmmaWait(0, ("acc",)),
        For(i, c(0), c(n // 2), 1, (Store("D", add(mul(row, c(n)), col), Load("acc", i, F32)),), unroll=True),
    )
    return Kernel(f"wg_rega_{n}_{dt.value}_{plane}", (Buffer("A", dt, 64 * 64), Buffer("B", dt, planes * n * 64),
                                                      Buffer("D", F32, 64 * n, role="out")),
                  (1, 1, 1), (128, 1, 1), body,
                  shared=(Buffer("sB", dt, n * 64, "shared"), Buffer("bar", I64, 1, "shared")),
                  local=(Buffer("fa", dt, 32, "local"), Buffer("acc", F32, n // 2, "local")))


@pytest.mark.parametrize("n,dt,plane", [(64, F16, 1), (128, BF16, 2), (64, F16, 3)])
def test_register_a_wgmma_and_3d_tma_on_cuda_sim(n: int, dt: DType, plane: int) -> None:
    kern = reg_a_kernel(n, dt, 3, plane)
    verify_kernel(kern)
    gen = torch.Generator().manual_seed(5)
    A = torch.randn(64, 64, generator=gen).to(TORCH[dt])
    B = torch.randn(3, n, 64, generator=gen).to(TORCH[dt])
    D = torch.full((64, n), float("nan"))
    compile_kernels([kern], check_races=True).launch(kern.name, [A, B, D])
    if plane >= 3:  # past the outer dimension: TMA reads zeros
        assert torch.equal(D, torch.zeros(64, n))
        return
    torch.testing.assert_close(D.double(), A.double() @ B[plane].double().T, atol=1e-4, rtol=1e-4)
    mmasim = pytest.importorskip("mmasim.nv_ptx")
    hw = torch.zeros(64, n)
    for k0 in range(0, 64, 16):
        hw = mmasim.WGMMA("Hopper", f"m64n{n}k16.f32.{dt.value}.{dt.value}")(A[:, k0:k0 + 16],
                                                                          B[plane][:, k0:k0 + 16].T, hw)
    torch.testing.assert_close(D, hw, atol=1e-3, rtol=1e-3)


def test_register_a_and_outer_dims_text_ptx_and_checks() -> None:
    kern = reg_a_kernel(64, F16, 3, 1)
    text = print_kernel(kern)
    assert "wgmma_m64n64k16(&acc[0], regs(&fa[8]), desc(&sB[16], swizzle=128, sbo=1024))" in text
    assert "tma_load(&sB[0], B[3 (stride 4096) x 64x64, stride 64][1, 0, 0], box=64x64" in text
    assert kernel_from_json(kernel_to_json(kern)) == kern
    pm = emit_ptx([kern], arch="sm_90a")
    assert "cp.async.bulk.tensor.3d.shared::cluster.global.tile" in pm.ptx
    assert pm.kernel(kern.name).tensor_maps[0].outer_dims == ((3, 4096),)
    from sextant.codegen.ptxas import assemble

    res = assemble(pm.ptx, "sm_90a")
    assert "C7512" not in res.log and all(r.spill_stores == 0 for r in res.kernels.values())
    wgmmas = [s for s in kern.body if isinstance(s, Wgmma)]
    for message, bad in {
        "in registers must be A": Wgmma(64, "acc", c(0), SmemMatrix("sB", c(0)), RegMatrix("fa", c(0))),  # type: ignore[arg-type]
        "must be A in an f16 or bf16 local buffer": Wgmma(64, "acc", c(0), RegMatrix("acc", c(0)), wgmmas[0].b),
        "out of bounds|outside": Wgmma(64, "acc", c(0), RegMatrix("fa", c(28)), wgmmas[0].b),
    }.items():
        body = tuple(bad if s is wgmmas[0] else s for s in kern.body)
        with pytest.raises(KernelVerificationError, match=message):
            verify_kernel(_with(kern, body=body))
    tma = next(x for s in kern.body if isinstance(s, If) for x in s.then if isinstance(x, TmaLoad))
    mistakes = (("outer coordinates over", (c(0),), ()), ("outer stride of 2 bytes", (c(0),), ((3, 1),)))
    for message, outer, dims in mistakes:
        bad_tma = TmaLoad(tma.dst, tma.dst_off, tma.src, tma.row, tma.col, tma.box, tma.shape, tma.stride, tma.swizzle,
                          tma.bar, tma.bar_index, outer, dims)
        body = tuple(If(s.cond, tuple(bad_tma if x is tma else x for x in s.then))
                     if isinstance(s, If) and tma in s.then else s for s in kern.body)
        with pytest.raises(KernelVerificationError, match=message):
            verify_kernel(_with(kern, body=body))
