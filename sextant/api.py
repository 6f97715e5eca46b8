"""``sextant.compile``: the one call a practitioner needs."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TextIO

import torch

from sextant.frontend.capture import capture
from sextant.gcpause import gc_paused
from sextant.graph.ir import Graph
from sextant.graph.reference import run_graph
from sextant.graph.symbolic import SymbolicShapeError
from sextant.kernel.verifier import KernelVerificationError
from sextant.runtime.compiled import CompiledModule
from sextant.runtime.onnx_module import OnnxCompiledModule

if TYPE_CHECKING:
    from sextant.schedule.target import TargetDesc
    from sextant.schedule.tuning import TileTable

TARGETS = ("reference", "cpu", "cuda-sim", "cuda")
# ``progress(stage)`` returns a context manager that brackets one compile stage (for progress
# lines and timings, e.g. the ``sextant`` command's); the stage names are these:
STAGES = ("cache", "capture", "onnx-import", "passes", "schedule", "nvptx", "ptxas", "llvm-cpu", "load")
StageHook = Callable[[str], AbstractContextManager[Any]]
PLANNED_TARGETS: tuple[str, ...] = ()
log = logging.getLogger("sextant")


def compile(  # mirrors torch.compile
    module: torch.nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any] | None = None,
    *,
    target: str | None = None,
    arch: str | None = None,
    pipeline: str | Sequence[str] = "default",
    print_after_all: bool = False,
    stream: TextIO = sys.stdout,
    progress: StageHook | None = None,
    cache: bool = True,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> CompiledModule:
    """Compile ``module`` for inputs shaped like ``args``/``kwargs``; returns a callable like the module.

    ``target`` defaults to where the inputs are: ``"cuda"`` for CUDA tensors, else ``"cpu"``.
    ``target="reference"`` runs the optimised graph IR with the reference executor (the
    oracle every code-generating target is tested against); ``target="cpu"`` fuses it into
    kernels, generates LLVM IR and runs the JIT-compiled machine code on all cores;
    ``target="cuda-sim"`` compiles exactly as for an NVIDIA GPU of ``arch`` (GPU schedules, PTX
    assembled by ptxas) and runs those same kernels on the CPU through the SIMT lowering;
    ``target="cuda"`` runs them on the current CUDA device, taking and returning torch CUDA tensors.
    ``arch`` defaults to sm_90 for cuda-sim and to the device's compute capability for cuda.
    f32 matmuls on the GPU targets are exact fp32 unless ``torch.backends.cuda.matmul.allow_tf32``
    is set when compiling (then tf32 tensor cores, as eager's cuBLAS would use).
    ``progress``, if given, is entered around each stage (see ``STAGES``) — the hook the
    ``sextant`` command uses to print what is running and how long it took.
    ``cache`` (with ``SEXTANT_CACHE``/``SEXTANT_COMPILE_CACHE`` not 0): a module compiled before with
    the same code, weights, inputs and options is loaded from the compile cache instead
    (``sextant.runtime.compile_cache``); such a module has the artifact's stages (``program``,
    kernels, PTX), not the capture's.
    ``dynamic_shapes`` (torch.export's: ``{"ids": {0: Dim("batch", max=8), 1: Dim("seq", max=512)}}``)
    keeps those sizes symbolic: one capture serves every size in range, each new binding of the
    sizes compiled on first use (``sextant/runtime/specialize.py``, docs/dynamic-shapes.md) — with
    the cache on, one cache entry per binding, so a later process loads the sizes it has seen.
    A module that updates its buffers in ``forward()`` (a KV cache: ``self.k_cache[:, :, pos] = k``)
    is compiled with them as state: each call reads the module's live buffers and writes their new
    values back — in place, one token's rows, where the schedule can prove it safe
    (``graph/passes/in_place_updates.py``); arguments updated in place are written back likewise.
    An ATen op (or ``torch.library`` custom op) with no lowering runs as an *extern call*: the op
    itself, called on the host between sextant's kernels (listed in the schedule dump, ``sextant
    explain`` and the report); ``strict=True`` refuses such a model instead (``UnsupportedOpError``
    naming each op and its source line), for users who want generated code only.
    """
    if not isinstance(args, tuple):
        args = (args,)
    if target is None:
        target = default_target(args, kwargs)
    _check_target(target)
    from sextant.runtime import compile_cache

    k = None
    if (cache and not print_after_all and not strict and target in compile_cache.CACHED_TARGETS
            and compile_cache.cache_root()):  # strict: the capture must run to refuse extern calls
        with _steps(progress)("cache"):
            k = compile_cache.key(module, args, kwargs, target, arch, pipeline)
            if k and dynamic_shapes is not None:  # the capture runs; each binding is an entry of its own
                k = compile_cache.dynamic_key(k, dynamic_shapes)
            hit = compile_cache.lookup(k) if k and dynamic_shapes is None else None
        if hit is not None:
            return hit
    with gc_paused():  # see sextant.gcpause: a third of IR generation was the cyclic collector
        compiled = _compile(module, args, kwargs, target, arch, pipeline, print_after_all, stream, progress,
                            dynamic_shapes, k if dynamic_shapes is not None else None, strict)
    if k and dynamic_shapes is None and not compiled.graph.mutations:  # (an artifact holds no live buffers)
        compile_cache.store(k, compiled)
    return compiled


def allow_tf32() -> bool:
    """Whether f32 matmuls may use tf32 tensor cores: ``torch.backends.cuda.matmul.allow_tf32``
    (also set by ``torch.set_float32_matmul_precision("high")``) when the GPU targets compile —
    the flag eager's cuBLAS matmuls and Inductor read. Off by default: exact fp32, as eager."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _check_target(target: str) -> None:
    """A known target; for ``cuda``, fail before the slow stages when there is no GPU or no cuda-python."""
    if target not in TARGETS:
        if target in PLANNED_TARGETS:
            raise ValueError(f"target {target!r} is not implemented yet; available: {', '.join(TARGETS)}")
        raise ValueError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    if target == "cuda":
        from sextant.runtime.cuda import require_cuda

        require_cuda()


