"""Cut whole-module texts into per-kernel listings: LLVM IR functions and SASS (PTX entries:
``sextant.codegen.llvm_nvptx.ptx_entries``; the disassembler: ``sextant.codegen.sass``).

Every target emits one module for all kernels; the report shows each kernel its own slice.
"""

from __future__ import annotations

import re

from sextant.codegen.sass import disassemble, find_disassembler, split_sass

_LLVM_DEFINE = re.compile(r'^define\b[^@\n]*@"?([\w.$]+)"?\(.*?^}$', re.MULTILINE | re.DOTALL)


def llvm_functions(module_text: str) -> dict[str, str]:
    """Each ``define`` of an LLVM IR module, by function name."""
    return {m.group(1): m.group(0) for m in _LLVM_DEFINE.finditer(module_text)}


def sass_functions(cubin: bytes) -> dict[str, str] | None:
    """SASS of each kernel in ``cubin``, by name; None when no disassembler is installed."""
    tool = find_disassembler()
    if tool is None or not cubin:
        return None
    return {name: text.strip("\n") for name, text in split_sass(disassemble(cubin, tool)).items()}
