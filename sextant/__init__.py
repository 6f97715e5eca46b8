"""sextant: compile PyTorch models to NVIDIA GPU code, with every stage visible.

    compiled = sextant.compile(model, (x,))   # capture → graph IR → passes → target
    compiled(x)                               # behaves like model(x)
"""

from sextant.api import compile
from sextant.errors import ExportError, InputError, SextantError, UnsupportedOpError
from sextant.frontend.capture import capture
from sextant.runtime.compiled import CompiledModule

__all__ = ["CompiledModule", "ExportError", "InputError", "SextantError", "UnsupportedOpError", "capture", "compile"]
