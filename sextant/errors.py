"""User-facing errors. Each names the cause in the user's terms (op, source line, argument)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnsupportedOp:
    """One occurrence of an ATen op sextant cannot lower."""

    op: str  # e.g. "aten.sort.default"
    source: str  # "path/to/model.py:42" or "<unknown source>"
    code: str  # the source line's text, if known
    module: str  # nn.Module path, e.g. "encoder.layers.0 (TransformerBlock)"
    reason: str = ""


class SextantError(Exception):
    """Base class of sextant's own errors."""


class UnsupportedOpError(SextantError):
    """The model uses ATen ops (or argument combinations) sextant has no lowering for."""

    def __init__(self, items: list[UnsupportedOp], *, frontend: str = "ATen",
                 hint: str = "Support for an op is added as a lowering in sextant/frontend/lowerings/ "
                             "(see docs/frontend.md, 'Adding an op').") -> None:
        self.items = items
        self.frontend = frontend
        self.needs_values: list[str] = []  # ONNX: inputs whose values would make the model compile
        ops = sorted({i.op for i in items})
        lines = [f"sextant cannot compile this model: {len(ops)} unsupported {frontend} op(s): {', '.join(ops)}"]
        for it in items:
            where = f"{it.source}" + (f"  in {it.module}" if it.module else "")
            lines.append(f"  - {it.op} at {where}")
            if it.code:
                lines.append(f"        {it.code}")
            if it.reason:
                lines.append(f"      reason: {it.reason}")
        lines.append(hint)
        super().__init__("\n".join(lines))

    def __reduce__(self):  # picklable across worker processes (the ONNX conformance tool's pool)
        return (_rebuild_unsupported, (self.items, self.frontend, str(self).splitlines()[-1]))


def _rebuild_unsupported(items: list[UnsupportedOp], frontend: str, hint: str) -> UnsupportedOpError:
    return UnsupportedOpError(items, frontend=frontend, hint=hint)


class ExportError(SextantError):
    """torch.export could not capture the model; the original error is chained as __cause__."""


class InputError(SextantError, ValueError):
    """A compiled module was called with arguments that do not match the example inputs."""


class ArtifactError(SextantError, ValueError):
    """A saved artifact directory cannot be written, or is missing, corrupted or mismatched when loaded."""


class CollectiveError(SextantError, RuntimeError):
    """A collective failed, or the ranks compiled programs whose collectives differ (``runtime/collectives.py``)."""
