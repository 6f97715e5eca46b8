"""target="cuda-sim": the GPU compilation (sm_90 schedules, PTX, ptxas) run on the CPU."""

import dataclasses

import pytest
import torch

import sextant
from sextant.codegen.race_check import CheckedCpuModule, SharedMemoryRaceError
from sextant.examples import EXAMPLES
from sextant.kernel.ir import Barrier, For, If, Kernel
from sextant.schedule import gpu_kernels


@pytest.mark.parametrize("name", ["mlp", "transformer-block"])
def test_cuda_sim_matches_eager(name: str) -> None:
    model, args = EXAMPLES[name]()
    compiled = sextant.compile(model, args, target="cuda-sim")
    fresh = tuple(torch.randn_like(a) for a in args)
    with torch.no_grad():
        expected = model(*fresh)
    torch.testing.assert_close(compiled(*fresh), expected, rtol=1e-4, atol=2e-5)
    program = compiled.stages["program"]
    assert program.target.is_gpu
    assert all(k.threads_per_block > 1 for k in program.kernels.values())
    ptx = compiled.stages["ptx"].ptx
    assert ".target sm_90" in ptx and ".entry" in ptx
    resources = compiled.stages["ptxas"]
    assert set(program.kernels) <= set(resources.kernels)


def _without_trailing_barriers(stmts: tuple) -> tuple:
    """Loop bodies lose a final ``Barrier`` (the one that keeps the next iteration from overwriting
    shared tiles other threads still read)."""
    out = []
    for s in stmts:
        if isinstance(s, For):
            body = s.body[:-1] if s.body and isinstance(s.body[-1], Barrier) else s.body
            s = dataclasses.replace(s, body=_without_trailing_barriers(body))
        elif isinstance(s, If):
            s = dataclasses.replace(s, then=_without_trailing_barriers(s.then),
                                    orelse=_without_trailing_barriers(s.orelse))
        out.append(s)
    return tuple(out)


def test_a_schedule_that_drops_a_barrier_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU matmul mapping that forgets its K loop's second barrier still passes the kernel verifier, assembles
    with ptxas and gives the right answer through plain cuda-sim (the CPU runs each phase's
    threads in turn); the checked mode names the race."""
    original = gpu_kernels.GPU_MAPPINGS["matmul"]

    original_kernels: list[Kernel] = []

    def forgetful(*args: object) -> Kernel:
        k = original(*args)
        original_kernels.append(k)
        return dataclasses.replace(k, body=_without_trailing_barriers(k.body))

    monkeypatch.setitem(gpu_kernels.GPU_MAPPINGS, "matmul", forgetful)
    torch.manual_seed(0)
    model, x = torch.nn.Linear(40, 70).eval(), torch.randn(33, 40)
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "0")
    plain = sextant.compile(model, (x,), target="cuda-sim")
    (kernel,) = plain.stages["program"].kernels.values()
    barriers = sum(isinstance(s, Barrier) for s in _walk(kernel.body))
    assert kernel.shared and barriers == sum(isinstance(s, Barrier) for s in _walk(original_kernels[0].body)) - 1
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x), rtol=1e-4, atol=2e-5)  # right by luck

    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    checked = sextant.compile(model, (x,), target="cuda-sim")
    assert isinstance(checked.stages["cpu_module"], CheckedCpuModule)
    with pytest.raises(SharedMemoryRaceError) as info:
        checked(x)
    assert info.value.kernel == kernel.name and info.value.buffer in {b.name for b in kernel.shared}
    assert f"kernel {kernel.name}" in str(info.value) and "no Barrier between them" in str(info.value)


def test_checked_mode_through_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    model, args = EXAMPLES["transformer-block"]()
    compiled = sextant.compile(model, args, target="cuda-sim")
    assert isinstance(compiled.stages["cpu_module"], CheckedCpuModule)
    x = torch.randn_like(args[0])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=2e-5)


def _walk(stmts: tuple) -> list:
    out = []
    for s in stmts:
        out.append(s)
        if isinstance(s, For):
            out += _walk(s.body)
        elif isinstance(s, If):
            out += _walk(s.then) + _walk(s.orelse)
    return out
