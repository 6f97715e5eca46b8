"""The compile step every subcommand shares: MODEL → ``sextant.compile`` → a :class:`Build`.

It adds what a terminal user needs around ``sextant.compile``: progress on stderr, the graph
after every pass (for ``--dump passes`` and ``explain``), a check for ptxas and a GPU before
starting, and the substitution of ``cuda-sim`` for ``cuda`` when only code is wanted and the
machine has no GPU (both generate the same kernels and PTX; only where they run differs).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import sextant
from sextant.api import TARGETS as API_TARGETS
from sextant.cli.errors import CliError, ExitCode
from sextant.cli.models import LoadedModel
from sextant.cli.progress import Progress
from sextant.graph.passes import PASSES, PIPELINES, PassResult, trace_pipeline
from sextant.runtime.compiled import CompiledModule

TARGETS = ("cpu", "cuda", "cuda-sim")
GPU_TARGETS = ("cuda", "cuda-sim")


@dataclass
class Build:
    """A compiled model and what the CLI learned while compiling it."""

    model: LoadedModel
    requested_target: str  # what the user asked for
    compiled: CompiledModule  # compiled.target may be cuda-sim where cuda was asked for (see notes)
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


def gpu_present() -> bool:
    """Whether the CUDA driver loads and sees at least one GPU (asked directly, so it works without
    cuda-python and with a CPU-only torch)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    try:
        if lib.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        return lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except AttributeError:
        return False


def check_ptxas() -> None:
    from sextant.codegen.ptxas import PtxasError, find_ptxas

    try:
        find_ptxas()
    except PtxasError as e:
        raise CliError(str(e).split(";")[0], "install the CUDA toolkit or `pip install nvidia-cuda-nvcc`, "
                       "or use --target cpu", ExitCode.ENVIRONMENT) from e


def build(model: LoadedModel, target: str, *, arch: str = "sm_90", pipeline: str | Sequence[str] = "default",
          progress: Progress | None = None, need_gpu: bool = False) -> Build:
    """Compile ``model`` for ``target``. Without a GPU, ``cuda`` is compiled as ``cuda-sim`` (noted),
    unless ``need_gpu`` (the caller wants to run on the GPU): then a :class:`CliError` says so."""
    progress = progress or Progress(enabled=False)
    if target not in TARGETS:
        raise CliError(f"unknown target {target!r}", f"choose one of {', '.join(TARGETS)}", ExitCode.USAGE)
    notes: list[str] = []
    compile_target = target
    if target == "cuda" and not gpu_present():
        if need_gpu:
            raise CliError("no NVIDIA GPU is present (the CUDA driver, libcuda.so.1, is missing or sees no device)",
                           "use --target cuda-sim to run the same GPU kernels on the CPU", ExitCode.ENVIRONMENT)
        compile_target = "cuda-sim"
        notes.append("no GPU here: --target cuda was compiled through cuda-sim, which generates the identical "
                     "kernels, PTX and cubin")
    if compile_target not in API_TARGETS:
        raise CliError(f"target {compile_target!r} is not implemented in this version of sextant",
                       f"available: {', '.join(t for t in TARGETS if t in API_TARGETS)}", ExitCode.ENVIRONMENT)
    if compile_target in GPU_TARGETS:
        check_ptxas()
    pipeline = list(pipeline) if not isinstance(pipeline, str) else pipeline
    progress.note(f"compiling {model.name} ({type(model.module).__name__}) for {compile_target}"
                  + (f" {arch}" if compile_target in GPU_TARGETS else ""))
    t0 = time.perf_counter()
    with progress.watch_compile():
        compiled = sextant.compile(model.module, model.args, model.kwargs or None, target=compile_target,
                                   arch=arch, pipeline=pipeline)
    seconds = time.perf_counter() - t0
    progress.note(f"compiled in {seconds:.2f} s")
    return Build(model, target, compiled, arch, pipeline, seconds, dict(progress.timings), notes)