def _steps(progress: StageHook | None) -> StageHook:
    return progress or (lambda _: contextlib.nullcontext())


def default_target(args: tuple, kwargs: Mapping[str, Any] | None = None) -> str:
    """The target for inputs that live where ``args``/``kwargs`` do: ``cuda`` if any tensor is on a CUDA
    device, else ``cpu``."""
    import torch.utils._pytree as pytree

    leaves = pytree.tree_leaves((args, dict(kwargs or {})))
    return "cuda" if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in leaves) else "cpu"


def _compile(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None, target: str,
             arch: str | None, pipeline: str | Sequence[str], print_after_all: bool, stream: TextIO,
             progress: StageHook | None, dynamic_shapes: Any = None, cache_key: str | None = None,
             strict: bool = False) -> CompiledModule:
    step = _steps(progress)
    with step("capture"):
        captured = capture(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    compiled = compile_graph(captured, target=target, arch=arch, pipeline=pipeline,
                             print_after_all=print_after_all, stream=stream, progress=step, cache_key=cache_key)
    if captured.mutations:
        bind_buffers(compiled, module)
    return compiled


def bind_buffers(compiled: CompiledModule, module: torch.nn.Module) -> None:
    """Hand the compiled module the live buffers (a KV cache) or parameters (an optimizer step)
    ``module.forward()`` updates: each call reads them and stores their new values back, as eager
    does (``graph.ir.Mutation``)."""
    g = compiled.graph
    names = [m.target for m in sorted(g.mutations, key=lambda m: m.input) if m.kind == "buffer"]
    params = dict(module.named_parameters())
    compiled.bind_state([params[name] if name in params else module.get_buffer(name) for name in names])


def _symbolic_module(captured: Graph, target: str, arch: str | None, pipeline: str | Sequence[str],
                     print_after_all: bool, stream: TextIO, progress: StageHook | None,
                     cache_key: str | None, tiles: TileTable | None = None) -> CompiledModule:
    """A module over a graph with symbolic sizes: each new binding of the sizes compiles the bound
    graph on first use (``sextant/runtime/specialize.py``), or loads it from the compile cache
    (entry: ``cache_key`` and the binding) when ``cache_key`` is given."""
    from sextant.runtime import compile_cache
    from sextant.runtime.specialize import Binding, Specializer

    why_not = symbolic_refusal(target)
    if why_not is None:
        try:
            return _compile_symbolic(captured, target, arch, pipeline, print_after_all, stream, _steps(progress),
                                     tiles)
        except SymbolicShapeError as e:
            why_not = str(e)
        except KernelVerificationError as e:  # a mapping's bug at symbolic sizes: the static path is proven
            why_not = f"a kernel over symbolic sizes failed verification ({e})"
            log.warning("sextant: @%s: %s; compiling per binding instead", captured.name, why_not)
    log.info("sextant: @%s is compiled per binding of its sizes: %s", captured.name, why_not)

    def compile_bound(graph: Graph, binding: Binding) -> CompiledModule:
        k = compile_cache.binding_key(cache_key, binding) if cache_key else None
        hit = compile_cache.lookup(k) if k else None
        if hit is not None:
            return hit
        compiled = compile_graph(graph, target=target, arch=arch, pipeline=pipeline,
                                 print_after_all=print_after_all, stream=stream, progress=progress, tiles=tiles)
        if k:
            compile_cache.store(k, compiled)
        return compiled

    spec = Specializer(captured, compile_bound)
    return CompiledModule(captured, target, spec, device="cuda" if target == "cuda" else "cpu",
                          stages={"captured": captured, "specializer": spec, "per_binding": why_not})


def symbolic_refusal(target: str) -> str | None:
    """Why ``target`` cannot compile one program for every size (None: it can try)."""
    from sextant.codegen.race_check import checks_enabled

    if target == "reference":
        return "the reference target runs the graph per binding"
    if checks_enabled(None):
        return "the race-checked CPU build checks static kernels only"
    return None


def _compile_symbolic(captured: Graph, target: str, arch: str | None, pipeline: str | Sequence[str],
                      print_after_all: bool, stream: TextIO, step: StageHook,
                      tiles: TileTable | None = None) -> CompiledModule:
    """One program for every binding of the sizes: kernels take the sizes as arguments, the runner
    binds them (and plans memory) per call. Raises ``SymbolicShapeError`` where a pass or mapping
    needs a concrete size; the caller then compiles per binding."""
    from sextant.graph.passes import run_pipeline

    with step("passes"):
        graph = run_pipeline(captured, pipeline, print_after_all=print_after_all, stream=stream)
    if target == "cuda-sim":
        return _compile_cuda_sim(graph, {"captured": captured}, arch or "sm_90", step, tiles)
    if target == "cuda":
        return _compile_cuda(graph, {"captured": captured}, arch, step, tiles)
    return _compile_cpu(graph, {"captured": captured}, step)


def compile_graph(captured: Graph, *, target: str = "cpu", arch: str | None = None,
                  pipeline: str | Sequence[str] = "default", print_after_all: bool = False,
                  stream: TextIO = sys.stdout, progress: StageHook | None = None,
                  cache_key: str | None = None, tiles: TileTable | None = None) -> CompiledModule:
    """The stages after the frontend, shared by every frontend: graph passes, then ``target``'s backend.

    ``captured`` is a verified graph from ``sextant.capture`` or the ONNX frontend; the other
    arguments mean what they mean for :func:`compile`. For a graph with symbolic sizes,
    ``cache_key`` (the compile cache's key of the model and its ``dynamic_shapes``) keys each
    binding's entry in the compile cache; without it the bindings are compiled in memory only.
    ``tiles``: the GPU targets' tile choices (``schedule/tuning.py``); by default those measured
    for ``arch`` by ``sextant.tools.tune`` (``runtime/tuning_store.py``), else the cost model's.
    """
    from sextant.graph.bind import is_symbolic_graph
    from sextant.graph.passes import run_pipeline

    _check_target(target)
    step = _steps(progress)
    if is_symbolic_graph(captured):
        return _symbolic_module(captured, target, arch, pipeline, print_after_all, stream, progress, cache_key,
                                tiles)
    with step("passes"):
        graph = run_pipeline(captured, pipeline, print_after_all=print_after_all, stream=stream)
    stages: dict[str, Any] = {"captured": captured}
    if target == "reference":
        return CompiledModule(graph, target, lambda xs: run_graph(graph, xs), stages=stages)
    if target == "cuda-sim":
        return _compile_cuda_sim(graph, stages, arch or "sm_90", step, tiles)
    if target == "cuda":
        return _compile_cuda(graph, stages, arch, step, tiles)
    return _compile_cpu(graph, stages, step)


def _gpu_target(arch: str, tiles: TileTable | None) -> TargetDesc:
    """The schedule's target for ``arch``: tf32 as torch allows it, the tile choices given or stored."""
    from sextant.runtime.tuning_store import load_table
    from sextant.schedule.target import gpu_target

    return gpu_target(arch, tf32=allow_tf32(), tiles=load_table(arch) if tiles is None else tiles)


def _compile_cuda_sim(graph: Graph, stages: dict[str, Any], arch: str, step: StageHook,
                      tiles: TileTable | None = None) -> CompiledModule:
    from sextant.codegen.llvm_cpu import compile_kernels
    from sextant.codegen.llvm_nvptx import emit_ptx
    from sextant.runtime.program_runner import ProgramRunner
    from sextant.schedule.program import schedule

    with step("schedule"):
        program = schedule(graph, _gpu_target(arch, tiles))
    kernels = list(program.kernels.values())
    with step("nvptx"):
        ptx = emit_ptx(kernels, arch=arch)
    with step("ptxas"):
        kernels, ptx, assembled = _assemble(program, kernels, ptx)
        stages.update(program=program, ptx=ptx, ptxas=assembled)
    program.resources = dict(stages["ptxas"].kernels)
    with step("llvm-cpu"):
        module = compile_kernels(kernels)
    stages["cpu_module"] = module
    return CompiledModule(graph, "cuda-sim", ProgramRunner(program, module.launch), stages=stages)


def _assemble(program: Any, kernels: list, ptx: Any) -> tuple[list, Any, Any]:
    """ptxas on ``ptx``; a kernel its register budget makes spill is re-emitted without it (see
    codegen/register_budget.py), in ``program.kernels`` too, with a note in ``program.rewrites``."""
    from sextant.codegen.ptxas import assemble
    from sextant.codegen.register_budget import relax_spilling

    kernels, ptx, assembled, notes = relax_spilling(kernels, ptx, assemble(ptx.ptx, ptx.arch))
    program.kernels.update((k.name, k) for k in kernels)
    program.rewrites.extend(notes)
    return kernels, ptx, assembled


def _compile_cuda(graph: Graph, stages: dict[str, Any], arch: str | None, step: StageHook,
                  tiles: TileTable | None = None) -> CompiledModule:
    """As cuda-sim up to the PTX; then ptxas's cubin is loaded when ptxas is installed (else the
    driver JIT-compiles the PTX) and the kernels run on the GPU (see sextant/runtime/cuda.py)."""
    from sextant.codegen.llvm_nvptx import emit_ptx
    from sextant.codegen.ptxas import PtxasError
    from sextant.runtime.cuda import device_arch, load_runner, require_cuda
    from sextant.schedule.program import schedule

    device = require_cuda()
    arch = arch or device_arch(device)
    with step("schedule"):
        program = schedule(graph, _gpu_target(arch, tiles))
    with step("nvptx"):
        ptx = emit_ptx(list(program.kernels.values()), arch=arch)
    stages.update(program=program, ptx=ptx)
    cubin = None  # without ptxas (or one too old for this GPU) the driver JIT-compiles the PTX
    try:
        with step("ptxas"):
            _, ptx, stages["ptxas"] = _assemble(program, list(program.kernels.values()), ptx)
            stages["ptx"] = ptx
        cubin = stages["ptxas"].cubin
        program.resources = dict(stages["ptxas"].kernels)
    except PtxasError as e:
        stages["ptxas_error"] = str(e)
    with step("load"):
        runner = load_runner(program, ptx.ptx, cubin, arch, device)
    stages["runner"] = runner
    return CompiledModule(graph, "cuda", runner, stages=stages, device="cuda")


def _compile_cpu(graph: Graph, stages: dict[str, Any], step: StageHook) -> CompiledModule:
    from sextant.codegen.llvm_cpu import compile_kernels
    from sextant.codegen.race_check import CheckedCpuModule
    from sextant.runtime.native_runner import NativeRunner
    from sextant.runtime.program_runner import ProgramRunner
    from sextant.schedule.program import schedule
    from sextant.schedule.target import cpu_target

    with step("schedule"):
        program = schedule(graph, cpu_target())
    with step("llvm-cpu"):
        module = compile_kernels(list(program.kernels.values()))
    stages.update(program=program, cpu_module=module)
    # the checked build reports races per launch, so it keeps the launch-by-launch runner
    runner = ProgramRunner(program, module.launch) if isinstance(module, CheckedCpuModule) else \
        NativeRunner(program, module)
    return CompiledModule(graph, "cpu", runner, stages=stages)


def compile_onnx(  # the ONNX frontend's entry point; everything after the import is compile_graph
    model: Any,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    constant_inputs: Mapping[str, Any] | None = None,
    target: str = "cpu",
    arch: str | None = None,
    pipeline: str | Sequence[str] = "default",
    print_after_all: bool = False,
    stream: TextIO = sys.stdout,
    progress: StageHook | None = None,
) -> OnnxCompiledModule:
    """Compile an ONNX model (a ``.onnx`` path, its bytes, or an ``onnx.ModelProto``) for ``target``.

    ``input_shapes`` maps input names to static shapes for inputs whose declared shape has
    symbolic dimensions (``{"input_ids": [1, 128]}``); ``constant_inputs`` specialises the model
    on the values of inputs that decide shapes (``{"axes": [1]}``; calls must then pass those
    values). The result takes numpy arrays or torch
    tensors — positionally in the model's input order, by input name, or as one ``{name: array}``
    dict — and returns the outputs in the same kind (``.run(feed)`` mirrors onnxruntime's
    ``InferenceSession.run(None, feed)``).
    """
    from sextant.frontend.onnx import import_onnx

    _check_target(target)
    step = _steps(progress)
    with gc_paused():
        with step("onnx-import"):
            graph = import_onnx(model, input_shapes, constant_inputs=constant_inputs)
        compiled = compile_graph(graph, target=target, arch=arch, pipeline=pipeline,
                                 print_after_all=print_after_all, stream=stream, progress=step)
    return OnnxCompiledModule(compiled)
