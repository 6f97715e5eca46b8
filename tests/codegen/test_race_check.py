"""The checked SIMT CPU lowering (``compile_kernels(..., check_races=True)``): correct kernels run
and match the kernel interpreter; each barrier of the sample shared-memory kernels, removed, is
reported as a race naming the kernel, the buffer, the element and two threads; bad guards are
reported as out-of-bounds accesses; warp reductions that part of a warp skips are reported."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from sextant.codegen import compile_kernels
from sextant.codegen.race_check import (
    CheckedCpuModule,
    DivergentWarpError,
    KernelCheckError,
    OutOfBoundsError,
    SharedMemoryRaceError,
)
from sextant.errors import SextantError
from sextant.kernel.ir import Assign, Barrier, Buffer, For, If, Kernel, Load, Select, Stmt, Store, WarpReduce
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

_spec = importlib.util.spec_from_file_location("kernel_samples", Path(__file__).parents[1] / "kernel" / "samples.py")
samples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(samples)
F32, TID, b, c, v, lt = samples.F32, samples.TID, samples.b, samples.c, samples.v, samples.lt


def _count_barriers(stmts: tuple[Stmt, ...]) -> int:
    n = 0
    for s in stmts:
        n += isinstance(s, Barrier)
        if isinstance(s, For):
            n += _count_barriers(s.body)
        elif isinstance(s, If):
            n += _count_barriers(s.then) + _count_barriers(s.orelse)
    return n


def _without_barrier(kernel: Kernel, which: int) -> Kernel:
    """``kernel`` with its ``which``-th barrier (in program order) removed."""
    seen = 0

    def walk(stmts: tuple[Stmt, ...]) -> tuple[Stmt, ...]:
        nonlocal seen
        out: list[Stmt] = []
        for s in stmts:
            if isinstance(s, Barrier):
                seen += 1
                if seen - 1 == which:
                    continue
            elif isinstance(s, For):
                s = dataclasses.replace(s, body=walk(s.body))
            elif isinstance(s, If):
                s = dataclasses.replace(s, then=walk(s.then), orelse=walk(s.orelse))
            out.append(s)
        return tuple(out)

    return dataclasses.replace(kernel, body=walk(kernel.body))


def _inputs(kernel: Kernel, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {p.name: torch.randn(p.size, generator=gen) if p.role == "in" else torch.zeros(p.size)
            for p in kernel.params}


SAMPLES = {
    "tiled_matmul": lambda: samples.tiled_matmul(32, 48, 64),
    "block_sum": lambda: samples.block_sum(3, 300, 64),
    "warp_sum": lambda: samples.warp_sum(2, 100, 128),
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_correct_sample_kernels_pass_and_match_the_interpreter(name: str) -> None:
    kernel = SAMPLES[name]()
    module = compile_kernels([kernel], check_races=True)
    assert isinstance(module, CheckedCpuModule)
    bufs = _inputs(kernel, torch.Generator().manual_seed(1))
    want = samples.run_kernel(kernel, {k: t.tolist() for k, t in bufs.items()})
    module.launch(kernel.name, [bufs[p.name] for p in kernel.params])
    for p in kernel.params:
        if p.role != "in":
            torch.testing.assert_close(bufs[p.name], torch.tensor(want[p.name]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_every_missing_barrier_is_a_race(name: str) -> None:
    kernel = SAMPLES[name]()
    n = _count_barriers(kernel.body)
    assert n >= 1
    broken = [dataclasses.replace(_without_barrier(kernel, i), name=f"{kernel.name}_no_barrier{i}") for i in range(n)]
    module = compile_kernels(broken, check_races=True)
    shared = {s.name for s in kernel.shared}
    for k in broken:
        with pytest.raises(SharedMemoryRaceError) as info:
            module.launch(k.name, list(_inputs(k, torch.Generator().manual_seed(2)).values()))
        err = info.value
        assert err.kernel == k.name and err.buffer in shared
        assert 0 <= err.element < k.buffer(err.buffer).size
        a, b_ = err.threads
        assert a != b_ and all(0 <= t < d for t, d in zip(a + b_, k.block + k.block))
        assert k.name in str(err) and f"{err.buffer}[{err.element}]" in str(err) and "no Barrier" in str(err)
        assert isinstance(err, SextantError)


def test_a_race_is_invisible_without_the_check() -> None:
    """The first barrier of the block reduction, removed: the CPU runs the partial-sum phase for all
    threads before the tree, so the plain lowering still gets the right answer."""
    kernel = _without_barrier(samples.block_sum(3, 300, 64), 0)
    x = torch.randn(900)
    out = torch.zeros(3)
    compile_kernels([kernel], check_races=False).launch(kernel.name, [x, out])
    torch.testing.assert_close(out, x.view(3, 300).sum(1), rtol=1e-4, atol=1e-4)
    with pytest.raises(SharedMemoryRaceError, match=r"read after write\): thread \(0, 0, 0\) reads buf\[32\], "
                                                    r"which thread \(32, 0, 0\) wrote"):
        compile_kernels([kernel], check_races=True).launch(kernel.name, [x, out])


def test_race_message_names_both_threads_and_block() -> None:
    kernel = _without_barrier(samples.tiled_matmul(32, 32, 32), 1)  # the barrier before tiles are overwritten
    module = compile_kernels([kernel], check_races=True)
    with pytest.raises(SharedMemoryRaceError) as info:
        module.launch(kernel.name, [torch.randn(1024), torch.randn(1024), torch.zeros(1024)])
    msg = str(info.value)
    assert msg.startswith("kernel tiled_matmul, block (0, 0, 0): shared-memory race (write after read)"), msg
    assert info.value.block == (0, 0, 0)


def test_warp_reduce_does_not_order_shared_memory() -> None:
    """Neighbours exchange through shared memory with only a warp reduction between: a race (CUDA
    needs __syncwarp or a barrier); with a barrier instead it is fine."""
    p, x = v("p", F32), v("x", F32)
    swap = b("bitwise_xor", TID, c(1))

    def kernel(sync: Stmt, name: str) -> Kernel:
        body = (Store("sh", TID, Load("in0", TID, F32)), sync, Assign(x, Load("sh", swap, F32)),
                WarpReduce(p, "sum", x), Store("out0", TID, b("add", x, p)))
        return Kernel(name, (Buffer("in0", F32, 64), Buffer("out0", F32, 64, role="out")), (1, 1, 1), (64, 1, 1),
                      body, shared=(Buffer("sh", F32, 64, "shared"),))

    module = compile_kernels([kernel(WarpReduce(v("q", F32), "sum", samples.f(0)), "warp_only"),
                              kernel(Barrier(), "barrier")], check_races=True)
    x_in, out = torch.randn(64), torch.zeros(64)
    module.launch("barrier", [x_in, out])
    swapped = x_in.view(32, 2).flip(1).reshape(64)
    torch.testing.assert_close(out, swapped + swapped.view(2, 32).sum(1).repeat_interleave(32))
    with pytest.raises(SharedMemoryRaceError, match=r"thread \(0, 0, 0\) reads sh\[1\], which thread \(1, 0, 0\)"):
        module.launch("warp_only", [x_in, out])


# -- out of bounds --------------------------------------------------------------------------------
def test_wrong_guard_is_an_out_of_bounds_load() -> None:
    kernel = samples.elementwise(1000, 256, guard=b("le", v("i"), c(1000)))  # `<=` instead of `<`
    module = compile_kernels([kernel], check_races=True)
    with pytest.raises(OutOfBoundsError, match=r"kernel elementwise, block \(3, 0, 0\): thread \(232, 0, 0\) "
                                               r"loads in0\[1000\], out of bounds of its 1000 elements"):
        module.launch("elementwise", [torch.randn(1000), torch.zeros(1000)])
    good = samples.elementwise(1000, 256)
    x, y = torch.randn(1000), torch.zeros(1000)
    compile_kernels([good], check_races=True).launch("elementwise", [x, y])
    torch.testing.assert_close(y, torch.exp(x) * 0.5)


def test_out_of_bounds_shared_store_is_reported_not_a_crash() -> None:
    body = (Store("sh", b("add", TID, c(1)), samples.f(1.0)), Barrier(), Store("out0", TID, Load("sh", TID, F32)))
    kernel = Kernel("shift", (Buffer("out0", F32, 32, role="out"),), (1, 1, 1), (32, 1, 1), body,
                    shared=(Buffer("sh", F32, 32, "shared"),))
    with pytest.raises(OutOfBoundsError, match=r"thread \(31, 0, 0\) stores to sh\[32\]") as info:
        compile_kernels([kernel], check_races=True).launch("shift", [torch.zeros(32)])
    assert isinstance(info.value, KernelCheckError) and info.value.buffer == "sh"


# -- divergent warps --------------------------------------------------------------------------------
def _warp_kernel(cond: object, name: str) -> Kernel:
    """Every thread loads one of two inputs depending on its parity (divergent loads are fine),
    then a warp sum under ``cond``."""
    x, r = v("x", F32), v("r", F32)
    odd = b("eq", b("bitwise_and", TID, c(1)), c(1))
    body = (
        If(odd, (Assign(x, Load("a", TID, F32)),), (Assign(x, b("mul", Load("b", TID, F32), samples.f(2))),)),
        Assign(x, Select(odd, x, b("add", x, samples.f(1)), F32)),
        If(cond, (WarpReduce(r, "sum", x), Store("out0", TID, r))),
    )
    return Kernel(name, (Buffer("a", F32, 64), Buffer("b", F32, 64), Buffer("out0", F32, 64, role="out")),
                  (1, 1, 1), (64, 1, 1), body)


def test_divergent_loads_around_a_converged_warp_reduce() -> None:
    kernel = _warp_kernel(lt(TID, c(64)), "converged")
    verify_kernel(kernel)
    a, bb, out = torch.randn(64), torch.randn(64), torch.zeros(64)
    compile_kernels([kernel], check_races=True).launch("converged", [a, bb, out])
    x = torch.where(torch.arange(64) % 2 == 1, a, bb * 2 + 1)
    torch.testing.assert_close(out, x.view(2, 32).sum(1).repeat_interleave(32))
    want = samples.run_kernel(kernel, {"a": a.tolist(), "b": bb.tolist(), "out0": [0.0] * 64})["out0"]
    torch.testing.assert_close(out, torch.tensor(want))


def test_warp_reduce_in_half_a_warp_is_refused() -> None:
    """``if tid < 16: WarpReduce``: the verifier refuses it statically; the plain CPU lowering would
    quietly reduce stale exchange slots; the checked lowering names the missing lane."""
    kernel = _warp_kernel(lt(TID, c(16)), "divergent")
    with pytest.raises(KernelVerificationError, match="differs within a warp"):
        verify_kernel(kernel)
    module = compile_kernels([kernel], check_races=True)
    with pytest.raises(DivergentWarpError, match=r"thread \(0, 0, 0\) reduces r with a WarpReduce that lane 16 "
                                                 r"of its warp \(thread \(16, 0, 0\)\) did not reach"):
        module.launch("divergent", [torch.randn(64), torch.randn(64), torch.zeros(64)])


def test_warp_uniform_condition_passes() -> None:
    kernel = _warp_kernel(lt(TID, c(32)), "first_warp")  # whole warps agree
    verify_kernel(kernel)
    out = torch.zeros(64)
    compile_kernels([kernel], check_races=True).launch("first_warp", [torch.randn(64), torch.randn(64), out])
    assert (out[32:] == 0).all() and torch.unique(out[:32]).numel() == 1


def test_environment_variable_turns_checks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = samples.elementwise(100, 64)
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    assert isinstance(compile_kernels([kernel]), CheckedCpuModule)
    assert not isinstance(compile_kernels([kernel], check_races=False), CheckedCpuModule)
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "0")
    assert not isinstance(compile_kernels([kernel]), CheckedCpuModule)
