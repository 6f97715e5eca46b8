"""An ONNX model as an ``nn.Module`` that runs it the established way: what ``sextant run`` and the
tests compare sextant's compiled ONNX models against (onnxruntime, the graph's reference
executor when onnxruntime is not installed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sextant.frontend.onnx.dtypes import to_numpy


class OnnxModel(torch.nn.Module):
    """``forward(*tensors)`` runs the ONNX model in onnxruntime (CPU) and returns torch tensors."""

    def __init__(self, model: Any, input_names: list[str]) -> None:
        super().__init__()
        self.input_names = input_names
        self.num_weights = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
        try:
            import onnxruntime as ort
        except ImportError:
            ort = None
        if ort is not None:
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            self._session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            self.runtime = f"onnxruntime {ort.__version__}"
        else:
            from sextant.frontend.onnx.importer import import_onnx
            from sextant.graph.reference import run_graph

            graph = import_onnx(model)
            self._session = None
            self._run_graph = lambda xs: run_graph(graph, xs)
            self.runtime = "sextant's reference executor (onnxruntime is not installed)"

    def forward(self, *xs: torch.Tensor) -> Any:
        if self._session is None:
            outs = self._run_graph(list(xs))
        else:
            feed = {n: to_numpy(x) for n, x in zip(self.input_names, xs)}
            outs = [torch.from_numpy(np.asarray(o)) for o in self._session.run(None, feed)]
        return outs[0] if len(outs) == 1 else tuple(outs)
