"""ONNX attention ops."""

from __future__ import annotations
