"""GPU mappings (``schedule(graph, sm90_target())``) run through the SIMT CPU lowering — the
"cuda-sim" target: the kernels a GPU would get, with many threads per block, barriers and warp
reductions executed faithfully on the host — against eager PyTorch and the reference executor."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sextant
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.examples import EXAMPLES
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node
from sextant.graph.passes import run_pipeline
from sextant.graph.reference import run_graph
from sextant.kernel.ir import Barrier, If, Kernel, Stmt, WarpReduce
from sextant.runtime.program_runner import ProgramRunner
from sextant.schedule import gpu_kernels
from sextant.schedule.program import Program, schedule
from sextant.schedule.target import cpu_target, sm90_target

try:  # the kernel verifier proves loads/stores in bounds and barriers/warp reductions well placed
    from sextant.kernel.verifier import verify_kernel
except ImportError:  # pragma: no cover
    verify_kernel = None

HALF = [DType.f16, DType.bf16]


def _run_gpu(graph: Graph) -> tuple[Program, ProgramRunner]:
    program = schedule(graph, sm90_target())
    return program, ProgramRunner(program, compile_kernels(list(program.kernels.values())).launch)


def _stmts(body: tuple[Stmt, ...]) -> list[Stmt]:
    out: list[Stmt] = []
    for s in body:
        out.append(s)
        if isinstance(s, If):
            out += _stmts(s.then) + _stmts(s.orelse)
        elif hasattr(s, "body"):
            out += _stmts(s.body)
    return out


def _has(kernel: Kernel, kind: type) -> bool:
    return any(isinstance(s, kind) for s in _stmts(kernel.body))


def _kinds(program: Program) -> list[str]:
    return [program.groups[launch.group].kind for launch in program.launches]


def _check_structure(program: Program) -> None:
    """Fusion of the anchors (reductions, matmuls, convolutions) is target-independent but for
    attention, which the GPU fuses only for tensor cores (the CPU
    stores a convolution's zero-padded input, which may take over an elementwise kernel's store;
    the GPU pads in shared memory); every launch has multi-thread blocks; reductions
    cooperate through warp shuffles (and shared memory + barriers for long rows); matmuls
    stage tiles in shared memory between barriers; every kernel passes the verifier."""
    cpu = schedule(program.graph, cpu_target())

    def anchors(p: Program) -> list[str]:  # attention counted as its three unfused kernels: the GPU
        out: list[str] = []                # fuses only what its tensor-core kernel computes
        for k in _kinds(p):
            out += ["matmul", "reduce", "matmul"] if k == "attention" else [] if k == "elementwise" else [k]
        return out

    assert anchors(program) == anchors(cpu)
    for launch in program.launches:
        k = program.kernels[launch.kernel]
        if verify_kernel is not None:
            verify_kernel(k)
        kind = program.groups[launch.group].kind
        assert k.threads_per_block >= 32 and k.threads_per_block % 32 == 0 and k.threads_per_block <= 1024
        assert sum(b.size * b.dtype.itemsize for b in k.shared) <= 48 * 1024
        if kind == "reduce" and k.meta["mapping"] == "block-per-row":
            assert _has(k, WarpReduce) and _has(k, Barrier) and k.shared
        elif kind == "reduce" and k.block[0] > 1:
            assert _has(k, WarpReduce) and not _has(k, Barrier)
        elif kind == "matmul":
            assert _has(k, Barrier) and {b.name for b in k.shared} == {"As", "Bs"} and k.local


def _fresh(args: tuple) -> tuple:
    return tuple(torch.randn_like(a) if a.dtype.is_floating_point else torch.randint_like(a, 0, int(a.max()) + 1)
                 for a in args)


# -- example models vs eager --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_models_match_eager(name: str) -> None:
    model, args = EXAMPLES[name]()
    graph = run_pipeline(sextant.capture(model, args))
    program, run = _run_gpu(graph)
    _check_structure(program)
    if name in ("transformer-block", "gpt2"):
        reduce_maps = {program.kernels[launch.kernel].meta["mapping"] for launch in program.launches
                       if program.groups[launch.group].kind == "reduce"}
        assert reduce_maps == {"warp-per-row"}
    for x in (args, _fresh(args)):
        with torch.no_grad():
            expected = model(*x)
        torch.testing.assert_close(run(list(x))[0], expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_transformer_block(dtype: torch.dtype) -> None:
    model, (x,) = EXAMPLES["transformer-block"]()
    model, x = model.to(dtype), x.to(dtype)
    program, run = _run_gpu(run_pipeline(sextant.capture(model, (x,))))
    for k in program.kernels.values():  # half inputs are accumulated in f32
        if k.meta.get("mapping") == "tensor-core":  # tiles stay half, the MMA accumulates in f32
            assert {b.dtype for b in k.shared} == {DType.from_torch(dtype)}
            assert k.buffer("acc").dtype == DType.f32
        elif k.meta.get("mapping") == "flash-attention-tensor-core":  # both products too
            assert {b.dtype for b in k.shared} == {DType.from_torch(dtype)}
            assert k.buffer("sacc").dtype == k.buffer("oacc").dtype == DType.f32
        elif k.shared:
            assert {b.dtype for b in k.shared} == {DType.f32}
    half = [launch for launch in program.launches if program.groups[launch.group].kind == "matmul"
            and program.groups[launch.group].anchor.inputs[0].dtype == DType.from_torch(dtype)]
    assert len(half) == 4  # the projections and the MLP
    assert {program.kernels[launch.kernel].meta["mapping"] for launch in half} == {"tensor-core"}
    attention = [program.kernels[launch.kernel].meta["mapping"] for launch in program.launches
                 if program.groups[launch.group].kind == "attention"]
    assert attention == ["flash-attention-tensor-core"]  # QKᵀ, mask, softmax and PV in one kernel
    fresh = torch.randn_like(x)
    with torch.no_grad():
        expected = model(fresh).float()
    torch.testing.assert_close(run([fresh])[0].float(), expected, rtol=3e-2, atol=3e-2)


# -- ragged sizes vs the reference executor --------------------------------------------------------------
def _check_vs_reference(graph: Graph, *, dtype: DType = DType.f32, seed: int = 0) -> Program:
    program, run = _run_gpu(graph)
    _check_structure(program)
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(n.shape, generator=gen).to(n.dtype.torch) if n.dtype.is_float
              else torch.randint(-50, 50, n.shape, generator=gen).to(n.dtype.torch) for n in graph.inputs]
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == DType.f32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(run(inputs), run_graph(graph, inputs), strict=True):
        torch.testing.assert_close(got, want, **tol)
    return program


def _norms(b: GraphBuilder, x: Node) -> list[Node]:
    """softmax(x), LayerNorm(x) and the row mean (a row-shaped output) over the last axis."""
    n = x.shape[-1]
    e = b.unary("exp", b.sub(x, b.expand(b.reduce("max", x, [-1]), x.shape)))
    softmax = b.div(e, b.expand(b.reduce("sum", e, [-1]), x.shape))
    mean = b.mean(x, [-1])
    d = b.sub(x, b.expand(mean, x.shape))
    var = b.div(b.reduce("sum", b.mul(d, d), [-1]), float(n))
    ln = b.mul(d, b.expand(b.unary("rsqrt", b.add(var, 1e-5)), x.shape))
    return [softmax, ln, b.add(mean, 1.0)]


@pytest.mark.parametrize(("rows", "n", "mapping"), [
    (7, 1, "warp-per-row"),  # one lane a row
    (7, 5, "warp-per-row"),  # 8 lanes a row, 4 rows a warp; rows past the end clamped
    (1100, 33, "warp-per-row"),  # 8 rows a block, ragged last block
    (6, 1000, "warp-per-row"),  # the longest short row: 1000 = 31.25 warps
    (3, 1025, "block-per-row"),
    (2, 5000, "block-per-row"),
])
def test_ragged_reductions(rows: int, n: int, mapping: str) -> None:
    b = GraphBuilder("norms")
    x = b.input("x", (rows, n), DType.f32)
    program = _check_vs_reference(run_pipeline(b.build(_norms(b, x))))
    maps = {k.meta["mapping"] for k in program.kernels.values()}
    assert maps == {mapping}
    if n > 1:
        assert all(_has(k, WarpReduce) for k in program.kernels.values())
    for launch in program.launches:  # a race the sequential CPU run cannot see: count the barriers
        k = program.kernels[launch.kernel]
        if mapping == "block-per-row":  # partials written | first warp combines | result read
            n_reduce = sum(m.op == "reduce" for m in program.groups[launch.group].members)
            assert sum(isinstance(s, Barrier) for s in _stmts(k.body)) == 2 * n_reduce


@pytest.mark.parametrize("n", [40, 3000])
@pytest.mark.parametrize("dtype", HALF)
def test_half_reductions_accumulate_in_f32(n: int, dtype: DType) -> None:
    b = GraphBuilder("norms")
    x = b.input("x", (3, n), dtype)
    _check_vs_reference(run_pipeline(b.build(_norms(b, x))), dtype=dtype)


def test_reductions_over_outer_and_several_axes() -> None:
    b = GraphBuilder("axes")
    x = b.input("x", (4, 37, 3), DType.f32)
    i = b.input("i", (5, 70), DType.i64)
    outs = [b.reduce("sum", x, [1]), b.reduce("max", x, [0, 2]), b.reduce("min", x, [0, 1, 2]),
            b.reduce("max", i, [1]), b.reduce("sum", i, [0]), b.reduce("max", b.binary("gt", i, 40), [1])]
    _check_vs_reference(run_pipeline(b.build(outs)))


@pytest.mark.parametrize(("batch", "m", "n", "k"), [
    ((), 37, 45, 29),  # ragged in every dimension, a single tile
    ((), 65, 130, 70),  # several tiles, ragged edges in M, N and the K loop
    ((), 64, 128, 32),  # exact tiles: no guards
    ((), 1, 3, 1),
    ((3,), 20, 17, 33),  # batch dims in grid z
    ((2, 2), 9, 70, 5),
])
def test_ragged_matmul_with_epilogue(batch: tuple[int, ...], m: int, n: int, k: int) -> None:
    b = GraphBuilder("mm")
    a = b.input("a", (*batch, m, k), DType.f32)
    w = b.input("w", (*batch, k, n), DType.f32)
    bias = b.input("bias", (n,), DType.f32)
    y = b.matmul(a, w)
    out = b.unary("tanh", b.add(y, b.expand(b.reshape(bias, (1,) * (len(batch) + 1) + (n,)), y.shape)))
    program = _check_vs_reference(run_pipeline(b.build([out])))
    (kernel,) = program.kernels.values()
    guards = m % 64 or n % 64 or k % 16
    assert _has(kernel, If) == bool(guards)
    assert kernel.grid == (math.ceil(n / 64), math.ceil(m / 64), math.prod(batch))


@pytest.mark.parametrize("dtype", HALF)
def test_half_matmul(dtype: DType) -> None:
    b = GraphBuilder("mm")
    a = b.input("a", (2, 33, 40), dtype)
    w = b.input("w", (2, 40, 70), dtype)
    _check_vs_reference(run_pipeline(b.build([b.mul(b.matmul(a, w), 0.5)])), dtype=dtype)


def test_matmul_batch_folded_into_grid_x(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_kernels, "MAX_GRID_YZ", 2)
    b = GraphBuilder("mm")
    a = b.input("a", (5, 70, 20), DType.f32)
    w = b.input("w", (5, 20, 9), DType.f32)
    program = _check_vs_reference(run_pipeline(b.build([b.matmul(a, w)])))
    (kernel,) = program.kernels.values()
    assert kernel.grid == (1 * 2 * 5, 1, 1)


def test_ragged_elementwise() -> None:
    b = GraphBuilder("ew")
    x = b.input("x", (7, 13, 11), DType.f32)
    y = b.input("y", (11,), DType.f32)
    s = b.input("s", (), DType.f32)
    z = b.mul(b.unary("exp", b.permute(x, (2, 0, 1))), b.expand(b.reshape(y, (11, 1, 1)), (11, 7, 13)))
    program = _check_vs_reference(run_pipeline(b.build([z, b.add(s, 1.0)])))
    blocks = sorted(k.block[0] for k in program.kernels.values())
    assert blocks == [32, 256]  # a scalar output gets one warp


@pytest.mark.parametrize(("shape", "dtype", "width"), [
    ((512, 384), torch.float32, 4),  # 49152 vectors of 4 floats: enough blocks for every SM
    ((1024, 512), torch.float16, 8),  # 8 halves = 128 bits
    ((512, 382), torch.float32, 1),  # a row is not a whole number of vectors: one element a thread
    ((16, 384), torch.float32, 1),  # too small: one element a thread keeps more SMs busy
])
def test_elementwise_vectorised_128_bit(shape: tuple[int, int], dtype: torch.dtype, width: int) -> None:
    """Large elementwise kernels give each thread one 128-bit vector of the output; the loads of a
    thread's elements are adjacent, so NVPTX emits ``ld/st.global.v4``; results match eager."""
    from sextant.schedule.gpu_kernels import gpu_elementwise_kernel  # noqa: F401  (the mapping under test)

    class GeluBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(shape[-1]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(x) * 2.0 + self.bias

    torch.manual_seed(1)
    model = GeluBias().to(dtype)
    compiled = sextant.compile(model, (torch.randn(shape, dtype=dtype),), target="cuda-sim")
    (kernel,) = compiled.stages["program"].kernels.values()
    assert kernel.meta["vector"] == width
    assert kernel.threads_per_block * kernel.num_blocks * width >= shape[0] * shape[1]
    memory_ops = {line.split()[0] for line in compiled.stages["ptx"].ptx.splitlines() if ".global" in line}
    vector = {"ld.global.v4.b32", "st.global.v4.b32"}
    assert vector <= memory_ops if width > 1 else not vector & memory_ops
    x = torch.randn(shape, dtype=dtype)
    torch.testing.assert_close(compiled(x).float(), model.float()(x.float()).detach(),
                               **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x)) * 2.0


def test_ragged_conv() -> None:
    torch.manual_seed(0)
    model, x = _ConvNet().eval(), torch.randn(2, 4, 9, 11)
    program = _check_vs_reference(run_pipeline(sextant.capture(model, (x,))))
    (kernel,) = program.kernels.values()
    assert kernel.meta["mapping"] == "thread-per-element" and kernel.block == (256, 1, 1)
    assert _has(kernel, If)  # 2*6*5*6 = 360 outputs: the last block is guarded
