"""Cut whole-module texts into per-kernel listings: LLVM IR functions, PTX entries, SASS.

Every target emits one module for all kernels; the report shows each kernel its own slice.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_LLVM_DEFINE = re.compile(r'^define\b[^@\n]*@"?([\w.$]+)"?\(.*?^}$', re.MULTILINE | re.DOTALL)
_PTX_ENTRY = re.compile(r"^(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)\s*\(")
# nvdisasm opens each kernel with a "//----- .text.NAME -----" banner, cuobjdump with "Function : NAME"
_SASS_FUNCTION = re.compile(r"^(?://-+\s*\.text\.|\s*Function\s*:\s*)([\w$]+)", re.MULTILINE)


def llvm_functions(module_text: str) -> dict[str, str]:
    """Each ``define`` of an LLVM IR module, by function name."""
    return {m.group(1): m.group(0) for m in _LLVM_DEFINE.finditer(module_text)}


def ptx_entries(ptx: str) -> dict[str, str]:
    """Each ``.entry`` of a PTX module (header to closing brace), by kernel name."""
    out: dict[str, str] = {}
    lines = ptx.splitlines()
    i = 0
    while i < len(lines):
        m = _PTX_ENTRY.match(lines[i])
        if not m:
            i += 1
            continue
        start, depth, opened = i, 0, False
        while i < len(lines):
            depth += lines[i].count("{") - lines[i].count("}")
            opened = opened or "{" in lines[i]
            i += 1
            if opened and depth == 0:
                break
        out[m.group(1)] = "\n".join(lines[start:i])
    return out


def _tool(name: str) -> str | None:
    """A CUDA tool from PATH, /usr/local/cuda/bin, or PyPI's nvidia-* wheels (``nvidia/cu13/bin``)."""
    found = shutil.which(name)
    if found:
        return found
    dirs = [Path("/usr/local/cuda/bin")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        dirs += [Path(root) / "cu13" / "bin", Path(root) / "cu12" / "bin"]
    return next((str(d / name) for d in dirs if (d / name).is_file()), None)


def find_disassembler() -> list[str] | None:
    """``nvdisasm -c`` or ``cuobjdump -sass`` (pip: nvidia-cuda-nvdisasm); None when neither is installed."""
    for name, args in (("nvdisasm", ["-c"]), ("cuobjdump", ["-sass"])):
        exe = _tool(name)
        if exe:
            return [exe, *args]
    return None


def sass_functions(cubin: bytes, timeout_s: float = 120) -> dict[str, str] | None:
    """SASS of each kernel in ``cubin``, by name; None when no disassembler is installed."""
    cmd = find_disassembler()
    if cmd is None or not cubin:
        return None
    with tempfile.TemporaryDirectory(prefix="sextant-sass-") as tmp:
        path = Path(tmp) / "module.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed on the cubin (exit {proc.returncode}): {proc.stderr.strip()}")
    starts = list(_SASS_FUNCTION.finditer(proc.stdout))
    return {m.group(1): proc.stdout[m.start(): nxt.start() if nxt else len(proc.stdout)].strip("\n")
            for m, nxt in zip(starts, [*starts[1:], None])}
