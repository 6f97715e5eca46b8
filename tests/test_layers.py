"""Imports point down the pipeline: the lower layers (graph IR, kernel IR, scheduling, code
generation) never import a later stage, at module level or inside a function. ``codegen`` used to
import the runtime's ``CpuModule`` and the scheduler's shared-memory table, ``schedule`` the PTX
lowering's shared-memory layout and the report's GPU datasheets; all moved down a layer
(``codegen/cpu_module.py``, ``kernel/devices.py``, ``kernel/shared_memory.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sextant

ROOT = Path(sextant.__file__).parent
SHARED = {"errors", "work", "host", "gcpause"}  # small top-level modules every layer may use
ALLOWED = {
    "graph": {"graph"},
    "kernel": {"kernel", "graph"},
    "codegen": {"codegen", "kernel", "graph"},
    "schedule": {"schedule", "kernel", "graph"},
}


def _imported_packages(path: Path) -> set[tuple[str, int]]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "sextant" and len(parts) > 1:
                out.add((parts[1], node.lineno))
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_lower_layers_import_nothing_later(layer: str) -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line} imports sextant.{pkg}"
             for p in sorted((ROOT / layer).rglob("*.py"))
             for pkg, line in sorted(_imported_packages(p))
             if pkg not in ALLOWED[layer] | SHARED]
    assert not wrong, "\n".join(wrong)
