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
        self.model = model
        self.input_names = input_names
        self.num_weights = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
        self._run: Any = None  # built on the first call: onnxruntime may reject models sextant would report
        try:
            import onnxruntime as ort

            self.runtime = f"onnxruntime {ort.__version__}"
        except ImportError:
            self.runtime = "sextant's reference executor (onnxruntime is not installed)"

    def _runner(self) -> Any:
        if self._run is None:
            try:
                import onnxruntime as ort
            except ImportError:
                from sextant.frontend.onnx.importer import import_onnx
                from sextant.graph.reference import run_graph

                graph = import_onnx(self.model)
                self._run = lambda xs: run_graph(graph, list(xs))
            else:
                opts = ort.SessionOptions()
                opts.log_severity_level = 3
                session = ort.InferenceSession(self.model.SerializeToString(), opts,
                                               providers=["CPUExecutionProvider"])
                self._run = lambda xs: [torch.from_numpy(np.asarray(o)) for o in session.run(
                    None, {n: to_numpy(x) for n, x in zip(self.input_names, xs)})]
        return self._run

    def forward(self, *xs: torch.Tensor) -> Any:
        outs = self._runner()(xs)
        return outs[0] if len(outs) == 1 else tuple(outs)
