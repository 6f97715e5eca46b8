"""The user's source lines behind graph nodes: ``loc`` says "file.py:LINE", the report shows the code.

Locations keep only the file's base name (to stay short in the IR), so the file is found again
among the modules Python has loaded — the model's own code always is, since it just ran.
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class SourceLine:
    loc: str  # as in the IR: "file.py:LINE"
    path: str | None  # the file it resolved to; None when not found, or when several files share the name
    code: str  # the line's text, stripped ("" when unknown)


def _candidates(basename: str) -> list[str]:
    found = []
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    for f in [main, *(getattr(m, "__file__", None) for m in list(sys.modules.values()))]:
        if f and os.path.basename(f) == basename and os.path.realpath(f) not in found:
            found.append(os.path.realpath(f))
    return found


def source_line(loc: str) -> SourceLine:
    """Resolve ``"file.py:LINE"`` to the file and the code on that line."""
    name, _, line = loc.rpartition(":")
    if not name or not line.isdigit():
        return SourceLine(loc, None, "")
    texts = {}
    for path in _candidates(name):
        code = linecache.getline(path, int(line)).strip()
        if code:
            texts[path] = code
    if len(set(texts.values())) == 1:  # one file, or same-named copies agreeing on this line
        path, code = next(iter(texts.items()))
        return SourceLine(loc, path if len(texts) == 1 else None, code)
    return SourceLine(loc, None, "")
