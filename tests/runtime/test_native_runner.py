"""The CPU target's native launch-plan executor: one call per forward pass, big launches split
over worker threads that meet at spin barriers. Checked against eager and against the
launch-by-launch ProgramRunner on the same compiled kernels."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import sextant
from sextant.codegen.executor import BARRIER, FIELDS, PARALLEL
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.graph.passes import run_pipeline
from sextant.runtime.native_runner import NativeRunner
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target


class Mixed(nn.Module):
    """Big launches (a 256×512×512 matmul, a softmax over 256 rows) between tiny ones, each
    reading the one before, so a missing barrier or a wrong block share shows as a wrong answer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.tiny = nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.softmax(self.fc1(x), -1) * 512
        h = torch.relu(self.fc2(h)) + x
        return self.tiny(h).sum(0, keepdim=True) + h[:1, :4]


def _runners(monkeypatch: pytest.MonkeyPatch, threads: int):
    monkeypatch.setenv("SEXTANT_CPU_THREADS", str(threads))
    model, x = Mixed().eval(), torch.randn(256, 512)
    program = schedule(run_pipeline(sextant.capture(model, (x,))), cpu_target())
    module = compile_kernels(list(program.kernels.values()))
    return model, program, NativeRunner(program, module), ProgramRunner(program, module.launch)


@pytest.mark.parametrize("threads", [1, 2, 3])  # 3 on a 2-core machine: workers wait at barriers by yielding
def test_plan_matches_eager_and_the_launch_by_launch_runner(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    model, _, native, stepwise = _runners(monkeypatch, threads)
    assert native.workers == (1 if threads == 1 else threads)
    plan = list(native._plan)
    flags = [plan[1 + FIELDS * i + 4] for i in range(plan[0])]
    if threads > 1:
        assert any(f & PARALLEL for f in flags) and any(not f & PARALLEL for f in flags)
        for i, f in enumerate(flags):  # a barrier after every parallel launch and before every one
            nxt = flags[i + 1] if i + 1 < len(flags) else 0
            assert bool(f & BARRIER) == bool(f & PARALLEL or nxt & PARALLEL)
    for _ in range(3):
        x = torch.randn(256, 512)
        with torch.no_grad():
            want = model(x)
        (got,) = native([x])
        (ref,) = stepwise([x])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got, ref)  # the same kernels on the same blocks: bit for bit


def test_threads_calling_one_module_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, native, _ = _runners(monkeypatch, 2)
    xs = [torch.randn(256, 512) for _ in range(4)]
    with torch.no_grad():
        want = [model(x) for x in xs]
    got: dict[int, list[torch.Tensor]] = {}

    def call(i: int) -> None:
        got[i] = [native([xs[i]])[0] for _ in range(5)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for g in got[i]:
            torch.testing.assert_close(g, want[i], atol=1e-4, rtol=1e-4)


def test_inputs_that_are_views_or_outputs_and_the_checked_build(monkeypatch: pytest.MonkeyPatch) -> None:
    class PassThrough(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, y.exp() + x

    x, y = torch.randn(8, 6), torch.randn(6, 8).t()  # y is not contiguous
    compiled = sextant.compile(PassThrough(), (x, y), target="cpu")
    assert isinstance(compiled._executor, NativeRunner)
    a, b = compiled(x, y)
    assert a is not x and torch.equal(a, x)  # an output that is an input is a copy, as in eager's contract
    torch.testing.assert_close(b, y.exp() + x)
    monkeypatch.setenv("SEXTANT_CHECK_RACES", "1")
    checked = sextant.compile(PassThrough(), (x, y), target="cpu")
    assert isinstance(checked._executor, ProgramRunner)  # reports races launch by launch
    torch.testing.assert_close(checked(x, y)[1], y.exp() + x)


def test_profile_times_every_launch_inside_the_executor():
    from sextant.examples import EXAMPLES

    model, args = EXAMPLES["transformer-block"]()
    compiled = sextant.compile(model, args, target="cpu")
    runner = next(v for v in vars(compiled).values() if isinstance(v, NativeRunner))
    want = compiled(*args)
    times = runner.profile(list(args), repeats=3)
    assert len(times) == len(compiled.stages["program"].launches) and all(t >= 0 for t in times) and sum(times) > 0
    torch.testing.assert_close(compiled(*args), want)  # profiling leaves the runner as it was


def test_a_small_forward_runs_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from sextant.examples import EXAMPLES

    monkeypatch.setenv("SEXTANT_CPU_THREADS", "2")
    model, args = EXAMPLES["mlp"]()
    compiled = sextant.compile(model, args, target="cpu")
    runner = next(v for v in vars(compiled).values() if isinstance(v, NativeRunner))
    assert runner.workers == 1 and not any(runner._plan[1 + FIELDS * i + 4] & PARALLEL for i in range(runner._plan[0]))
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), model(*args))
    _, _, big, _ = _runners(monkeypatch, 2)
    assert big.workers == 2  # a 256x512x512 matmul is worth the second thread


