"""Tensor-core statements (Mma, LdMatrix, cp.async): layouts against the PTX ISA, cuda-sim's
emulation against torch and against mmasim's model of the hardware's arithmetic, the NVPTX
lowering through ptxas (0 spills, HMMA/LDSM in the SASS), the verifier's rejections and the
race checker's cp.async rules.

The test kernels address fragments with index expressions written here from the ISA's text
(not from ``sextant.kernel.fragments``), so a wrong table in sextant fails a comparison."""

from __future__ import annotations

import pytest
import torch

from sextant.codegen import CodegenError, compile_kernels
from sextant.codegen.llvm_nvptx import emit_ptx
from sextant.codegen.race_check import AsyncCopyError, DivergentWarpError, SharedMemoryRaceError
from sextant.graph.dtypes import DType
from sextant.kernel.fragments import MMA_SHAPES, ldmatrix_source
from sextant.kernel.ir import (
    Barrier,
    Binary,
    Buffer,
    Const,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Load,
    Mma,
    Special,
    Stmt,
    Store,
    Var,
    add,
    c,
    lt,
    mul,
)
from sextant.kernel.printer import print_stmt
from sextant.kernel.serialize import kernel_from_json, kernel_to_json
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

F16, BF16, F32, I32 = DType.f16, DType.bf16, DType.f32, DType.i32
TID = Special("tid", "x")
TORCH = {F16: torch.float16, BF16: torch.bfloat16, F32: torch.float32}


def idiv(a: Expr, k: int) -> Expr:
    return Binary("floordiv", a, c(k), I32)


def imod(a: Expr, k: int) -> Expr:
    return Binary("fmod", a, c(k), I32)


LANE = imod(TID, 32)
G, T = idiv(LANE, 4), imod(LANE, 4)  # the ISA's groupID and threadID_in_group


