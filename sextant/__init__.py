"""sextant: compile PyTorch models to NVIDIA GPU code, with every stage visible."""

from sextant.errors import ExportError, InputError, SextantError, UnsupportedOpError
from sextant.frontend.capture import capture

__all__ = ["ExportError", "InputError", "SextantError", "UnsupportedOpError", "capture"]
