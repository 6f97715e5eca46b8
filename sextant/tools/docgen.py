"""Regenerate the tool output quoted in README.md and docs/*.md, so the docs cannot rot.

Docs mark generated blocks like this::

    <!-- sextant:begin mlp-captured -->
    ```
    ...output...
    ```
    <!-- sextant:end -->

``python -m sextant.tools.docgen`` rewrites every block from the current code;
``--check`` exits 1 (listing the stale blocks) instead of writing — a test runs that.
Only deterministic output is generated (no timings).
"""

from __future__ import annotations

import argparse
import functools
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import sextant
from sextant.examples import EXAMPLES, Regressor, TinyBlock
from sextant.graph.passes import run_pipeline, trace_pipeline
from sextant.schedule.target import cpu_target

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the CPU the docs' schedules are shown for, fixed so the docs do not depend on the machine
# that regenerates them: 2 cores with AVX2, no bf16 dot product (the CPU target otherwise detects the host's)
DOCS_CPU = cpu_target(cores=2, vector_bytes=32, pair_dot=False)
_BLOCK = re.compile(r"(<!-- sextant:begin (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- sextant:end -->)", re.S)


class Unsupported(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ranks = torch.argsort(x, dim=-1, stable=True)
        return x.cummax(dim=-1).values + torch.fft.rfft(x).abs().sum() + ranks


def _tiny() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return TinyBlock().eval(), (torch.randn(6, 32),)


def _relative(text: str) -> str:
    return text.replace(str(ROOT) + "/", "")


def snippet_tiny_captured() -> str:
    return str(sextant.capture(*_tiny()))


def snippet_tiny_optimised() -> str:
    return str(run_pipeline(sextant.capture(*_tiny())))


def snippet_tiny_print_after_all() -> str:
    buf = io.StringIO()
    run_pipeline(sextant.capture(*_tiny()), ["simplify", "constant_fold", "cse", "dce"], print_after_all=True,
                 stream=buf)
    return buf.getvalue().rstrip()


def snippet_mlp_optimised() -> str:
    model, args = EXAMPLES["mlp"]()
    return str(run_pipeline(sextant.capture(model, args)))


def _trace_table(name: str) -> str:
    model, args = EXAMPLES[name]()
    graph = sextant.capture(model, args)
    lines = [f"{'pass':<16}{'nodes before':>14}{'nodes after':>13}"]
    for r in trace_pipeline(graph):
        if r.changed:
            lines.append(f"{r.name:<16}{r.nodes_before:>14}{r.nodes_after:>13}")
    return "\n".join(lines)


def snippet_gpt2_passes() -> str:
    return _trace_table("gpt2")


def snippet_gpt2_ops() -> str:
    model, args = EXAMPLES["gpt2"]()
    captured = sextant.capture(model, args)
    final = run_pipeline(captured)
    a, b = captured.op_counts(), final.op_counts()
    lines = [f"{'op':<12}{'captured':>10}{'optimised':>11}"]
    for op in sorted(set(a) | set(b), key=lambda o: (-a.get(o, 0), o)):
        lines.append(f"{op:<12}{a.get(op, 0):>10}{b.get(op, 0):>11}")
    lines.append(f"{'total':<12}{sum(a.values()):>10}{sum(b.values()):>11}")
    return "\n".join(lines)


@functools.cache
def _row_scale_op() -> Callable[..., torch.Tensor]:
    """A ``torch.library`` custom op with a CPU kernel only, as a user's library would define one."""

    @torch.library.custom_op("sextant_docs::row_scale", mutates_args=())
    def row_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * (torch.arange(x.shape[0], dtype=x.dtype)[:, None] + factor)

    @row_scale.register_fake
    def _(x: torch.Tensor, factor: float) -> torch.Tensor:
        return torch.empty_like(x)

    return torch.ops.sextant_docs.row_scale


class WithExtern(nn.Module):
    """A custom op and ``cummax``: neither has a lowering, so both run as extern calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _row_scale_op()(self.fc(x).relu(), 0.5)
        return h.cummax(dim=0).values + x


@functools.cache
def _extern_module() -> sextant.CompiledModule:
    torch.manual_seed(0)
    model, x = WithExtern().eval(), torch.randn(8, 16)
    compiled = sextant.compile(model, (x,), target="cpu", cache=False)
    torch.testing.assert_close(compiled(x), model(x))
    return compiled


def snippet_extern_graph() -> str:
    return str(_extern_module().graph)


def snippet_extern_schedule() -> str:
    return _extern_module().stages["program"].describe()


def snippet_unsupported_error() -> str:
    try:
        sextant.capture(Unsupported(), (torch.randn(4, 8),), strict=True)
    except sextant.UnsupportedOpError as e:
        return _relative(str(e))
    raise AssertionError("expected UnsupportedOpError")


def _onnx_glue_model():
    """MatMul + bias + Relu, Reshape to the shape Shape → Gather → Concat computes, Softmax: the glue
    ONNX exporters emit, which the import folds at compile time."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
             helper.make_node("Add", ["m", "b"], ["a"], name="fc_bias"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Shape", ["r"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="batch"),
             helper.make_node("Concat", ["n", "split"], ["newshape"], axis=0, name="newshape"),
             helper.make_node("Reshape", ["r", "newshape"], ["r3"], name="heads"),
             helper.make_node("Softmax", ["r3"], ["y"], axis=-1, name="softmax")]
    inits = {"w": rng.standard_normal((16, 32)).astype(np.float32), "b": np.zeros(32, np.float32),
             "zero": np.array([0], np.int64), "split": np.array([4, 8], np.int64)}
    graph = helper.make_graph(nodes, "glue", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4, 8])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def snippet_onnx_imported() -> str:
    from sextant.frontend.onnx import import_onnx

    return str(import_onnx(_onnx_glue_model()))


def snippet_onnx_optimised() -> str:
    return str(sextant.compile_onnx(_onnx_glue_model(), target="reference").graph)


