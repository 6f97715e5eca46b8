"""ptxas: assemble PTX into a cubin and read back what each kernel costs.

No GPU is needed: ptxas is NVIDIA's PTX → SASS assembler, the step the driver would otherwise do
at load time. It is the authority on whether our PTX is valid for an architecture, and its
``-v`` report (registers, shared memory, spills, stack) is how register pressure and occupancy
are judged before running anything.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sextant.codegen.cuda_tools import find_cuda_tool
from sextant.codegen.errors import CodegenError

TIMEOUT_S = 300


class PtxasError(CodegenError):
    """ptxas is missing or rejected the PTX (the message carries its diagnostics)."""


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one ``.entry``."""

    name: str
    registers: int
    shared_bytes: int = 0  # static shared memory
    stack_frame: int = 0  # bytes per thread (local arrays, spills)
    spill_stores: int = 0  # bytes
    spill_loads: int = 0
    barriers: int = 0
    constant_bytes: int = 0  # cmem[0]: kernel parameters and the like


@dataclass(frozen=True)
class PtxasResult:
    arch: str
    cubin: bytes
    kernels: dict[str, KernelResources]
    log: str  # ptxas's -v output
    seconds: float = field(default=0.0, compare=False)


def find_ptxas() -> Path:
    """ptxas from ``PATH``, the CUDA toolkit (``$CUDA_HOME/bin`` or /usr/local/cuda/bin), or
    PyPI's ``nvidia-cuda-nvcc`` wheel."""
    found = find_cuda_tool("ptxas")
    if found is None:
        raise PtxasError("ptxas was not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin, nor in the "
                         "nvidia-cuda-nvcc wheel; install the CUDA toolkit or `pip install nvidia-cuda-nvcc`")
    return found


def assemble(ptx: str, arch: str, extra_args: tuple[str, ...] = ()) -> PtxasResult:
    """``ptxas -arch=ARCH -v`` on ``ptx``: the cubin and per-kernel resources; raises
    :class:`PtxasError` with ptxas's diagnostics if it rejects the PTX."""
    exe = find_ptxas()
    with tempfile.TemporaryDirectory(prefix="sextant-ptxas-") as tmp:
        src, out = Path(tmp) / "module.ptx", Path(tmp) / "module.cubin"
        src.write_text(ptx)
        cmd = [str(exe), f"-arch={arch}", "-v", *extra_args, str(src), "-o", str(out)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise PtxasError(f"ptxas took over {TIMEOUT_S} s: {' '.join(cmd)}") from e
        seconds = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise PtxasError(f"ptxas -arch={arch} failed (exit {proc.returncode}):\n{log.strip()}{_context(ptx, log)}")
        cubin = out.read_bytes()
    return PtxasResult(arch, cubin, parse_resources(log), log, seconds)


def parse_resources(log: str) -> dict[str, KernelResources]:
    """Per-entry resources from ptxas ``-v`` output, e.g.::

        ptxas info    : Compiling entry function 'k' for 'sm_90'
        ptxas info    : Function properties for k
            8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 13 registers, used 1 barriers, 512 bytes smem, 368 bytes cmem[0]
    """
    found: dict[str, dict[str, int]] = {}
    entry: str | None = None  # the entry being compiled
    props: str | None = None  # the function whose properties come next
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            entry = m.group(1)
            found[entry] = {}
        elif m := re.search(r"Function properties for (\S+)", line):
            props = m.group(1)
        elif "stack frame" in line and props is not None:
            if props == entry:
                for key, pat in (("stack_frame", r"(\d+) bytes stack frame"),
                                 ("spill_stores", r"(\d+) bytes spill stores"),
                                 ("spill_loads", r"(\d+) bytes spill loads")):
                    if m := re.search(pat, line):
                        found[entry][key] = int(m.group(1))
            props = None
        elif (m := re.search(r"Used (\d+) registers", line)) and entry is not None:
            d = found[entry]
            d["registers"] = int(m.group(1))
            for key, pat in (("barriers", r"used (\d+) barriers"), ("shared_bytes", r"(\d+) bytes smem"),
                             ("constant_bytes", r"(\d+) bytes cmem\[0\]")):
                if m := re.search(pat, line):
                    d[key] = int(m.group(1))
    return {name: KernelResources(name, **d) for name, d in found.items() if "registers" in d}


def _context(ptx: str, log: str, around: int = 3, most: int = 3) -> str:
    """The PTX lines ptxas complains about (``module.ptx, line N; error``), with neighbours."""
    lines = ptx.splitlines()
    shown = []
    for n in sorted({int(x) for x in re.findall(r"line (\d+)[;:]", log)})[:most]:
        lo, hi = max(n - 1 - around, 0), min(n + around, len(lines))
        shown.append("\n".join(f"{'>' if i + 1 == n else ' '}{i + 1:5d}  {lines[i]}" for i in range(lo, hi)))
    return "\n\nin the PTX:\n" + "\n...\n".join(shown) if shown else ""
