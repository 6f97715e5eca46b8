"""The ONNX frontend: ONNX models into sextant's graph IR (see docs/onnx.md).

Importing this package fills ``ONNX_OPS`` with one module per op family.
"""

from sextant.frontend.onnx import (  # noqa: F401
    ops_attention,
    ops_control,
    ops_elementwise,
    ops_nn,
    ops_reduce,
    ops_resample,
    ops_rnn,
    ops_tensor,
)
from sextant.frontend.onnx.importer import OnnxImportError, import_onnx, load, opset_version
from sextant.frontend.onnx.registry import ONNX_OPS, OnnxContext, onnx_op

__all__ = ["ONNX_OPS", "OnnxContext", "OnnxImportError", "import_onnx", "load", "onnx_op", "opset_version"]
