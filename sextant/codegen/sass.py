"""SASS (the GPU's machine code) from the cubin ptxas wrote, via NVIDIA's disassemblers.

``nvdisasm`` or ``cuobjdump`` come with the CUDA toolkit, or from PyPI (``nvidia-cuda-nvdisasm``,
5 MB), which the ``dev`` extra installs. They need no GPU. When neither is found, SASS is skipped
with a note saying why, not an error: it is an extra view, not something compilation needs.
Used by the ``sextant`` command's ``--dump sass`` and by the compile report.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from sextant.codegen.cuda_tools import find_cuda_tool

TOOLS = ("nvdisasm", "cuobjdump")
TIMEOUT_S = 120
MISSING = ("neither nvdisasm nor cuobjdump was found on PATH, in $CUDA_HOME/bin or in the nvidia-cuda-nvdisasm "
           "wheel (pip install nvidia-cuda-nvdisasm)")


def find_disassembler() -> Path | None:
    """nvdisasm (preferred: its output has one section per kernel) or cuobjdump, wherever installed."""
    return next((p for p in map(find_cuda_tool, TOOLS) if p is not None), None)


def disassemble(cubin: bytes, tool: Path) -> str:
    """The whole cubin's SASS; raises RuntimeError with the tool's message if it fails."""
    with tempfile.TemporaryDirectory(prefix="sextant-sass-") as tmp:
        path = Path(tmp) / "module.cubin"
        path.write_bytes(cubin)
        cmd = [str(tool), "-c", str(path)] if tool.name.startswith("nvdisasm") else [str(tool), "-sass", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool.name} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def split_sass(text: str, names: list[str] | None = None) -> dict[str, str]:
    """Each kernel's part of a disassembly (of ``names``, or of every kernel found): nvdisasm's
    ``.text.NAME`` sections, or cuobjdump's ``Function : NAME`` blocks."""
    starts: list[tuple[int, str]] = []  # every section header ends the previous kernel's part
    for m in re.finditer(r"^//-{5,} (\S+)\s+-{5,}$|^\s*Function : (\S+)$", text, re.M):
        section = m.group(1)
        starts.append((m.start(), section.removeprefix(".text.") if section else m.group(2)))
    parts: dict[str, str] = {}
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        parts[name] = text[pos:end].rstrip() + "\n"
    return parts if names is None else {n: parts[n] for n in names if n in parts}
