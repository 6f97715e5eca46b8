"""sextant: compile PyTorch models to NVIDIA GPU code, with every stage visible.

    compiled = sextant.compile(model, (x,))   # capture → graph IR → passes → target
    compiled(x)                               # behaves like model(x)
    compiled.save("out/"); sextant.load("out/")  # ahead-of-time artifact, no pickle
    sextant.compile_onnx("model.onnx")        # the second frontend: ONNX files in
"""

from sextant.api import compile, compile_graph, compile_onnx
from sextant.errors import ArtifactError, ExportError, InputError, SextantError, UnsupportedOpError
from sextant.frontend.capture import capture
from sextant.frontend.dynamo import register_if_dynamo_loaded as _register_backend
from sextant.frontend.dynamo import sextant_backend as backend
from sextant.runtime.artifact import load
from sextant.runtime.compiled import CompiledModule

_register_backend()

__all__ = [
    "ArtifactError",
    "CompiledModule",
    "ExportError",
    "InputError",
    "SextantError",
    "UnsupportedOpError",
    "backend",
    "capture",
    "compile",
    "compile_graph",
    "compile_onnx",
    "load",
]
