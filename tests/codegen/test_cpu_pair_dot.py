"""The CPU's bf16 pair dot product (kernel.ir.PairDot) written directly in kernel IR: one
``vdpbf16ps`` where the CPU has AVX-512-BF16, the same sums lane by lane elsewhere and in the
checked build; checked against torch's f32 arithmetic on the same bf16 values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sextant.codegen import compile_kernels, cpu_matrix, emit_module
from sextant.codegen.llvm_cpu import host_target_machine
from sextant.graph.dtypes import DType
from sextant.host import host_pair_dot
from sextant.kernel.ir import Assign, Buffer, Const, For, Kernel, Load, PairDot, Special, Store, Var, add, c, mul
from sextant.kernel.printer import print_kernel
from sextant.kernel.serialize import kernel_from_json, kernel_to_json
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

F32, BF16 = DType.f32, DType.bf16


def row_times_pairs(k: int, lanes: int, rows: int = 3) -> Kernel:
    """``out[r, l] = Σ_k a[r, k] · b[k, l]`` with B in pairs of K (``bp[k/2, l, k%2]``), one
    block per row: zero the accumulators, one pair dot per pair of K, store."""
    kp, u, r = Var("kp"), Var("u"), Var("r")
    a = lambda kk: Load("a", add(mul(r, c(k)), kk), BF16)
    body = (
        Assign(r, Special("bid", "x")),
        For(u, c(0), c(lanes), 1, (Store("acc", u, Const(0.0, F32)),), True),
        For(kp, c(0), c(k // 2), 1, (PairDot("acc", c(0), a(mul(kp, c(2))), a(add(mul(kp, c(2)), c(1))),
                                               "bp", mul(kp, c(2 * lanes)), lanes),)),
        For(u, c(0), c(lanes), 1, (Store("out", add(mul(r, c(lanes)), u), Load("acc", u, F32)),)),
    )
    params = (Buffer("a", BF16, rows * k), Buffer("bp", BF16, k * lanes), Buffer("out", F32, rows * lanes, role="out"))
    return Kernel(f"pairs_{lanes}", params, (rows, 1, 1), (1, 1, 1), body, local=(Buffer("acc", F32, lanes, "local"),))


def operands(k: int, lanes: int, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.randn(rows, k).bfloat16()
    b = torch.randn(k, lanes).bfloat16()
    bp = b.view(k // 2, 2, lanes).permute(0, 2, 1).contiguous()  # pairs of K next to each other
    return a, b, bp


def expected(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The instruction's order: per pair of K, the high product added first, then the low one."""
    acc = torch.zeros(a.shape[0], b.shape[1])
    for kp in range(a.shape[1] // 2):
        for kk in (2 * kp + 1, 2 * kp):
            acc = acc + a[:, kk, None].float() * b[kk].float()
    return acc


@pytest.mark.parametrize("lanes", [16, 8, 4])
@pytest.mark.parametrize("how", ["host", "lane by lane", "checked"])
def test_pair_dot_matches_f32_sums(lanes, how, monkeypatch):
    if how == "lane by lane":  # as a CPU without the instruction compiles it: in this process, not cached
        monkeypatch.setattr(cpu_matrix, "host_pair_dot", lambda: False)
        monkeypatch.setenv("SEXTANT_CACHE", "0")
        monkeypatch.setenv("SEXTANT_COMPILE_JOBS", "1")
    k = 70
    kern = row_times_pairs(k, lanes)
    verify_kernel(kern)
    a, b, bp = operands(k, lanes)
    out = torch.full((3, lanes), float("nan"))
    compile_kernels([kern], check_races=how == "checked").launch(kern.name, [a, bp, out])
    torch.testing.assert_close(out, expected(a, b), rtol=0, atol=0)  # the same rounding, bit for bit
    torch.testing.assert_close(out, a.float() @ b.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not host_pair_dot(), reason="this CPU has no AVX-512-BF16 (vdpbf16ps)")
def test_pair_dot_is_one_instruction():
    import llvmlite.binding as llvm

    tm = host_target_machine()
    mod = llvm.parse_assembly(str(emit_module([row_times_pairs(64, 16)], tm)))
    asm = tm.emit_assembly(mod)
    assert "vdpbf16ps" in asm
    assert "{1to16}" in asm or "vpbroadcastd" in asm  # A's pair broadcast, not built lane by lane


def test_pair_dot_text_and_json_round_trip():
    kern = row_times_pairs(8, 16)
    text = print_kernel(kern)
    assert "pair_dot_x16(&acc[0], a[" in text
    assert kernel_from_json(kernel_to_json(kern)) == kern


@pytest.mark.parametrize("change, message", [
    (dict(lanes=12), "pair dot over 12 lanes"),
    (dict(b="out"), "multiplies bf16 values"),
    (dict(acc="a"), "f32 local buffer"),
    (dict(b="nowhere"), "is not a buffer"),
])
def test_verifier_refuses_bad_pair_dots(change, message):
    kern = row_times_pairs(8, 16)
    loop = kern.body[2]
    bad = dataclasses.replace(loop, body=(dataclasses.replace(loop.body[0], **change),))
    with pytest.raises(KernelVerificationError, match=message):
        verify_kernel(dataclasses.replace(kern, body=(*kern.body[:2], bad, *kern.body[3:])))


def test_verifier_finds_a_pair_dot_reading_past_b():
    kern = row_times_pairs(8, 16)
    short = tuple(Buffer("bp", BF16, 8 * 16 - 1) if p.name == "bp" else p for p in kern.params)
    with pytest.raises(KernelVerificationError, match=r"load from bp\[kp \* 32 \+ 31\] is out of bounds"):
        verify_kernel(dataclasses.replace(kern, params=short))