# -- the ISA's fragment tables, as written in PTX ISA §9.7.14.5.7/8 --------------------------------
def isa_a(kind: str, k: int, i: int) -> tuple[Expr, Expr]:
    """(row, col) of A element a_i, as kernel IR of the lane."""
    if kind == "tf32":  # "row = groupID for a0, a2; groupID + 8 for a1, a3; col = threadID_in_group (+4 for a2, a3)"
        return add(G, c(8 * (i % 2))), add(T, c(4 * (i // 2)))
    # f16/bf16: "row = groupID for a0, a1, a4, a5, else groupID + 8;
    #            col = threadID_in_group * 2 + (i & 1) for a_i < a4, else + 8"
    row = add(G, c(0 if i in (0, 1, 4, 5) else 8))
    return row, add(mul(T, c(2)), c((i & 1) + (8 if i >= 4 else 0)))


def isa_b(kind: str, i: int) -> tuple[Expr, Expr]:
    """(row k, col n) of B element b_i."""
    if kind == "tf32":  # "row = threadID_in_group (+4 for b1); col = groupID"
        return add(T, c(4 * i)), G
    # "row = threadID_in_group * 2 + (i & 1) for b_i < b2, else + 8; col = groupID"
    return add(mul(T, c(2)), c((i & 1) + (8 if i >= 2 else 0))), G


def isa_c(i: int) -> tuple[Expr, Expr]:
    """(row, col) of C/D element c_i: "row = groupID for c0, c1, else groupID + 8;
    col = threadID_in_group * 2 + (i & 1)"."""
    return add(G, c(0 if i < 2 else 8)), add(mul(T, c(2)), c(i & 1))


def mma_kernel(shape: tuple[int, int, int], ab: DType, acc: DType, kind: str) -> Kernel:
    """One warp: fragments loaded from global by the ISA tables, one Mma, D stored by them."""
    m, n, k = shape
    na, nb, nc = m * k // 32, k * n // 32, m * n // 32
    body: list[Stmt] = []
    for i in range(na):
        r, col = isa_a(kind, k, i)
        body.append(Store("fa", c(i), Load("A", add(mul(r, c(k)), col), ab)))
    for i in range(nb):
        r, col = isa_b(kind, i)
        body.append(Store("fb", c(i), Load("B", add(mul(r, c(n)), col), ab)))
    for i in range(nc):
        r, col = isa_c(i)
        body.append(Store("acc", c(i), Load("C", add(mul(r, c(n)), col), acc)))
    body.append(Mma(shape, "acc", c(0), "fa", c(0), "fb", c(0), "acc", c(0)))
    for i in range(nc):
        r, col = isa_c(i)
        body.append(Store("D", add(mul(r, c(n)), col), Load("acc", c(i), acc)))
    return Kernel(f"mma_{kind}_{acc.value}_{m}{n}{k}",
                  (Buffer("A", ab, m * k), Buffer("B", ab, k * n), Buffer("C", acc, m * n),
                   Buffer("D", acc, m * n, role="out")),
                  (1, 1, 1), (32, 1, 1), tuple(body),
                  local=(Buffer("fa", ab, na, "local"), Buffer("fb", ab, nb, "local"), Buffer("acc", acc, nc, "local")))


MMA_CASES = [((16, 8, 16), F16, F32, "f16"), ((16, 8, 16), F16, F16, "f16"), ((16, 8, 16), BF16, F32, "bf16"),
             ((16, 8, 8), F16, F32, "f16"), ((16, 8, 8), BF16, F32, "bf16"), ((16, 8, 8), F32, F32, "tf32")]


def _ids(case: tuple) -> str:
    (m, n, k), _, acc, kind = case
    return f"m{m}n{n}k{k}-{kind}-{acc.value}"


def test_fragment_tables_are_bijections_matching_the_isa() -> None:
    """sextant's layout tables against this file's reading of the ISA, lane by lane."""
    def ev(e: Expr, lane: int) -> int:
        from sextant.kernel.ranges import eval_expr
        return eval_expr(e, {"tid.x": lane})

    for (shape, kind), lay in MMA_SHAPES.items():
        m, n, k = shape
        isa = {"a": lambda i, kind=kind, k=k: isa_a(kind, k, i), "b": lambda i, kind=kind: isa_b(kind, i), "c": isa_c}
        for which, coord, count, rows, cols in (("a", lay.a_coord, lay.a_elems, m, k),
                                                ("b", lay.b_coord, lay.b_elems, k, n),
                                                ("c", lay.c_coord, lay.c_elems, m, n)):
            seen = set()
            for lane in range(32):
                for i in range(count):
                    want = isa[which](i)
                    got = coord(lane, i)
                    assert got == (ev(want[0], lane), ev(want[1], lane)), (shape, kind, which, lane, i)
                    assert 0 <= got[0] < rows and 0 <= got[1] < cols
                    seen.add(got)
            assert len(seen) == rows * cols  # every element held by exactly one (lane, i)


@pytest.mark.parametrize("case", MMA_CASES, ids=_ids)
def test_mma_on_cuda_sim_matches_torch_and_mmasim(case: tuple) -> None:
    shape, ab, acc, kind = case
    m, n, k = shape
    mod = compile_kernels([kern := mma_kernel(shape, ab, acc, kind)])
    verify_kernel(kern)
    gen = torch.Generator().manual_seed(7)
    A = torch.randn(m, k, generator=gen).to(TORCH[ab])
    B = torch.randn(k, n, generator=gen).to(TORCH[ab])
    C = torch.randn(m, n, generator=gen).to(TORCH[acc])
    D = torch.zeros(m, n, dtype=TORCH[acc])
    mod.launch(kern.name, [A, B, C, D])
    a32, b32 = A.float(), B.float()
    if kind == "tf32":  # the hardware reads 19 bits of each f32 operand
        a32, b32 = (x.view(torch.int32).bitwise_and(-8192).view(torch.float32) for x in (A, B))
    ref = (a32.double() @ b32.double() + C.double()).to(TORCH[acc])
    tol = 2e-2 if acc == F16 else 1e-5
    torch.testing.assert_close(D, ref, atol=tol, rtol=tol)
    mmasim = pytest.importorskip("mmasim.nv_ptx")
    ptx_name = {"f16": "f16", "bf16": "bf16", "tf32": "tf32"}[kind]
    sig = f"m{m}n{n}k{k}.{acc.value}.{ptx_name}.{ptx_name}.{acc.value}"
    hw = mmasim.MMA("Ampere", sig)(A, B, C)  # mmasim: the hardware's rounding, bit for bit
    torch.testing.assert_close(D.float(), hw.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("count,trans", [(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)])
def test_ldmatrix_gives_each_lane_the_isa_elements(count: int, trans: bool) -> None:
    """Matrix j at rows [8j, 8j+8) of a 32×8 f16 tile (stride 8; rows given by lanes 8j..8j+7);
    lane l receives row l/4, cols 2(l%4)+e (transposed: row 2(l%4)+e, col l/4)."""
    n = 2 * count
    body: list[Stmt] = [For(Var("i"), c(0), c(8), 1, (Store("s", add(mul(TID, c(8)), Var("i")),
                                                             Load("x", add(mul(TID, c(8)), Var("i")), F16)),)),
                        Barrier(), LdMatrix("f", c(0), "s", mul(imod(TID, 8 * count), c(8)), count, trans)]
    body += [Store("y", add(mul(TID, c(n)), c(i)), Load("f", c(i), F16)) for i in range(n)]
    kern = Kernel(f"ldm{count}{int(trans)}", (Buffer("x", F16, 256), Buffer("y", F16, 32 * n, role="out")),
                  (1, 1, 1), (32, 1, 1), tuple(body), shared=(Buffer("s", F16, 256, "shared"),),
                  local=(Buffer("f", F16, n, "local"),))
    verify_kernel(kern)
    x = torch.randn(32, 8).half()
    y = torch.zeros(32, n).half()
    compile_kernels([kern], check_races=True).launch(kern.name, [x, y])
    for lane in range(32):
        for j in range(count):
            for e in range(2):
                mat = x[8 * j: 8 * j + 8]
                want = mat[2 * (lane % 4) + e, lane // 4] if trans else mat[lane // 4, 2 * (lane % 4) + e]
                assert y[lane, 2 * j + e] == want, (lane, j, e)
                src_lane, col = ldmatrix_source(lane, j, e, trans)
                assert x[src_lane, col] == want  # sextant's own table says the same


def warp_gemm_kernel(dt: DType) -> Kernel:
    """A 16×16 by 16×8 product as a tensor-core pipeline: cp.async global→shared, commit, wait,
    barrier, ldmatrix.x4 (A) and .x2.trans (B, row-major K×N), mma, D stored by the ISA table."""
    body: list[Stmt] = [CpAsync("sA", mul(TID, c(8)), "A", mul(TID, c(8)), 8),
                        CpAsync("sB", mul(TID, c(4)), "B", mul(TID, c(4)), 4), CpAsyncCommit(), CpAsyncWait(0),
                        Barrier(),
                        LdMatrix("fa", c(0), "sA", add(mul(imod(TID, 16), c(16)), mul(idiv(TID, 16), c(8))), 4),
                        LdMatrix("fb", c(0), "sB", mul(imod(TID, 16), c(8)), 2, trans=True)]
    body += [Store("acc", c(i), Const(0.0, F32)) for i in range(4)]
    body.append(Mma((16, 8, 16), "acc", c(0), "fa", c(0), "fb", c(0), "acc", c(0)))
    for i in range(4):
        r, col = isa_c(i)
        body.append(Store("D", add(mul(r, c(8)), col), Load("acc", c(i), F32)))
    return Kernel(f"warp_gemm_{dt.value}",
                  (Buffer("A", dt, 256), Buffer("B", dt, 128), Buffer("D", F32, 128, role="out")),
                  (1, 1, 1), (32, 1, 1), tuple(body),
                  shared=(Buffer("sA", dt, 256, "shared"), Buffer("sB", dt, 128, "shared")),
                  local=(Buffer("fa", dt, 8, "local"), Buffer("fb", dt, 4, "local"), Buffer("acc", F32, 4, "local")))


@pytest.mark.parametrize("dt", [F16, BF16], ids=lambda d: d.value)
def test_cp_async_ldmatrix_mma_pipeline_on_cuda_sim(dt: DType) -> None:
    kern = warp_gemm_kernel(dt)
    verify_kernel(kern)
    A, B = torch.randn(16, 16).to(TORCH[dt]), torch.randn(16, 8).to(TORCH[dt])
    for check in (False, True):
        D = torch.zeros(16, 8)
        compile_kernels([kern], check_races=check).launch(kern.name, [A, B, D])
        torch.testing.assert_close(D, A.float() @ B.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
def test_tensor_core_ptx_assembles_without_spills_and_uses_hmma(arch: str) -> None:
    from sextant.codegen.ptxas import assemble
    from sextant.codegen.sass import disassemble, find_disassembler

    kernels = [warp_gemm_kernel(F16), warp_gemm_kernel(BF16), *(mma_kernel(*case) for case in MMA_CASES)]
    pm = emit_ptx(kernels, arch=arch)
    for text in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "mma.sync.aligned.m16n8k16.row.col.f32.bf16",
                 "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                 "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16", "cp.async.cg.shared.global", "cp.async.wait_group"):
        assert text in pm.ptx, text
    res = assemble(pm.ptx, arch)
    for name, r in res.kernels.items():
        assert r.spill_stores == r.spill_loads == r.stack_frame == 0, (name, r)
    tool = find_disassembler()
    if tool is None:
        pytest.skip("no nvdisasm/cuobjdump to read the SASS")
    sass = disassemble(res.cubin, tool)
    assert "HMMA.16816.F32" in sass and "HMMA.1688.F32.TF32" in sass and "LDSM.16.M88.4" in sass
    assert "LDGSTS" in sass  # cp.async's SASS


def test_tensor_cores_on_an_old_gpu_raise_instead_of_aborting() -> None:
    with pytest.raises(CodegenError, match="Mma needs sm_80 or newer; this module is compiled for sm_75"):
        emit_ptx([mma_kernel((16, 8, 16), F16, F32, "f16")], arch="sm_75")


# -- the verifier -----------------------------------------------------------------------------------
def _with_body(k: Kernel, body: tuple[Stmt, ...], **kw: object) -> Kernel:
    from dataclasses import replace
    return replace(k, body=body, **kw)


def test_verifier_rejects_misused_tensor_core_statements() -> None:
    base = warp_gemm_kernel(F16)
    mma = Mma((16, 8, 16), "acc", c(0), "fa", c(0), "fb", c(0), "acc", c(0))
    cases = {
        "under control flow that differs within a warp": (If(lt(TID, c(16)), (mma,)),),
        "must be the same in every thread": (
            Mma((16, 8, 16), "acc", c(0), "fa", imod(TID, 2), "fb", c(0), "acc", c(0)),),
        "no mma.sync of shape (16, 8, 32)": (Mma((16, 8, 32), "acc", c(0), "fa", c(0), "fb", c(0), "acc", c(0)),),
        "out of bounds": (Mma((16, 8, 16), "acc", c(2), "fa", c(0), "fb", c(0), "acc", c(0)),),
        "ldmatrix reads shared memory": (LdMatrix("fa", c(0), "A", c(0), 4),),
        "fragments live in local buffers": (LdMatrix("sB", c(0), "sA", c(0), 4),),
        "cp.async copies global memory to shared memory": (CpAsync("sA", c(0), "sB", c(0), 8),),
        "is 6 bytes": (CpAsync("sA", c(0), "A", c(0), 3),),
        "mma accumulators c (f16) and d (f32)": (Mma((16, 8, 16), "acc", c(0), "fa", c(0), "fb", c(0), "fa", c(0)),),
    }
    for message, body in cases.items():
        with pytest.raises(KernelVerificationError, match=message.replace("(", r"\(").replace(")", r"\)")):
            verify_kernel(_with_body(base, body))
    with pytest.raises(KernelVerificationError, match="needs full warps"):
        verify_kernel(_with_body(base, (mma,), block=(48, 1, 1)))


def test_printer_and_serializer_know_the_statements() -> None:
    k = warp_gemm_kernel(BF16)
    lines = [line for s in k.body for line in print_stmt(s)]
    assert "cp_async(&sA[tid.x * 8], &A[tid.x * 8], 8)" in lines
    assert "cp_async_commit()" in lines and "cp_async_wait(0)" in lines
    assert "ldmatrix_x2_trans(&fb[0], &sB[tid.x % 16 * 8])" in lines
    assert "mma_m16n8k16(&acc[0], &fa[0], &fb[0], &acc[0])" in lines
    pred = CpAsync("sA", c(0), "A", c(8), 8, lt(TID, c(3)))
    assert print_stmt(pred) == ["cp_async(&sA[0], &A[8], 8, tid.x < 3)"]
    k2 = _with_body(k, (*k.body, pred))
    assert kernel_from_json(kernel_to_json(k2)) == k2


# -- the race checker and cp.async -------------------------------------------------------------------
def cp_kernel(*, wait: int | None = 0, barrier: bool = True, n: int = 20, stages: int = 1) -> Kernel:
    """32 threads copy 8 halves each with cp.async (zero-filled past row n), then each reads its
    neighbour's. With ``stages`` 2, a second group is issued before waiting with ``wait``."""
    body: list[Stmt] = []
    for st in range(stages):
        body += [CpAsync("s", add(mul(TID, c(8)), c(256 * st)), "x", mul(TID, c(8)), 8, lt(TID, c(n))), CpAsyncCommit()]
    if wait is not None:
        body.append(CpAsyncWait(wait))
    if barrier:
        body.append(Barrier())
    other = imod(add(TID, c(1)), 32)
    body.append(For(Var("i"), c(0), c(8), 1, (Store("y", add(mul(TID, c(8)), Var("i")),
                                                    Load("s", add(mul(other, c(8)), Var("i")), F16)),)))
    return Kernel("cp", (Buffer("x", F16, 256), Buffer("y", F16, 256, role="out")), (2, 1, 1), (32, 1, 1),
                  tuple(body), shared=(Buffer("s", F16, 256 * stages, "shared"),))


def test_cp_async_zero_fills_and_the_checker_accepts_a_correct_pipeline() -> None:
    x = torch.randn(256).half()
    want = x.view(32, 8).clone()
    want[20:] = 0
    want = torch.roll(want, -1, 0).reshape(-1)
    for k in (cp_kernel(), cp_kernel(stages=2, wait=1)):  # wait(1): the older (first) group is complete
        verify_kernel(k)
        for check in (False, True):
            y = torch.zeros(256).half()
            compile_kernels([k], check_races=check).launch("cp", [x, y])
            assert torch.equal(y, want)


@pytest.mark.parametrize("variant,error,message", [
    (dict(wait=None), AsyncCopyError, r"cp.async into it may still be in flight"),
    # thread 1 copies after thread 0 read: a plain race
    (dict(wait=None, barrier=False), SharedMemoryRaceError, r"race \(write after read\)"),
    (dict(barrier=False), SharedMemoryRaceError, r"race"),
])
def test_checker_flags_reading_a_cp_async_tile_too_early(variant: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        compile_kernels([cp_kernel(**variant)], check_races=True).launch("cp", [torch.randn(256).half(),
                                                                            torch.zeros(256).half()])


def test_checker_flags_reading_the_group_a_wait_left_in_flight() -> None:
    """Two groups, ``wait(1)`` completes only the first; reading the second's tile is an error."""
    body = list(cp_kernel(stages=2, wait=1).body)
    body[-1] = For(Var("i"), c(0), c(8), 1, (Store("y", add(mul(TID, c(8)), Var("i")),
                                                   Load("s", add(add(mul(TID, c(8)), Var("i")), c(256)), F16)),))
    k = _with_body(cp_kernel(stages=2, wait=1), tuple(body))
    with pytest.raises(AsyncCopyError):
        compile_kernels([k], check_races=True).launch("cp", [torch.randn(256).half(), torch.zeros(256).half()])


def test_checker_flags_an_mma_some_lanes_skip() -> None:
    """The verifier rejects this kernel; compiled anyway, the checked build catches it at run time."""
    base = mma_kernel((16, 8, 16), F16, F32, "f16")
    body = tuple(If(lt(TID, c(16)), (s,)) if isinstance(s, Mma) else s for s in base.body)
    k = _with_body(base, body)
    args = [torch.randn(16, 16).half(), torch.randn(16, 8).half(), torch.zeros(16, 8), torch.zeros(16, 8)]
    with pytest.raises(DivergentWarpError, match="runs mma acc that lane 16"):
        compile_kernels([k], check_races=True).launch(k.name, args)
