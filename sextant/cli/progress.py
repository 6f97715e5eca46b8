"""Progress lines on stderr while ``sextant.compile`` works through its stages.

``sextant.compile`` is one call; to show which stage is running (torch.export and LLVM can take
seconds each) the command wraps the pipeline's stage functions for the duration of the call and
prints a line as each one starts and finishes. Nothing about what they compute changes, and a
stage the pipeline does not reach (or reaches under another name) is simply not shown.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

# (module, function, label): the functions sextant.compile calls, looked up by module attribute
STAGES: tuple[tuple[str, str, str], ...] = (
    ("sextant.api", "capture", "capture: torch.export -> graph IR"),
    ("sextant.graph.passes", "run_pipeline", "graph passes"),
    ("sextant.schedule.program", "schedule", "schedule: fusion, memory plan"),
    ("sextant.codegen.llvm_nvptx", "emit_ptx", "codegen: LLVM NVPTX -> PTX"),
    ("sextant.codegen.ptxas", "assemble", "ptxas: PTX -> cubin"),
    ("sextant.codegen.llvm_cpu", "compile_kernels", "codegen: LLVM -> x86 JIT"),
)


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

    @contextlib.contextmanager
    def watch_compile(self) -> Iterator[None]:
        """Report each stage of the compile pipeline while the block runs."""
        patched: list[tuple[Any, str, Callable]] = []
        try:
            for mod_name, attr, label in STAGES:
                try:
                    mod = importlib.import_module(mod_name)
                except ImportError:
                    continue
                fn = getattr(mod, attr, None)
                if callable(fn):
                    patched.append((mod, attr, fn))
                    setattr(mod, attr, self._wrap(fn, label))
            yield
        finally:
            for mod, attr, fn in reversed(patched):
                setattr(mod, attr, fn)

    def _wrap(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.step(label):
                return fn(*args, **kwargs)

        return wrapper
