"""The compile step every subcommand shares: MODEL → ``sextant.compile`` → a :class:`Build`.

It adds what a terminal user needs around ``sextant.compile``: progress on stderr, the graph
after every pass (for ``--dump passes`` and ``explain``), a check for ptxas and a GPU before
starting, and the substitution of ``cuda-sim`` for ``cuda`` when only code is wanted and the
machine has no GPU (both generate the same kernels and PTX; only where they run differs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import sextant
from sextant.api import TARGETS as API_TARGETS
from sextant.cli.errors import CliError, ExitCode
from sextant.cli.models import LoadedModel
from sextant.cli.progress import Progress
from sextant.cli.work import work_lines
from sextant.graph.passes import PASSES, PIPELINES, PassResult, trace_pipeline
from sextant.runtime.compiled import CompiledModule
from sextant.runtime.onnx_module import OnnxCompiledModule

TARGETS = ("cpu", "cuda", "cuda-sim")
GPU_TARGETS = ("cuda", "cuda-sim")


@dataclass
class Build:
    """A compiled model and what the CLI learned while compiling it."""

    model: LoadedModel
    requested_target: str  # what the user asked for
    # compiled.target may be cuda-sim where cuda was asked for (see notes)
    compiled: CompiledModule | OnnxCompiledModule
    arch: str
    pipeline: str | list[str]
    seconds: float
    timings: dict[str, float]  # seconds per compile stage, as far as they were observed
    notes: list[str] = field(default_factory=list)
    _trace: list[PassResult] | None = None

    @property
    def target(self) -> str:
        return self.compiled.target

    @property
    def is_gpu(self) -> bool:
        return self.compiled.target in GPU_TARGETS

    @property
    def trace(self) -> list[PassResult]:
        """Every pass run on the captured graph, in order (recomputed on demand: passes are cheap)."""
        if self._trace is None:
            self._trace = trace_pipeline(self.compiled.stages["captured"], self.pipeline)
        return self._trace


def parse_pipeline(text: str) -> str | list[str]:
    """``default`` (a named pipeline) or ``simplify,cse,dce`` (pass names, run once each)."""
    if text in PIPELINES:
        return text
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES]
    if not names or unknown:
        raise CliError(f"unknown pipeline or pass(es) {unknown or [text]}",
                       f"pipelines: {', '.join(sorted(PIPELINES))}; passes: {', '.join(sorted(PASSES))}",
                       ExitCode.USAGE)
    return names


def cuda_unavailable() -> str | None:
    """Why ``target="cuda"`` cannot run here (no GPU, no cuda-python), or None when it can. Asks the
    CUDA runtime itself, so the CLI and ``sextant.compile`` never disagree."""
    try:
        from sextant.runtime.cuda import require_cuda

        require_cuda()
    except Exception as e:  # CudaUnavailableError, or the runtime failing to import
        return str(e).split("; target='cuda-sim'")[0]
    return None


def check_ptxas() -> None:
    from sextant.codegen.ptxas import PtxasError, find_ptxas

    try:
        find_ptxas()
    except PtxasError as e:
        raise CliError(str(e).split(";")[0], "install the CUDA toolkit or `pip install nvidia-cuda-nvcc`, "
                       "or use --target cpu", ExitCode.ENVIRONMENT) from e


def build(model: LoadedModel, target: str, *, arch: str | None = None, pipeline: str | Sequence[str] = "default",
          progress: Progress | None = None, need_gpu: bool = False, strict: bool = False,
          verbose: bool = False) -> Build:
    """Compile ``model`` for ``target``. Without a GPU, ``cuda`` is compiled as ``cuda-sim`` (noted),
    unless ``need_gpu`` (the caller wants to run on the GPU): then a :class:`CliError` says so.
    ``arch`` None: sm_90 for cuda-sim, the GPU's own for cuda. ``verbose``: the progress ends with
    what the compile produced, in counts (graph nodes, kernels, statements: ``cli/work.py``)."""
    progress = progress or Progress(enabled=False)
    if target not in TARGETS:
        raise CliError(f"unknown target {target!r}", f"choose one of {', '.join(TARGETS)}", ExitCode.USAGE)
    notes: list[str] = []
    compile_target = target
    if target == "cuda" and (reason := cuda_unavailable()) is not None:
        if need_gpu:
            raise CliError(f"--target cuda cannot run here: {reason}",
                           "use --target cuda-sim to run the same GPU kernels on the CPU", ExitCode.ENVIRONMENT)
        compile_target = "cuda-sim"
        notes.append("no usable GPU here: --target cuda was compiled through cuda-sim, which generates the "
                     "identical kernels, PTX and cubin")
    if compile_target not in API_TARGETS:
        raise CliError(f"target {compile_target!r} is not implemented in this version of sextant",
                       f"available: {', '.join(t for t in TARGETS if t in API_TARGETS)}", ExitCode.ENVIRONMENT)
    if compile_target == "cuda-sim":
        check_ptxas()  # cuda-sim needs ptxas; cuda falls back to the driver's PTX JIT without it
        arch = arch or "sm_90"
    pipeline = list(pipeline) if not isinstance(pipeline, str) else pipeline
    progress.note(f"compiling {model.name} ({type(model.module).__name__}) for {compile_target}"
                  + (f" {arch}" if arch and compile_target in GPU_TARGETS else ""))
    t0 = time.perf_counter()
    if model.onnx is not None:
        compiled = sextant.compile_onnx(model.onnx, model.input_shapes, target=compile_target, arch=arch,
                                        pipeline=pipeline, progress=progress.stage)
    else:
        compiled = sextant.compile(model.module, model.args, model.kwargs or None, target=compile_target,
                                   arch=arch, pipeline=pipeline, progress=progress.stage, strict=strict,
                                   cache=False)  # the CLI shows every stage: it needs the capture's
    seconds = time.perf_counter() - t0
    progress.note(f"compiled in {seconds:.2f} s")
    if verbose:
        for line in work_lines(compiled.stages):
            progress.note(line)
    ptx = compiled.stages.get("ptx")
    return Build(model, target, compiled, ptx.arch if ptx is not None else "", pipeline, seconds,
                 dict(progress.timings), notes)
