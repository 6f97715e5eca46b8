"""ONNX reductions and normalisations: Reduce*, ArgMax/ArgMin, Softmax family, *Normalization."""

from __future__ import annotations
