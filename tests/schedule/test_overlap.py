"""Collectives in one process: the graph IR's text form and rules, the overlap reordering of the
schedule, and a world-size-1 gloo group that runs the program on every CPU-side target (the
2-rank tests are tests/collectives)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sextant.graph.parser import ParseError, parse_graph
from sextant.graph.printer import print_graph
from sextant.graph.verifier import VerificationError, verify
from sextant.schedule.program import CollectiveCall, schedule
from sextant.schedule.target import cpu_target, gpu_target

# %4 (the all_reduce) does not depend on %6..%7 (another matmul and its exp): they can run while
# the transfer is in flight
TEXT = """graph @tp(%x: f32[8,16], %w1: f32[16,16], %w2: f32[16,16], %w3: f32[16,16]) {
  %0 = matmul(%x, %w1) : f32[8,16]
  %1 = tanh(%0) : f32[8,16]
  %2 = matmul(%1, %w2) : f32[8,16]
  %4 = collective(%2) {group="G", kind="all_reduce", reduce="sum"} : f32[8,16]
  %5 = wait(%4) : f32[8,16]
  %6 = matmul(%x, %w3) : f32[8,16]
  %7 = exp(%6) : f32[8,16]
  %8 = reduce(%7) {axes=[1], fn="sum"} : f32[8,1]
  %9 = expand(%8) {shape=[8,16]} : f32[8,16]
  %10 = mul(%5, %9) : f32[8,16]
  return (%10)
}"""


def _graph(group: str = "G"):
    return parse_graph(TEXT.replace('"G"', f'"{group}"'))


def test_text_form_round_trips():
    g = _graph()
    assert print_graph(parse_graph(print_graph(g))) == print_graph(g)
    gather = parse_graph("""graph @g(%x: f32[3,4]) {
  %0 = collective(%x) {group="0", kind="all_to_all", in_splits=[1,2], out_splits=[2,2,1]} : f32[5,4]
  %1 = wait(%0) : f32[5,4]
  %2 = collective(%1) {group="0", kind="all_gather", ranks=2} : f32[10,4]
  %3 = wait(%2) : f32[10,4]
  return (%3)
}""")
    assert "out_splits=[2,2,1]" in print_graph(gather)


def test_typing_rules_and_verifier():
    with pytest.raises(ParseError, match="not divisible"):
        parse_graph("""graph @g(%x: f32[3,4]) {
  %0 = collective(%x) {group="0", kind="reduce_scatter", ranks=2, reduce="sum"} : f32[1,4]
  return (%0)
}""")
    with pytest.raises(Exception, match="reduce must be one of"):
        parse_graph("""graph @g(%x: f32[4]) {
  %0 = collective(%x) {group="0", kind="all_reduce", reduce="mean"} : f32[4]
  return (%0)
}""")
    early = parse_graph("""graph @g(%x: f32[4]) {
  %0 = collective(%x) {group="0", kind="all_reduce", reduce="sum"} : f32[4]
  %1 = exp(%0) : f32[4]
  %2 = wait(%0) : f32[4]
  return (%1, %2)
}""")
    with pytest.raises(VerificationError, match="reads a collective's value before its wait"):
        verify(early)


@pytest.mark.parametrize("target", [cpu_target(), gpu_target("sm_90")], ids=["cpu", "sm_90"])
def test_independent_kernels_run_while_the_transfer_is_in_flight(target):
    p = schedule(_graph(), target)
    kinds = [la.extern.stage if isinstance(la.extern, CollectiveCall) else "kernel" for la in p.launches]
    start, wait = kinds.index("start"), kinds.index("wait")
    assert kinds[:start] == ["kernel", "kernel"]  # the two matmuls that compute the operand
    # the independent matmul (exp fused) runs in between; the reduction fuses the product with the
    # collective's value, so it waits
    assert wait - start == 2
    assert p.launches[start].args == p.launches[wait].args  # the operand and result, kept alive to the wait
    dump = p.describe()
    assert "collective_0     collective  host call    [all_reduce group=G reduce=sum]" in dump
    assert "collective_0 (all_reduce at ?): in flight over 1 kernel launch" in dump


def test_no_collective_no_reordering():
    text = TEXT.replace('  %4 = collective(%2) {group="G", kind="all_reduce", reduce="sum"} : f32[8,16]\n', "")
    text = text.replace("%5 = wait(%4)", "%5 = exp(%2)")
    p = schedule(parse_graph(text), cpu_target())
    assert all(la.extern is None for la in p.launches)


@pytest.fixture
def world_of_one(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("target", ["reference", "cpu", "cuda-sim"])
def test_program_runs_on_a_world_of_one(world_of_one, target):
    import sextant

    g = _graph(world_of_one)
    x, w1, w2, w3 = torch.randn(8, 16) * 0.3, *(torch.randn(16, 16) * 0.3 for _ in range(3))
    want = (torch.tanh(x @ w1) @ w2) * torch.exp(x @ w3).sum(1, keepdim=True)
    compiled = sextant.compile_graph(g, target=target)  # a parsed graph: its executor takes the inputs' list
    for _ in range(2):
        torch.testing.assert_close(compiled._executor([x, w1, w2, w3])[0], want, rtol=1e-4, atol=1e-4)


def test_without_a_process_group_the_error_says_so():
    import sextant
    from sextant.runtime.collectives import CollectiveError

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    compiled = sextant.compile_graph(_graph(), target="cpu")
    with pytest.raises(CollectiveError, match="not initialised"):
        compiled._executor([torch.randn(8, 16), *(torch.randn(16, 16) for _ in range(3))])


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_symbolic_batch_through_all_reduce_gather_and_scatter(world_of_one, target):
    """One program over a symbolic batch: the collectives' buffers are sized per call."""
    import torch.distributed._functional_collectives as funcol
    from torch.export import Dim

    import sextant

    class Sharded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = funcol.all_reduce(self.fc(x), "sum", dist.group.WORLD)
            z = funcol.all_gather_tensor(y, 0, dist.group.WORLD)
            return funcol.reduce_scatter_tensor(z * 2, "sum", 0, dist.group.WORLD) + 1

    m = Sharded()
    compiled = sextant.compile(m, (torch.randn(5, 16),), dynamic_shapes={"x": {0: Dim("b", max=64)}}, target=target)
    assert "per_binding" not in compiled.stages  # one program for every batch
    for n in (3, 7):
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)


def test_coalesced_forms_become_one_collective_per_tensor(world_of_one):
    import torch.distributed._functional_collectives as funcol

    import sextant

    class Coalesced(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            g = dist.group.WORLD
            x, y = funcol.all_reduce_coalesced([a.sin(), b.cos()], "sum", g)
            p, q = funcol.all_gather_into_tensor_coalesced([x, y], g)
            r, s = funcol.reduce_scatter_tensor_coalesced([p * 2, q], "sum", [0, 0], g)
            return r + s

    a, b = torch.randn(4, 3), torch.randn(4, 3)
    compiled = sextant.compile(Coalesced(), (a, b))
    torch.testing.assert_close(compiled(a, b), a.sin() * 2 + b.cos())
    kinds = [la.extern.kind for la in compiled.stages["program"].launches
             if isinstance(la.extern, CollectiveCall) and la.extern.stage == "start"]
    assert kinds == ["all_reduce", "all_reduce", "all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]


def test_report_renders_a_program_with_collectives():
    import sextant
    from sextant.report.html import render_report

    html = render_report(sextant.compile_graph(_graph(), target="cuda-sim"))  # compiles without a process group
    assert "collective_0" in html and "wait_0" in html
