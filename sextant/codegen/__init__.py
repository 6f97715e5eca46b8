"""Code generation: kernel IR → LLVM IR → machine code.

``compile_kernels`` is the CPU flavour (LLVM O3 + MCJIT, SIMT threads as loops; see
``llvm_cpu`` and ``simt``); ``scalar_math`` holds the per-op semantics.
"""

from sextant.codegen.errors import CodegenError
from sextant.codegen.llvm_cpu import compile_kernels, emit_module

__all__ = ["CodegenError", "compile_kernels", "emit_module"]
