"""Work counters: how many items (graph nodes visited, kernels generated, ...) a compile did.

Tests assert that these grow linearly with the model. Counts do not depend on the machine or
its load, so a scaling bug shows up as a ratio, not as a flaky wall-clock threshold.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkCounter:
    """Work items per kind (``"fusion: reaches"``, ``"kernels: generated"``, ...)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int = 1) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    def total(self, prefix: str = "") -> int:
        """The sum of the counts whose kind starts with ``prefix``."""
        return sum(v for k, v in self.counts.items() if k.startswith(prefix))
