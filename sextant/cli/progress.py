"""Progress lines on stderr while ``sextant.compile`` works through its stages.

``sextant.compile`` is one call; to show which stage is running (torch.export and LLVM can take
seconds each) the command passes :meth:`Progress.stage` as its ``progress`` hook, which brackets
each stage: a line when it starts, its time when it ends.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO

# what each of ``sextant.compile``'s stages (``sextant.api.STAGES``) is called on the terminal
LABELS: dict[str, str] = {
    "cache": "compile cache: fingerprint, lookup",
    "capture": "capture: torch.export -> graph IR",
    "onnx-import": "import: ONNX -> graph IR",
    "passes": "graph passes",
    "schedule": "schedule: fusion, memory plan",
    "nvptx": "codegen: LLVM NVPTX -> PTX",
    "ptxas": "ptxas: PTX -> cubin",
    "llvm-cpu": "codegen: LLVM -> x86 JIT",
    "load": "load: CUDA module, constants, CUDA graph",
}


class Progress:
    """Writes ``  label ... 1.23 s`` lines to ``stream`` (nothing when disabled)."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self.timings: dict[str, float] = {}  # seconds per label, summed over calls
        self._active = False

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        if self._active:  # a stage called from inside another is part of it
            yield
            return
        self._active = True
        if self.enabled:
            self.stream.write(f"  {label} ...")
            self.stream.flush()
        t0 = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            dt = time.perf_counter() - t0
            self.timings[label] = self.timings.get(label, 0.0) + dt
            self._active = False
            if self.enabled:
                self.stream.write(f" {dt:.2f} s\n" if ok else " failed\n")
                self.stream.flush()

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        """The ``progress`` hook for ``sextant.compile``: one line per compile stage."""
        return self.step(LABELS.get(name, name))