def snippet_onnx_unsupported_error() -> str:
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok"),
             helper.make_node("NoSuchOp", ["a"], ["b"], name="first_bad"),
             helper.make_node("Fancy", ["x"], ["c"], domain="com.example", name="custom"),
             helper.make_node("Reshape", ["x", "shape"], ["r"], name="dynamic_reshape"),
             helper.make_node("Add", ["c", "c"], ["y"], name="downstream")]
    vi = lambda n, s, t=TensorProto.FLOAT: helper.make_tensor_value_info(n, t, s)
    graph = helper.make_graph(nodes, "bad", [vi("x", [4]), vi("shape", [1], TensorProto.INT64)], [vi("y", [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.example", 1)])
    try:
        sextant.compile_onnx(model)
    except sextant.UnsupportedOpError as e:
        return str(e)
    raise AssertionError("expected UnsupportedOpError")


def _tiny_program():
    from sextant.schedule.program import schedule

    return schedule(run_pipeline(sextant.capture(*_tiny())), DOCS_CPU)


def snippet_tiny_schedule() -> str:
    return _tiny_program().describe()


def snippet_tiny_kernels() -> str:
    from sextant.kernel.printer import print_kernel

    return "\n\n".join(print_kernel(k) for k in _tiny_program().kernels.values())


def snippet_tiny_llvm() -> str:
    from sextant.codegen import emit_module

    program = _tiny_program()
    text = str(emit_module([next(iter(program.kernels.values()))], vector_bytes=DOCS_CPU.vector_bytes))
    lines = text[text.index("define"):].splitlines()
    return "\n".join(lines[:72] + ["  ..."])


def snippet_gpt2_schedule() -> str:
    from sextant.schedule.program import schedule

    model, args = EXAMPLES["gpt2"]()
    return schedule(run_pipeline(sextant.capture(model, args)), DOCS_CPU).describe()


@functools.cache
def _tiny_gpu() -> sextant.CompiledModule:
    return sextant.compile(*_tiny(), target="cuda-sim", arch="sm_90", cache=False)


def snippet_tiny_gpu_schedule() -> str:
    return _tiny_gpu().stages["program"].describe()


def snippet_tiny_gpu_kernel() -> str:
    from sextant.kernel.printer import print_kernel

    return print_kernel(_tiny_gpu().stages["program"].kernels["reduce_0"])


def snippet_tiny_ptx() -> str:
    """The LayerNorm kernel's whole PTX entry (warp-per-row: two shuffle butterflies)."""
    from sextant.codegen.llvm_nvptx import ptx_entries

    return ptx_entries(_tiny_gpu().stages["ptx"].ptx)["reduce_0"]


def snippet_tiny_ptx_excerpt() -> str:
    """A short look at the LayerNorm's PTX for the README: the head and the first butterfly."""
    lines = snippet_tiny_ptx().splitlines()
    shfl = next(i for i, line in enumerate(lines) if "shfl.sync.bfly" in line)
    return "\n".join([*lines[:8], "\t...", *lines[shfl - 4:shfl + 11], "\t..."])


def snippet_tiny_captured_head() -> str:
    lines = snippet_tiny_captured().splitlines()
    return "\n".join([*lines[:10], "  ...", *lines[-3:]])


def snippet_tiny_ptxas() -> str:
    log = _tiny_gpu().stages["ptxas"].log.strip().splitlines()
    return "\n".join(line for line in log if "Compile time" not in line)  # the rest is deterministic


@functools.cache
def _gpt2_gpu_program():  # the built-in GPT-2 example, scheduled for sm_90 (no PTX needed)
    from sextant.schedule.program import schedule
    from sextant.schedule.target import gpu_target

    model, args = EXAMPLES["gpt2"]()
    return schedule(run_pipeline(sextant.capture(model, args)), gpu_target("sm_90"))


def snippet_gpt2_roofline() -> str:
    """Where the predicted H100 time of the GPT-2 example goes (the report's summary, as text)."""
    from sextant.report.cost import program_costs
    from sextant.report.roofline import estimate, kernel_totals, time_by_bound

    program = _gpt2_gpu_program()
    costs = program_costs(program)
    ests = [estimate(c, "H100") for c in costs]
    total = sum(e.time_s for e in ests)
    lines = [f"{len(program.launches)} launches of {len(program.kernels)} unique kernels, "
             f"{sum(c.flops for c in costs) / 1e6:.1f} MFLOP, {sum(c.bytes for c in costs) / 1e6:.2f} MB minimum "
             f"traffic, {total * 1e6:.1f} us predicted on H100",
             "", f"{'kind of time':<18}{'predicted':>12}{'share':>8}"]
    lines += [f"{k:<18}{v * 1e6:>9.2f} us{v / total:>8.1%}" for k, v in time_by_bound(ests).items()]
    head = f"{'kernel':<12}{'kind':<8}{'launches':>9}{'MFLOP':>8}{'min kB':>8}{'predicted':>12}{'share':>8}  bound"
    lines += ["", head]
    for r in kernel_totals(ests):
        lines.append(f"{r.kernel:<12}{r.kind:<8}{r.launches:>9}{r.flops / 1e6:>8.2f}{r.bytes / 1e3:>8.1f}"
                     f"{r.time_s * 1e6:>9.2f} us{r.share:>8.1%}  {r.bound}")
    return "\n".join(lines)


def snippet_tiny_launch_plan() -> str:
    """The CUDA runtime's launch plan for the docs' TinyBlock: what the CUDA graph is built from."""
    from sextant.runtime.cuda_graph import plan

    program = _tiny_gpu().stages["program"]
    p = plan(program)
    kinds = {b.index: f"{b.kind}{b.index}" for b in program.buffers}
    lines = []
    for spec in p.launches:
        deps = ", ".join(f"#{d}" for d in p.deps[spec.index]) or "-"
        args = ", ".join(kinds[a] for a in spec.args)
        lines.append(f"#{spec.index} {spec.kernel:<10} grid={spec.grid} block={spec.block} "
                     f"params=({args}) after {deps}")
    rebound = [f"{kinds[b]} -> " + ", ".join(f"#{li} param {slot}" for li, slot in uses)
               for b, uses in sorted(p.bindings.items())]
    lines.append("rebound per call: " + "; ".join(rebound))
    return "\n".join(lines)


@functools.cache
def _tc_gpu() -> sextant.CompiledModule:
    """An f16 MLP block (256 tokens, 256 → 128 → 256) for sm_90: its two matmuls run on tensor cores,
    the first with a K loop of 8 tiles (deep enough to show the pipeline)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256)).half()
    return sextant.compile(model, (torch.randn(256, 256).half(),), target="cuda-sim", arch="sm_90", cache=False)


def _tc_kernel() -> tuple[str, object]:
    program = _tc_gpu().stages["program"]
    name = next(n for n, k in program.kernels.items() if k.meta.get("mapping") == "tensor-core")
    return name, program.kernels[name]


def snippet_tc_kernel_excerpt() -> str:
    """The tensor-core GEMM's K loop in kernel IR: tile loads, ldmatrix, the MMA loop nest."""
    from sextant.kernel.printer import print_kernel

    lines = print_kernel(_tc_kernel()[1]).splitlines()
    head = lines[:lines.index("{")]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for (kt"))
    first_ldm = next(i for i, line in enumerate(lines) if "ldmatrix" in line)
    mma = next(i for i, line in enumerate(lines) if "mma_m16n8k16" in line)
    return "\n".join([*head, "{", "  ...", *lines[start:start + 4], "    ...", *lines[first_ldm - 1:first_ldm + 4],
                      "    ...", *lines[mma - 4:mma + 4], "  ..."])


def snippet_tc_ptx_excerpt() -> str:
    """ldmatrix and mma.sync in the PTX of the same kernel."""
    from sextant.codegen.llvm_nvptx import ptx_entries

    name, _ = _tc_kernel()
    lines = ptx_entries(_tc_gpu().stages["ptx"].ptx)[name].splitlines()
    ldm = next(i for i, line in enumerate(lines) if "ldmatrix" in line)
    mma = next(i for i, line in enumerate(lines) if "mma.sync" in line)
    return "\n".join([*lines[ldm - 2:ldm + 4], "\t...", *lines[mma:mma + 6], "\t..."])


def snippet_tc_sass_excerpt() -> str:
    """LDSM and HMMA in the SASS ptxas made of it (nvdisasm, from the dev extra's wheel)."""
    from sextant.codegen.sass import disassemble, find_disassembler, split_sass

    name, _ = _tc_kernel()
    tool = find_disassembler()
    if tool is None:
        raise RuntimeError("docgen needs nvdisasm for the SASS excerpt (pip install nvidia-cuda-nvdisasm)")
    sass = split_sass(disassemble(_tc_gpu().stages["ptxas"].cubin, tool), [name])[name]
    lines = [line.strip() for line in sass.splitlines() if "/*" in line and ("LDSM" in line or "HMMA" in line)]
    return "\n".join(re.sub(r"\s+", " ", line).split(" ;")[0] + " ;" for line in lines[:10]) + "\n..."


def snippet_tc_ptxas() -> str:
    name, _ = _tc_kernel()
    log = _tc_gpu().stages["ptxas"].log.strip().splitlines()
    start = next(i for i, line in enumerate(log) if f"'{name}'" in line)
    return "\n".join(line for line in log[start:start + 4] if "Compile time" not in line)


def snippet_tc_counters() -> str:
    """cuda-sim's counters for the same f16 MLP (``sextant explain --counters`` prints these lines)."""
    from sextant.runtime.counting import count_program

    cm = _tc_gpu()
    program = cm.stages["program"]
    torch.manual_seed(0)
    counted = count_program(program, [torch.randn(256, 256).half()])
    return "\n".join(f"{name} [{program.kernels[name].meta['mapping']}]: {c.summary()}" for name, c in counted.items())


def snippet_tile_ranking() -> str:
    """The tensor-core tile choice's estimates for a few familiar f16 problem shapes on sm_90."""
    from sextant.schedule.gpu_mma import rank_tiles
    from sextant.schedule.target import gpu_target

    lines = []
    for m, n, what in ((4096, 4096, "4096² product"), (4096, 2304, "GPT-2 QKV, batch 8 × 512"),
                       (1024, 1024, "1024² product"), (512, 768, "GPT-2 projection, batch 1 × 512")):
        ranked = rank_tiles(m, n, 1, gpu_target("sm_90"))
        cells = [f"{t.bm}x{t.bn}: {e.blocks} blocks, {e.occupancy}/SM, {e.waves} wave(s), "
                 f"{e.seconds * 1024 * 1e6:.1f} us" for e, t in ranked]
        lines.append(f"{m}x{n} ({what}) -> {ranked[0][1].bm}x{ranked[0][1].bn}\n    " + "\n    ".join(cells))
    return "\n".join(lines)


def snippet_splitk_schedule() -> str:
    """A decode step's f16 MLP (16 tokens, 256 → 1024 → 256) for sm_90: the down projection's 4
    tiles split K; the schedule dump with ptxas's figures, then cuda-sim's counters."""
    from sextant.runtime.counting import count_program

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).half()
    x = torch.randn(16, 256).half()
    program = sextant.compile(model, (x,), target="cuda-sim", arch="sm_90", cache=False).stages["program"]
    counted = count_program(program, [x])
    return program.describe() + "\n\n" + "\n".join(
        f"{name} [{program.kernels[name].meta['mapping']}]: {c.summary()}" for name, c in counted.items())


class _CausalAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class _AttentionWithWeights(nn.Module):
    """Returns the probabilities too: the chain cannot be fused (the dump says why)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
        return p @ v, p


def _fa_inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(1, 2, 128, 64).half() for _ in range(3))


@functools.cache
def _fa_program():
    """Causal f16 attention with GPT-2-small's head size (2 heads × 128 tokens × 64) for sm_90."""
    from sextant.schedule.program import schedule
    from sextant.schedule.target import gpu_target

    return schedule(run_pipeline(sextant.capture(_CausalAttention(), _fa_inputs())), gpu_target("sm_90"))


def snippet_fa_kernel_excerpt() -> str:
    """The flash kernel's online softmax in kernel IR: the row max over the quad, the rescale,
    P kept in place as the A fragments of P·V."""
    from sextant.kernel.printer import print_kernel

    lines = print_kernel(next(iter(_fa_program().kernels.values()))).splitlines()
    head = lines[:lines.index("{")]
    loop = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for (j0"))
    cp = next(i for i, line in enumerate(lines) if i > loop and "cp_async" in line)
    mma = next(i for i, line in enumerate(lines) if "mma_m16n8k16(&sacc" in line)
    red = next(i for i, line in enumerate(lines) if "warp_max" in line)
    p = next(i for i, line in enumerate(lines) if "fp[0] =" in line)
    pv = next(i for i, line in enumerate(lines) if "mma_m16n8k16(&oacc" in line)
    return "\n".join([*head, "{", "  ...", *lines[loop:loop + 2], *lines[cp:cp + 1], "    ...",
                      *lines[mma - 1:mma + 2], "    ...", *lines[red:red + 6], "    ...", *lines[p - 2:p + 1],
                      "    ...", *lines[pv - 3:pv + 2], "  ..."])


def snippet_fa_ptxas() -> str:
    """ptxas's figures for the flash kernel, and the SASS instruction mix nvdisasm shows."""
    from sextant.codegen.llvm_nvptx import emit_ptx
    from sextant.codegen.ptxas import assemble
    from sextant.codegen.sass import disassemble, find_disassembler

    kernels = list(_fa_program().kernels.values())
    res = assemble(emit_ptx(kernels, arch="sm_90").ptx, "sm_90")
    r = res.kernels[kernels[0].name]
    out = [f"{r.name}: {r.registers} registers, {r.shared_bytes} B shared, {r.spill_stores} B spill stores, "
           f"{r.spill_loads} B spill loads"]
    tool = find_disassembler()
    if tool is None:
        raise RuntimeError("docgen needs nvdisasm for the SASS counts (pip install nvidia-cuda-nvdisasm)")
    sass = disassemble(res.cubin, tool)
    for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS.E.BYPASS.128", "SHFL.BFLY", "MUFU.EX2"):
        out.append(f"  {op:<20} {sass.count(op)}")
    return "\n".join(out)


def snippet_fa_counters() -> str:
    """cuda-sim's counters for the same kernel (``sextant explain --counters``)."""
    from sextant.runtime.counting import count_program

    program = _fa_program()
    counted = count_program(program, _fa_inputs())
    return "\n".join(f"{name} [{program.kernels[name].meta['mapping']}]: {c.summary()}" for name, c in counted.items())


def snippet_fa_schedule() -> str:
    """The CPU schedule dump of fused attention, and of a chain that cannot fuse."""
    from sextant.schedule.program import schedule

    q = torch.randn(1, 2, 16, 8)
    fused = schedule(run_pipeline(sextant.capture(_CausalAttention(), (q, q, q))), DOCS_CPU).describe()
    refused = schedule(run_pipeline(sextant.capture(_AttentionWithWeights(), (q, q, q))), DOCS_CPU).describe()
    return fused + "\n\n" + refused


class _Windowed(nn.Module):
    """The dynamic-shapes chapter's model: a projection over batch × sequence, a shifted softmax
    and positions from ``arange`` — reshapes, slices and iota over symbolic sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        z = (x.reshape(b * s, d) @ self.w).reshape(b, s, -1)
        return z[:, 1:].softmax(-1) + torch.arange(s - 1).float()[:, None]


def _windowed_dims() -> dict:
    from torch.export import Dim

    return {"x": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=3, max=512)}}


def snippet_dynamic_captured() -> str:
    """The chapter's model captured with symbolic batch and sequence sizes."""
    torch.manual_seed(0)
    return _relative(str(sextant.capture(_Windowed(), (torch.randn(2, 5, 4),), dynamic_shapes=_windowed_dims())))


def snippet_dynamic_calls() -> str:
    """One compile called at three sizes: the bindings it compiled, and two calls it refuses."""
    from sextant.errors import InputError

    torch.manual_seed(0)
    model = _Windowed()
    cm = sextant.compile(model, (torch.randn(2, 5, 4),), target="cpu", dynamic_shapes=_windowed_dims())
    lines = []
    for shape in [(1, 3, 4), (3, 7, 4), (8, 100, 4), (3, 7, 4)]:
        x = torch.randn(shape)
        ok = torch.allclose(cm(x), model(x), rtol=1e-5, atol=1e-5)  # (the error itself varies with the CPU)
        lines.append(f"x {list(shape)}: {'matches' if ok else 'DIFFERS FROM'} eager")
    program = cm.stages["program"]
    lines.append(f"one program: {len(program.kernels)} kernels, compiled once; per binding, the memory plan:")
    for binding, layout in program._layouts.items():
        blocks = ", ".join(map(str, layout.blocks))
        lines.append(f"  {' '.join(f'{k}={v}' for k, v in binding)}: arena {layout.arena_bytes} bytes, "
                     f"blocks per launch {blocks}")
    for shape in [(9, 5, 4), (2, 5, 5)]:
        try:
            cm(torch.randn(shape))
        except InputError as e:
            lines.append(f"x {list(shape)}: InputError: {e}")
    return "\n".join(lines)


def snippet_dynamic_kernel() -> str:
    """The chapter's softmax kernel on the cpu target: the sizes are kernel arguments."""
    from sextant.graph.passes import run_pipeline
    from sextant.kernel.printer import print_kernel
    from sextant.schedule.program import schedule

    torch.manual_seed(0)
    graph = sextant.capture(_Windowed(), (torch.randn(2, 5, 4),), dynamic_shapes=_windowed_dims())
    program = schedule(run_pipeline(graph), DOCS_CPU)
    reduce = next(k for name, k in program.kernels.items() if name.startswith("reduce"))
    return print_kernel(reduce)


class CachedAttention(nn.Module):
    """One attention head group with a KV cache: the decode step of docs/runtime.md ("Updates in place")."""

    def __init__(self, dim: int = 16, slots: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, 2, slots, dim // 2))
        self.register_buffer("v_cache", torch.zeros(1, 2, slots, dim // 2))
        self.register_buffer("mask", torch.ones(slots, slots, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, 2, d // 2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=self.mask[None, None, pos])
        return out.transpose(1, 2).reshape(b, s, d)


@functools.cache
def _cached_attention() -> sextant.CompiledModule:
    torch.manual_seed(0)
    model, eager = CachedAttention(), CachedAttention()
    eager.load_state_dict(model.state_dict())
    compiled = sextant.compile(model, (torch.randn(1, 1, 16), torch.tensor([0])), target="cpu", cache=False)
    for t in range(3):  # a few decode steps, checked against eager, buffers included
        x = torch.randn(1, 1, 16)
        torch.testing.assert_close(compiled(x, torch.tensor([t])), eager(x, torch.tensor([t])))
    torch.testing.assert_close(model.k_cache, eager.k_cache)
    assert compiled.full_write_backs == 0
    return compiled


def snippet_kv_graph() -> str:
    return _relative(str(_cached_attention().graph))


def snippet_kv_schedule() -> str:
    return _relative(_cached_attention().stages["program"].describe())


def snippet_kv_kernel() -> str:
    from sextant.kernel.printer import print_kernel

    program = _cached_attention().stages["program"]
    return print_kernel(next(k for name, k in program.kernels.items() if name.startswith("scatter")))


@functools.cache
def _training_records() -> tuple:
    """One training step of the Regressor under torch.compile(backend="sextant"), checked against
    eager; the STATS records of its forward and backward graphs."""
    import copy

    import sextant.frontend.dynamo as dyn

    torch.manual_seed(0)
    model = Regressor()
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    dyn.STATS.reset()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    compiled = torch.compile(model, backend="sextant", options={"target": "cpu", "fallback": False})
    compiled(x, y).backward()
    eager(x, y).backward()
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    records = tuple(dyn.STATS.graphs)
    torch._dynamo.reset()
    return records


def _training_record(role: str):
    return next(r for r in _training_records() if r.role == role)


def snippet_train_stats() -> str:
    lines = []
    for r in _training_records():
        kept = f", {r.saved[0]} saved activations ({r.saved[1]} bytes) in" if r.saved else ""
        lines.append(f"{r.role:<9} {r.nodes:>3} ATen ops -> {r.target}{kept}, externs: {list(r.externs) or 'none'}")
    return "\n".join(lines)


def snippet_train_forward_return() -> str:
    graph = _training_record("forward").compiled.graph
    return str(graph).splitlines()[0] + "\n  ...\n" + "\n".join(str(graph).splitlines()[-2:])


def snippet_train_backward_graph() -> str:
    return str(_training_record("backward").compiled.graph)


def snippet_train_backward_schedule() -> str:
    from sextant.schedule.program import schedule

    compiled = _training_record("backward").compiled  # from the compile cache it has no captured stage
    return schedule(run_pipeline(compiled.stages.get("captured", compiled.graph)), DOCS_CPU).describe()


def snippet_train_optimizer_step() -> str:
    """Two SGD-with-momentum steps of the Regressor under torch.compile(opt.step, backend="sextant"),
    checked against eager; the schedule of the second (the first creates the momentum buffers)."""
    import copy

    import sextant.frontend.dynamo as dyn

    torch.manual_seed(0)
    model = Regressor()
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    torch._dynamo.reset()
    dyn.STATS.reset()
    step = torch.compile(opt.step, backend="sextant", options={"target": "cpu", "fallback": False})
    for _ in range(2):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        for m in (model, eager):
            m(x, y).backward()
        step()
        eager_opt.step()
        opt.zero_grad()
        eager_opt.zero_grad()
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(q, p)
    compiled = dyn.STATS.graphs[-1].compiled
    torch._dynamo.reset()
    graph = compiled.graph
    updates = [line.split(" {")[0] for line in str(graph).splitlines() if line.lstrip().startswith("update")]
    return (f"{len(graph.mutations)} updates ({len(updates) // 2} parameters, {len(updates) // 2} momentum buffers), "
            f"e.g.\n" + "\n".join(updates[:1] + updates[len(updates) // 2:len(updates) // 2 + 1]) + "\n\n"
            + compiled.stages["program"].describe())


class _DropoutHead(nn.Module):
    """A linear layer, GELU and dropout in training mode: the random op and the seed input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 32), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.gelu(self.fc(x)))


def snippet_train_dropout() -> str:
    """A training-mode dropout as captured (one random op, the seed line) and scheduled on the CPU
    (the Philox rounds fused into the kernel that applies the mask)."""
    from sextant.schedule.program import schedule

    torch.manual_seed(0)
    captured = sextant.capture(_DropoutHead().train(), (torch.randn(8, 16),))
    lines = str(captured).splitlines()
    random = next(i for i, line in enumerate(lines) if "= random(" in line)
    shown = [lines[0], "  ...", *lines[random - 1:]]
    graph = run_pipeline(captured)
    return "\n".join(shown) + "\n\n" + schedule(graph, DOCS_CPU).describe()


class _DecodeAttention(nn.Module):
    """One decode step's attention as ``sextant.decoder`` writes it: 12 query heads over 4 K/V heads
    (repeated by expand), the static cache's boolean mask row."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, h, s, d = k.shape
        k = k[:, :, None].expand(b, h, 3, s, d).reshape(b, 3 * h, s, d)
        v = v[:, :, None].expand(b, h, 3, s, d).reshape(b, 3 * h, s, d)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@functools.cache
def _decode_attention() -> tuple[sextant.CompiledModule, tuple]:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 12, 1, 64).half(), torch.randn(1, 4, 1024, 64).half(), torch.randn(1, 4, 1024, 64).half()
    mask = (torch.arange(1024) <= 300)[None, None, None]  # position 300 of a 1024-slot static cache
    args = (q, k, v, mask)
    return sextant.compile(_DecodeAttention(), args, target="cuda-sim", arch="sm_90", cache=False), args


def snippet_decode_attention_schedule() -> str:
    """A batch-1 decode step's attention for sm_90: split-key partials and their combine, with
    ptxas's figures and cuda-sim's counters."""
    from sextant.runtime.counting import count_program

    cm, args = _decode_attention()
    program = cm.stages["program"]
    counted = count_program(program, args)
    return program.describe() + "\n\n" + "\n".join(
        f"{name} [{program.kernels[name].meta['mapping']}]: {c.summary()}" for name, c in counted.items())


def snippet_decode_attention_kernel() -> str:
    """The partials kernel's key-tile loop in kernel IR, to the online-softmax update: K read only
    for a key some row sees, the warp's flag, the tile's update guarded on it."""
    from sextant.kernel.printer import print_kernel

    program = _decode_attention()[0].stages["program"]
    (k,) = [k for k in program.kernels.values() if k.meta["mapping"] == "attention-split-key-partials"]
    lines = print_kernel(k).splitlines()
    head = lines[:lines.index("{")]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for (jt"))
    corr = next(i for i, line in enumerate(lines) if line.lstrip().startswith("Cs["))
    return "\n".join([*head, "{", "  ...", *lines[start:corr + 3], "    ...", "  }", "  ..."])


class _ParallelBlock(nn.Module):
    """One rank's shard of a GPT-J-style parallel-residual block under Megatron TP: attention and MLP
    both read the norm's output, each ends in a row-parallel projection and an all_reduce."""

    def __init__(self, dim: int = 64, heads: int = 2, hidden: int = 128) -> None:  # this rank's heads, hidden
        super().__init__()
        self.heads, self.hd = heads, dim // 4
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * heads * self.hd, bias=False)  # column shard
        self.o = nn.Linear(heads * self.hd, dim, bias=False)  # row shard
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        a = funcol.all_reduce(self.o(a), "sum", dist.group.WORLD)
        m = funcol.all_reduce(self.down(F.gelu(self.up(h))), "sum", dist.group.WORLD)
        return x + a + m


@functools.cache
def _parallel_block():
    """The block captured in a world of one (gloo) and scheduled for the pinned docs CPU: the graph
    and schedule are those of any world size, with this rank's shard sizes (compiled for this host,
    its weights' panel widths would follow the host's vector width)."""
    import tempfile

    import torch.distributed as dist

    from sextant.schedule.program import schedule

    torch.manual_seed(0)
    started = not dist.is_initialized()
    if started:
        store = tempfile.mkdtemp(prefix="sextant-docs-")
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    try:
        x = torch.randn(2, 16, 64)
        return schedule(run_pipeline(sextant.capture(_ParallelBlock().eval(), (x,))), DOCS_CPU)
    finally:
        if started:
            dist.destroy_process_group()


def snippet_dist_graph() -> str:
    return _relative(str(_parallel_block().graph))


def snippet_dist_schedule() -> str:
    return _relative(_parallel_block().describe())


def snippet_bf16_pair_kernel() -> str:
    """A bf16 Linear (40 rows, 64 → 48) on a CPU with AVX-512-BF16 (pinned: 16-lane vectors): the
    micro-kernel's loop over pairs of K, one pair dot per row and vector of the strip."""
    from sextant.kernel.printer import print_kernel
    from sextant.schedule.program import schedule

    torch.manual_seed(0)
    model, x = nn.Linear(64, 48).bfloat16().eval(), torch.randn(40, 64).bfloat16()
    program = schedule(run_pipeline(sextant.capture(model, (x,))), cpu_target(cores=2, vector_bytes=64, pair_dot=True))
    lines = print_kernel(next(k for n, k in program.kernels.items() if n.startswith("matmul"))).splitlines()
    start = next(i for i, ln in enumerate(lines) if "for (k" in ln)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "}" and
               len(lines[i]) - len(lines[i].lstrip()) == len(lines[start]) - len(lines[start].lstrip()))
    head = [ln for ln in lines[:start] if "kernel " in ln or "in bf16" in ln or "local" in ln]
    return "\n".join(head + ["  ..."] + lines[start:start + 9] + ["        ..."] + lines[end - 4:end + 1])


@functools.cache
def _amx_linear_kernel():
    """A bf16 Linear (70 rows, 64 → 96) scheduled for a CPU with AMX (pinned: any host)."""
    from sextant.schedule.program import schedule

    torch.manual_seed(0)
    model, x = nn.Linear(64, 96).bfloat16().eval(), torch.randn(70, 64).bfloat16()
    target = cpu_target(cores=2, vector_bytes=64, pair_dot=True, amx=True)
    program = schedule(run_pipeline(sextant.capture(model, (x,))), target)
    return next(k for n, k in program.kernels.items() if n.startswith("matmul"))


def snippet_amx_kernel() -> str:
    """The AMX GEMM's kernel IR: column tiles, row tiles (the last one moved back inside M), one
    tile matmul each, the epilogue over the local result."""
    from sextant.kernel.printer import print_kernel

    return print_kernel(_amx_linear_kernel())


def snippet_amx_assembly() -> str:
    """That kernel compiled for Sapphire Rapids: the tile configuration and one k step."""
    from sextant.codegen.cpu_amx import sapphire_rapids_assembly

    lines = [ln for ln in sapphire_rapids_assembly([_amx_linear_kernel()]).splitlines()
             if ln.strip() and not ln.strip().startswith((".", "#"))]
    cfg = next(i for i, ln in enumerate(lines) if "ldtilecfg" in ln)
    first = next(i for i, ln in enumerate(lines) if "tileloadd" in ln)
    last = next(i for i in range(first, len(lines)) if "tdpbf16ps" in lines[i] and "tdpbf16ps" not in lines[i + 1])
    store = next(i for i, ln in enumerate(lines) if "tilestored" in ln)
    tidy = lambda ln: " ".join(ln.split())
    return "\n".join([tidy(lines[cfg]), "..."] + [tidy(ln) for ln in lines[first:last + 1]] + ["...",
                      tidy(lines[store])])


@functools.cache
def _hopper_linear():  # an fp16 Linear + GELU (200 rows, 392 -> 72: ragged everywhere) for sm_90a, through cuda-sim
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(392, 72), nn.GELU()).half().eval()
    return sextant.compile(model, (torch.randn(200, 392).half(),), target="cuda-sim", arch="sm_90a", cache=False)


def snippet_hopper_kernel() -> str:
    """The wgmma + TMA GEMM's kernel IR: the barriers, the producer's loop, the consumers' loop."""
    from sextant.kernel.printer import print_kernel

    lines = print_kernel(next(iter(_hopper_linear().stages["program"].kernels.values()))).splitlines()
    end = next(i for i, ln in enumerate(lines) if ln.strip() == "wgmma_wait(0, acc)")
    return "\n".join([*lines[:end + 1], "    ..."])


def snippet_hopper_ptx() -> str:
    """The PTX of both roles: the copies and waits, the wgmmas, the wait that ties the accumulators."""
    from sextant.codegen.llvm_nvptx import ptx_entries

    lines = ptx_entries(_hopper_linear().stages["ptx"].ptx)["matmul_0"].splitlines()
    keep = ("mbarrier", "wgmma", "cp.async.bulk", "bar.sync", ".param .align", "fence.proxy", "setmaxnreg")
    out = []
    for ln in lines:
        if any(k in ln for k in keep):
            text = ln.strip()
            if text.startswith("wgmma.mma_async"):  # 64 accumulator registers: shortened
                head, _, rest = text.partition("{")
                regs, _, tail = rest.partition("}")
                names = regs.split(", ")
                text = f"{head}{{{', '.join(names[:3])}, ..., {names[-1]}}}{tail}"
            out.append("\t" + text)
    return "\n".join(out)


def snippet_hopper_ptxas() -> str:
    log = _hopper_linear().stages["ptxas"].log.strip().splitlines()
    return "\n".join(line for line in log if "Compile time" not in line)


def _hopper_attention():  # GPT-2's causal attention (Q/K/V slices of one projection), fp16, for sm_90a
    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(128, 384)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = (t.view(b, n, 2, 64).transpose(1, 2) for t in self.qkv(x).split(128, dim=2))
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Attention().half().eval()
    return sextant.compile(model, (torch.randn(2, 300, 128).half(),), target="cuda-sim", arch="sm_90a", cache=False)


def snippet_hopper_attention_kernel() -> str:
    """The Hopper attention's kernel IR: the barriers, the producer, then the consumers' key loop
    with the softmax elided."""
    from sextant.kernel.printer import print_kernel

    kern = next(k for k in _hopper_attention().stages["program"].kernels.values()
                if k.meta["mapping"] == "flash-attention-wgmma-tma")
    lines = print_kernel(kern).splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("if (tid.x == 0)"))
    consumer = next(i for i, ln in enumerate(lines) if ln.strip() == "} else {")
    loop = next(i for i in range(consumer, len(lines)) if lines[i].strip().startswith("for (kt"))
    end = next(i for i in range(loop, len(lines)) if lines[i] == "    }")
    keep = ("tma_load", "mbarrier", "wgmma", "__syncthreads", "kb", "vb")
    out = [*lines[:4], "  ...", *lines[start:consumer + 2], "    ...", lines[loop - 1], lines[loop]]
    skipped = 0
    for ln in lines[loop + 1:end]:
        if any(k in ln for k in keep):
            if skipped:
                out.append(f"      ... ({skipped} lines)")
                skipped = 0
            out.append(ln)
        else:
            skipped += 1
    if skipped:
        out.append(f"      ... ({skipped} lines: the next scores become the current ones)")
    return "\n".join([*out, "    }", "    ..."])


def _hopper_conv():  # an fp16 3x3 conv + ReLU (2 x 16 x 8 x 8 -> 32 channels) for sm_90a, through cuda-sim
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU()).half().eval()
    return sextant.compile(model, (torch.randn(2, 16, 8, 8).half(),), target="cuda-sim", arch="sm_90a", cache=False)


def snippet_hopper_conv_kernel() -> str:
    """The Hopper convolution's consumer: the rows decoded once, the first fragment gathered, then
    the K loop — wgmmas on the register fragment, the next one gathered while they run."""
    from sextant.kernel.printer import print_kernel

    lines = print_kernel(next(iter(_hopper_conv().stages["program"].kernels.values()))).splitlines()
    consumer = next(i for i, ln in enumerate(lines) if ln.strip() == "} else {")
    first = next(i for i in range(consumer, len(lines)) if lines[i].strip() == "xa[0] = (f16)0.0")
    loop = next(i for i in range(first, len(lines)) if lines[i].strip().startswith("for (kt"))
    nxt = next(i for i in range(loop, len(lines)) if lines[i].strip().startswith("if (kt"))
    gathered = next(i for i in range(nxt, len(lines)) if lines[i].strip() == "xn[0] = (f16)0.0")
    wait = next(i for i in range(gathered, len(lines)) if lines[i].strip() == "wgmma_wait(0, acc)")
    end = next(i for i in range(wait, len(lines)) if lines[i] == "    }")
    return "\n".join([*lines[:3], "  ...", *lines[consumer:first + 2], "    ... (31 more elements)",
                      *lines[loop:gathered + 2], "        ... (31 more elements)", *lines[wait - 1:end + 1], "    ..."])


def snippet_hopper_conv_ptxas() -> str:
    res = _hopper_conv().stages["ptxas"]
    return "\n".join(ln for ln in res.log.strip().splitlines() if "Compile time" not in ln and "C7519" not in ln)


def snippet_hopper_attention_ptxas() -> str:
    res = _hopper_attention().stages["ptxas"]
    name = next(n for n in res.kernels if n.startswith("attention"))
    log = [ln for ln in res.log.strip().splitlines() if "Compile time" not in ln and "C7519" not in ln]
    keep, on = [], False
    for ln in log:  # the attention kernel's lines only
        if "Compiling entry function" in ln:
            on = f"'{name}'" in ln
        if on:
            keep.append(ln)
    return "\n".join(keep)


SNIPPETS: dict[str, Callable[[], str]] = {
    "hopper-kernel": snippet_hopper_kernel,
    "hopper-attention-kernel": snippet_hopper_attention_kernel,
    "hopper-attention-ptxas": snippet_hopper_attention_ptxas,
    "hopper-conv-kernel": snippet_hopper_conv_kernel,
    "hopper-conv-ptxas": snippet_hopper_conv_ptxas,
    "hopper-ptx": snippet_hopper_ptx,
    "hopper-ptxas": snippet_hopper_ptxas,
    "bf16-pair-kernel": snippet_bf16_pair_kernel,
    "amx-kernel": snippet_amx_kernel,
    "amx-assembly": snippet_amx_assembly,
    "train-stats": snippet_train_stats,
    "train-forward-return": snippet_train_forward_return,
    "train-backward-graph": snippet_train_backward_graph,
    "train-backward-schedule": snippet_train_backward_schedule,
    "train-optimizer-step": snippet_train_optimizer_step,
    "train-dropout": snippet_train_dropout,
    "kv-graph": snippet_kv_graph,
    "kv-schedule": snippet_kv_schedule,
    "kv-kernel": snippet_kv_kernel,
    "dynamic-captured": snippet_dynamic_captured,
    "dynamic-kernel": snippet_dynamic_kernel,
    "dynamic-calls": snippet_dynamic_calls,
    "fa-kernel-excerpt": snippet_fa_kernel_excerpt,
    "fa-ptxas": snippet_fa_ptxas,
    "fa-counters": snippet_fa_counters,
    "fa-schedule": snippet_fa_schedule,
    "tc-counters": snippet_tc_counters,
    "splitk-schedule": snippet_splitk_schedule,
    "decode-attention-schedule": snippet_decode_attention_schedule,
    "decode-attention-kernel": snippet_decode_attention_kernel,
    "tile-ranking": snippet_tile_ranking,
    "tc-kernel-excerpt": snippet_tc_kernel_excerpt,
    "tc-ptx-excerpt": snippet_tc_ptx_excerpt,
    "tc-sass-excerpt": snippet_tc_sass_excerpt,
    "tc-ptxas": snippet_tc_ptxas,
    "gpt2-roofline": snippet_gpt2_roofline,
    "tiny-launch-plan": snippet_tiny_launch_plan,
    "tiny-gpu-schedule": snippet_tiny_gpu_schedule,
    "tiny-gpu-kernel": snippet_tiny_gpu_kernel,
    "tiny-ptx": snippet_tiny_ptx,
    "tiny-ptx-excerpt": snippet_tiny_ptx_excerpt,
    "tiny-captured-head": snippet_tiny_captured_head,
    "tiny-ptxas": snippet_tiny_ptxas,
    "tiny-schedule": snippet_tiny_schedule,
    "tiny-kernels": snippet_tiny_kernels,
    "tiny-llvm": snippet_tiny_llvm,
    "gpt2-schedule": snippet_gpt2_schedule,
    "tiny-captured": snippet_tiny_captured,
    "tiny-optimised": snippet_tiny_optimised,
    "tiny-print-after-all": snippet_tiny_print_after_all,
    "mlp-optimised": snippet_mlp_optimised,
    "gpt2-passes": snippet_gpt2_passes,
    "gpt2-ops": snippet_gpt2_ops,
    "unsupported-error": snippet_unsupported_error,
    "extern-graph": snippet_extern_graph,
    "dist-graph": snippet_dist_graph,
    "dist-schedule": snippet_dist_schedule,
    "extern-schedule": snippet_extern_schedule,
    "onnx-imported": snippet_onnx_imported,
    "onnx-optimised": snippet_onnx_optimised,
    "onnx-unsupported-error": snippet_onnx_unsupported_error,
}


def render(text: str, cache: dict[str, str]) -> tuple[str, list[str]]:
    """Return ``text`` with every block regenerated, and the names of blocks that changed."""
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        name = m["name"]
        if name not in SNIPPETS:
            raise KeyError(f"unknown docs snippet {name!r} (known: {', '.join(SNIPPETS)})")
        if name not in cache:
            cache[name] = SNIPPETS[name]()
        body = f"```\n{cache[name]}\n```\n"
        if body != m["body"]:
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return _BLOCK.sub(sub, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sextant.tools.docgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="report stale blocks instead of rewriting them")
    ns = ap.parse_args(argv)
    cache: dict[str, str] = {}
    stale = []
    for path in DOCS:
        text = path.read_text()
        new, changed = render(text, cache)
        stale += [f"{path.relative_to(ROOT)}: {c}" for c in changed]
        if changed and not ns.check:
            path.write_text(new)
    if stale:
        print(("stale: " if ns.check else "updated: ") + ", ".join(stale))
        return 1 if ns.check else 0
    print("docs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
