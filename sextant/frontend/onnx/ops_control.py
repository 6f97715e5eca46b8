"""ONNX control flow: If, Loop, Scan, resolved or unrolled at compile time."""

from __future__ import annotations
