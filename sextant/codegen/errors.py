"""The code generators' error type."""

from __future__ import annotations

from sextant.errors import SextantError


class CodegenError(SextantError):
    """A kernel cannot be lowered: an unsupported op, ill-typed IR, or a SIMT construct the
    target cannot run (e.g. a barrier under a thread-dependent condition on the CPU)."""
