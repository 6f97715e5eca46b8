"""ONNX resampling ops."""

from __future__ import annotations
