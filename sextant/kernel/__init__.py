"""Kernel IR (``ir``) and the tools that work on it without generating code: a printer, range
analysis, an exact simplifier and a verifier."""

from sextant.kernel.printer import print_expr, print_kernel
from sextant.kernel.ranges import Ranges, bounds, eval_expr
from sextant.kernel.simplify import simplify_expr, simplify_kernel
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

__all__ = [
    "KernelVerificationError",
    "Ranges",
    "bounds",
    "eval_expr",
    "print_expr",
    "print_kernel",
    "simplify_expr",
    "simplify_kernel",
    "verify_kernel",
]