def test_a_call_writes_its_buffers_into_slots_bound_once_and_makes_one_packed_call() -> None:
    from sextant.codegen.cpu_module import LaunchError
    from sextant.examples import EXAMPLES

    model, args = EXAMPLES["mlp"]()
    compiled = sextant.compile(model, args, target="cpu")
    runner = compiled._executor
    assert isinstance(runner, NativeRunner)
    a, b = compiled(*args), compiled(*args)
    bound = runner._arenas.get(runner.program.layout())
    assert bound.call is not None and bound.nworkers == 1 and bound.segments is None  # sextant_call, one worker
    assert runner._arenas.get(runner.program.layout()) is bound  # built once per thread and binding
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)  # outputs stay fresh tensors
    with pytest.raises(LaunchError, match="expected a CPU tensor"):  # the slots are never given a short buffer
        runner([torch.randn(4, 64)])
    with pytest.raises(LaunchError, match="expected 1 inputs"):
        runner([])


def test_the_launch_by_launch_runner_binds_a_plain_module_only() -> None:
    from sextant.codegen.cpu_module import LaunchError
    from sextant.examples import EXAMPLES

    model, (x,) = EXAMPLES["mlp"]()
    program = schedule(run_pipeline(sextant.capture(model, (x,))), cpu_target())
    module = compile_kernels(list(program.kernels.values()))
    runner = ProgramRunner(program, module.launch)
    assert runner._module is module  # launches bound once per thread: a call patches input/output pointers
    a, b = runner([x]), runner([x])
    assert a[0].data_ptr() != b[0].data_ptr() and torch.equal(a[0], b[0])
    with torch.no_grad():
        torch.testing.assert_close(a[0], model(x))
    assert torch.equal(a[0], NativeRunner(program, module)([x])[0])
    checked = compile_kernels(list(program.kernels.values()), check_races=True)
    assert ProgramRunner(program, checked.launch)._module is None  # sees every launch, as before
    # a meta tensor stands in for a buffer in bind() only, checked for its dtype and size
    launch = program.launches[0]
    k = program.kernels[launch.kernel]
    stand_ins = [torch.empty(p.size, dtype=p.dtype.torch, device="meta") for p in k.params]
    _, entries = module.bind(k.name, stand_ins)
    assert all(entries[i] is None for i in range(len(k.params)))  # null until the caller writes an address
    with pytest.raises(LaunchError, match="only in bind"):
        module.prepare(k.name, stand_ins)
    with pytest.raises(LaunchError, match="has dtype"):
        module.bind(k.name, [torch.empty(p.size, dtype=torch.float64, device="meta") for p in k.params])


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_an_input_updated_in_place_may_not_overlap_another(target: str) -> None:
    from sextant.codegen.cpu_module import LaunchError

    class UpdatesArgument(nn.Module):
        def forward(self, cache: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            cache.index_copy_(1, pos, k)
            return cache.sum(0)

    cache = torch.zeros(3, 16)
    compiled = sextant.compile(UpdatesArgument(), (cache.clone(), torch.randn(3, 2), torch.tensor([0, 1])),
                               target=target, cache=False)
    with pytest.raises(LaunchError, match="input 0 is updated in place and overlaps input 1"):
        compiled(cache, cache.view(-1)[:6].view(3, 2), torch.tensor([0, 1]))  # the kernels' buffers are distinct


def test_where_the_estimate_splits_the_first_calls_run_both_ways_and_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    from sextant.runtime.native_runner import TRIALS

    model, _, native, _ = _runners(monkeypatch, 2)
    x = torch.randn(256, 512)
    assert native.workers == 2 and native.workers_at([x]) is None  # proposed by the estimate, not decided
    outs = [native([x])[0] for _ in range(2 * TRIALS)]  # alternately on one worker and on two
    assert native.workers_at([x]) in (1, 2)  # the faster, timed
    assert all(torch.equal(o, outs[0]) for o in outs)  # the same blocks either way: bit for bit
    with torch.no_grad():
        torch.testing.assert_close(outs[0], model(x), atol=1e-4, rtol=1e-4)
