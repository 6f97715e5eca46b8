"""The Hopper GEMM (wgmma fed by TMA, sm_90a): chosen for f16/bf16 matmuls whose operands TMA can
describe, correct through cuda-sim (race-checked, including its mbarrier phases) against eager at
ragged sizes with fused epilogues, assembled by ptxas for sm_90a without spills or serialised
wgmmas; other matmuls keep the mma.sync GEMM."""

from __future__ import annotations

import pytest
import torch

import sextant
from sextant.kernel.wgmma import kernel_tensor_maps


class Linear(torch.nn.Module):
    def __init__(self, k: int, n: int, act: bool = True) -> None:
        super().__init__()
        self.lin, self.act = torch.nn.Linear(k, n), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.nn.functional.gelu(y) if self.act else y


class MatmulKN(torch.nn.Module):
    """``x @ W`` with W stored K×N (HF GPT-2's Conv1D): B read MN-major."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(k, n) / k ** 0.5)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return x @ self.w + r


def _compile(mod: torch.nn.Module, args: tuple, monkeypatch: pytest.MonkeyPatch) -> sextant.CompiledModule:
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")  # shared-memory races and waits that would hang are errors
    return sextant.compile(mod, args, target="cuda-sim", arch="sm_90a")


@pytest.mark.parametrize("m,k,n,dt", [(128, 128, 128, torch.float16), (200, 136, 72, torch.bfloat16),
                                      (33, 64, 256, torch.float16), (130, 320, 136, torch.float16)])
def test_linear_runs_on_wgmma_and_matches_eager(m: int, k: int, n: int, dt: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    mod = Linear(k, n).to(dt)
    x = torch.randn(m, k).to(dt)
    cm = _compile(mod, (x,), monkeypatch)
    kernels = cm.stages["program"].kernels
    assert [kn.meta["mapping"] for kn in kernels.values()] == ["wgmma-tma"]
    x2 = torch.randn(m, k).to(dt)  # fresh inputs
    ref = mod.float()(x2.float())
    torch.testing.assert_close(cm(x2).float(), ref, atol=2e-2, rtol=2e-2)
    res = cm.stages["ptxas"]
    assert "C7512" not in res.log and "serialized" not in res.log
    assert all(r.spill_stores == r.spill_loads == 0 for r in res.kernels.values())


def test_matmul_with_kn_weight_reads_b_mn_major(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    mod = MatmulKN(192, 128).half()
    x, r = torch.randn(100, 192).half(), torch.randn(100, 128).half()
    cm = _compile(mod, (x, r), monkeypatch)
    (kern,) = cm.stages["program"].kernels.values()
    assert kern.meta["mapping"] == "wgmma-tma"
    assert "mn-major" in sextant.kernel.printer.print_kernel(kern)
    torch.testing.assert_close(cm(x, r).float(), mod.float()(x.float(), r.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("a_shape,b_shape,transposed,outer", [
    ((3, 100, 128), (3, 128, 192), False, {1}),  # B stored K×N per matrix: MN-major, 3-D tensor maps
    ((2, 2, 130, 64), (2, 2, 72, 64), True, {1}),  # Bᵀ: K-major; the graph merged the two batch dims
    ((4, 70, 64), (64, 128), False, {0}),  # a weight shared by the batch: the graph made it one product
])
def test_batched_matmuls_run_on_wgmma(a_shape: tuple, b_shape: tuple, transposed: bool, outer: set,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    class Bmm(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a @ (b.transpose(-1, -2) if transposed else b)

    torch.manual_seed(5)
    a, b = torch.randn(a_shape).half(), torch.randn(b_shape).half()
    cm = _compile(Bmm(), (a, b), monkeypatch)
    kernels = list(cm.stages["program"].kernels.values())
    assert [k.meta["mapping"] for k in kernels] == ["wgmma-tma"]
    assert {len(tm.outer_dims) for tm in kernel_tensor_maps(kernels[0].body)} == outer
    a2, b2 = torch.randn(a_shape).half(), torch.randn(b_shape).half()
    torch.testing.assert_close(cm(a2, b2).float(), Bmm()(a2.float(), b2.float()), atol=3e-2, rtol=2e-2)


def test_operands_tma_cannot_describe_keep_mma_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    class Sliced(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a[:, 8:72] @ b  # A starts 8 columns into its rows: no tensor map starts there

    a, b = torch.randn(64, 80).half(), torch.randn(64, 64).half()
    cm = _compile(Sliced(), (a, b), monkeypatch)
    assert {kn.meta["mapping"] for kn in cm.stages["program"].kernels.values()} == {"tensor-core"}
    torch.testing.assert_close(cm(a, b).float(), Sliced()(a.float(), b.float()), atol=2e-2, rtol=2e-2)


def test_unaligned_row_stride_keeps_mma_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """N = 130: a K×N weight's rows are 260 bytes, which a tensor map cannot stride (16-byte multiples)."""
    mod = MatmulKN(64, 130).half()
    x, r = torch.randn(70, 64).half(), torch.randn(70, 130).half()
    cm = _compile(mod, (x, r), monkeypatch)
    assert {kn.meta["mapping"] for kn in cm.stages["program"].kernels.values()} == {"tensor-core"}
    torch.testing.assert_close(cm(x, r).float(), mod.float()(x.float(), r.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n", [130, 10])
def test_linear_reads_its_weight_in_place(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linear's W (``N × K``) is read as Wᵀ, K-major, where the module keeps it — no row-major
    copy, whose ``N``-element rows a tensor map could not stride at N = 130 or a 10-class head."""
    torch.manual_seed(4)
    mod = Linear(64, n, act=False).half()
    x = torch.randn(70, 64).half()
    cm = _compile(mod, (x,), monkeypatch)
    (kern,) = cm.stages["program"].kernels.values()
    assert kern.meta["mapping"] == "wgmma-tma"
    assert f"[{n}x64, stride 64]" in sextant.kernel.printer.print_kernel(kern)  # W itself, rows of K
    assert not [t for t in cm.stages["program"].constants.values() if tuple(t.shape) == (64, n)]
    torch.testing.assert_close(cm(x).float(), mod.float()(x.float()), atol=2e-2, rtol=2e-2)


def test_sm90_without_a_keeps_mma_sync() -> None:
    mod = Linear(64, 64).half()
    cm = sextant.compile(mod, (torch.randn(64, 64).half(),), target="cuda-sim", arch="sm_90")
    assert {kn.meta["mapping"] for kn in cm.stages["program"].kernels.values()} == {"tensor-core"}


def _ws_kernel(m: int, k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor, sextant.kernel.ir.Kernel]:
    from sextant.frontend.capture import capture
    from sextant.graph.passes import run_pipeline
    from sextant.schedule.program import schedule
    from sextant.schedule.target import gpu_target

    torch.manual_seed(4)
    mod = Linear(k, n, act=False).half()
    x = torch.randn(m, k).half()
    program = schedule(run_pipeline(capture(mod, (x,))), gpu_target("sm_90a"))
    (kern,) = program.kernels.values()
    return mod, x, kern


def test_large_tiles_are_warp_specialized_with_register_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """M > 64: a producer warpgroup issues the copies (40 registers), two consumers compute (232), full
    and empty barriers per stage and no block barrier in the loop; N > 128 takes the 128 × 256 tile."""
    mod, x, kern = _ws_kernel(256, 320, 256)
    assert kern.meta["warp_specialized"] and kern.meta["tile"] == (128, 256, 64) and kern.block == (384, 1, 1)
    text = sextant.kernel.printer.print_kernel(kern)
    assert "setmaxnreg_dec(40)" in text and "setmaxnreg_inc(232)" in text
    assert "mbarrier_init(&bar[4], 256)" in text  # an empty barrier: every consumer thread arrives
    assert text.count("__syncthreads()") == 1  # after the barriers' initialisation only
    cm = _compile(mod, (x,), monkeypatch)
    x2 = torch.randn(256, 320).half()
    torch.testing.assert_close(cm(x2).float(), mod.float()(x2.float()), atol=2e-2, rtol=2e-2)
    ptx = cm.stages["ptx"].ptx
    assert "setmaxnreg.dec.sync.aligned.u32 \t40;" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t232;" in ptx
    res = cm.stages["ptxas"]
    assert "C7512" not in res.log and "serialized" not in res.log and "C7508" not in res.log  # setmaxnreg honoured
    (r,) = res.kernels.values()
    assert r.spill_stores == r.spill_loads == 0 and r.registers <= 168  # 384 threads launch within 65,536


@pytest.mark.parametrize("mistake", ["no_release", "wrong_parity"])
def test_checked_build_reports_a_producer_that_would_hang(mistake: str) -> None:
    """The consumers never release a stage, or the producer waits for the wrong phase of its empty
    barrier: on a GPU the producer waits forever; cuda-sim's checked build says so."""
    import dataclasses

    from sextant.codegen import compile_kernels
    from sextant.codegen.race_check import MbarrierHangError
    from sextant.kernel.ir import Binary, For, If, MbarrierArrive, MbarrierWait, c

    _, x, kern = _ws_kernel(256, 384, 256)  # 6 K tiles: the producer waits in its third and fourth

    def mutate(s):  # type: ignore[no-untyped-def]
        if isinstance(s, For):
            return dataclasses.replace(s, body=tuple(mutate(x) for x in s.body))
        if isinstance(s, If):
            if mistake == "no_release" and len(s.then) == 1 and isinstance(s.then[0], MbarrierArrive):
                return If(s.cond, ())
            return If(s.cond, tuple(mutate(x) for x in s.then), tuple(mutate(x) for x in s.orelse))
        if mistake == "wrong_parity" and isinstance(s, MbarrierWait) and isinstance(s.index, Binary):  # the producer's
            return dataclasses.replace(s, parity=Binary("bitwise_xor", s.parity, c(1), s.parity.dtype))
        return s

    bad = dataclasses.replace(kern, body=tuple(mutate(s) for s in kern.body))
    assert bad != kern
    w = torch.randn(256, 384).half()
    with pytest.raises(MbarrierHangError, match="mbarrier bar"):
        compile_kernels([bad], check_races=True).launch(bad.name, [x, w, torch.zeros(256).half(),
                                                                   torch.zeros(256, 256).half()])


@pytest.mark.parametrize("m,n,tile", [(200, 48, (128, 64, 64)), (200, 72, (128, 128, 64)), (300, 520, (128, 256, 64)),
                                      (40, 48, (64, 64, 64)), (40, 200, (64, 128, 64))])
def test_tile_is_the_narrowest_that_covers_n(m: int, n: int, tile: tuple) -> None:
    from sextant.schedule.gpu_wgmma import choose_wg_tile

    assert choose_wg_tile(m, n).meta()["tile"] == tile


def test_narrow_product_on_a_64_wide_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(6)
    mod = Linear(136, 48).half()
    x = torch.randn(200, 136).half()
    cm = _compile(mod, (x,), monkeypatch)
    (kern,) = cm.stages["program"].kernels.values()
    assert kern.meta["tile"] == (128, 64, 64) and kern.meta["warp_specialized"]
    torch.testing.assert_close(cm(x).float(), mod.float()(x.float()), atol=2e-2, rtol=2e-2)


class AttentionProjection(torch.nn.Module):
    """SDPA, heads merged back (``o.transpose(1, 2).reshape(…)``) and the output projection: A is
    no strided matrix, but each head is one (``tma.HeadsOperand``)."""

    def __init__(self, h: int, d: int, n_out: int, flat: bool) -> None:
        super().__init__()
        self.flat, self.lin = flat, torch.nn.Linear(h * d, n_out)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, h, n, d = o.shape
        o = o.transpose(1, 2)
        return self.lin(o.reshape(b * n, h * d) if self.flat else o.reshape(b, n, h * d))


@pytest.mark.parametrize("b,h,n,d,n_out,flat,box", [
    (2, 4, 16, 16, 64, True, "16x16"),  # heads of 16: four 32-byte-swizzled boxes a K tile; 2 × 16 rows
    (2, 3, 100, 32, 136, True, "100x32"),  # heads of 32, 128-row tiles per batch, K = 96: the last box past the heads
    (2, 3, 40, 64, 96, True, "40x64"),  # one head a K tile, ragged rows
    (2, 2, 24, 128, 64, False, "24x128"),  # two K tiles a head; [b, n, h·d] kept batched
])
def test_attention_output_projection_reads_heads_by_tma(b: int, h: int, n: int, d: int, n_out: int, flat: bool,
                                                        box: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(5)
    mod = AttentionProjection(h, d, n_out, flat).half()
    args = tuple(torch.randn(b, h, n, d).half() for _ in range(3))
    cm = _compile(mod, args, monkeypatch)
    kern = next(kn for kn in cm.stages["program"].kernels.values() if kn.name.startswith("matmul"))
    assert kern.meta["mapping"] == "wgmma-tma"
    text = sextant.kernel.printer.print_kernel(kern)
    assert f"(stride {n * d}) x {box}, stride {d}]" in text  # each head an n × d matrix, heads an outer dim
    assert f"box={kern.meta['tile'][0]}x{min(d, 64)}, swizzle={min(d, 64) * 2}" in text
    args2 = tuple(torch.randn(b, h, n, d).half() for _ in range(3))  # fresh inputs
    torch.testing.assert_close(cm(*args2).float(), mod.float()(*(a.float() for a in args2)), atol=2e-2, rtol=2e-2)
    res = cm.stages["ptxas"]
    assert "C7512" not in res.log and "serialized" not in res.log
    assert all(r.spill_stores == r.spill_loads == 0 for r in res.kernels.values())
