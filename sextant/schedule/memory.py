"""Memory planning: intermediate buffers share one arena, reused by liveness.

A buffer lives from the launch that writes it to the last launch that reads it. Buffers are
placed largest first at the lowest offset that does not overlap a placed buffer whose
lifetime overlaps (greedy best-offset, as in TFLite's and XLA's planners).
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64


@dataclass(frozen=True)
class Interval:
    key: int
    size: int  # bytes
    first: int  # launch index of the writer
    last: int  # launch index of the last reader


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(intervals: list[Interval]) -> tuple[dict[int, int], int]:
    """Offsets by key, and the arena size in bytes."""
    placed: list[tuple[int, int, Interval]] = []  # (offset, aligned size, interval)
    offsets: dict[int, int] = {}
    for iv in sorted(intervals, key=lambda iv: (-iv.size, iv.first, iv.key)):
        size = _align(max(iv.size, 1))
        busy = sorted((o, o + s) for o, s, other in placed if not (other.last < iv.first or iv.last < other.first))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        offsets[iv.key] = offset
        placed.append((offset, size, iv))
    return offsets, max((o + s for o, s, _ in placed), default=0)
