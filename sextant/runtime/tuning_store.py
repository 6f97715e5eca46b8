"""The on-disk store of measured tile choices (written by ``sextant.tools.tune``, read by compiles).

One JSON file per GPU architecture, ``<dir>/<arch>.json``, mapping each problem's key
(``schedule.tuning.TileProblem.key``) to the measured candidates::

    {"format": 1, "entries": {"wgmma/sm_90a/f16/4096x4096x4096*1":
        {"tile": "128x256/s4/ws", "times_ms": {"128x256/s4/ws": 0.231, ...},
         "device": "NVIDIA H200", "measured": "2026-12-07T14:02:11Z"}}}

The directory is ``$SEXTANT_TUNING`` when that names one, ``<cache dir>/tuning`` otherwise
(``SEXTANT_CACHE_DIR``, default ``~/.cache/sextant``); ``SEXTANT_TUNING=0`` (or ``SEXTANT_CACHE=0``
without ``SEXTANT_TUNING``) turns it off, and every compile uses the cost model. The test suite
runs with it off, so that no earlier measurement changes what a test compiles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sextant.schedule.tuning import NO_TILES, TileProblem, TileTable

log = logging.getLogger("sextant.tuning")
FORMAT = 1
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Measured:
    """One problem's timings: milliseconds per call of each candidate, on ``device``."""

    times_ms: Mapping[str, float]
    device: str

    @property
    def best(self) -> str:
        return min(self.times_ms, key=lambda name: self.times_ms[name])


def tuning_dir() -> Path | None:
    """Where measured choices live, or None when the store is off."""
    setting = os.environ.get("SEXTANT_TUNING", "").strip()
    if setting.lower() in _OFF:
        return None
    if setting:
        return Path(setting)
    from sextant.codegen.objects import cache_dir

    root = cache_dir()
    return None if root is None else root / "tuning"


def _path(arch: str) -> Path | None:
    root = tuning_dir()
    return None if root is None else root / f"{arch}.json"


def _entries(path: Path) -> dict[str, dict]:
    """The file's entries; a file that is not the store's format is reported and ignored."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("sextant: ignoring the tuning file %s (%s)", path, e)
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        log.warning("sextant: ignoring the tuning file %s (not format %d)", path, FORMAT)
        return {}
    return data["entries"]


def load_table(arch: str) -> TileTable:
    """The stored choices for ``arch`` as a table a target carries (empty when there are none)."""
    path = _path(arch)
    if path is None:
        return NO_TILES
    choices = {}
    for key, entry in _entries(path).items():
        try:
            problem = TileProblem.parse(key)
        except ValueError as e:
            log.warning("sextant: ignoring a tuning entry in %s: %s", path, e)
            continue
        if problem.arch == arch and isinstance(entry, dict) and isinstance(entry.get("tile"), str):
            choices[problem] = entry["tile"]
    return TileTable.of(choices)


def save(arch: str, results: Mapping[TileProblem, Measured]) -> Path:
    """Merge ``results`` into ``arch``'s file (a problem measured again is replaced), atomically."""
    path = _path(arch)
    if path is None:
        raise RuntimeError("the tuning store is off (SEXTANT_TUNING=0 or SEXTANT_CACHE=0); "
                           "set SEXTANT_TUNING to a directory to keep the measurements")
    entries = _entries(path)
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for problem, m in results.items():
        entries[problem.key] = {"tile": m.best, "times_ms": {k: round(v, 6) for k, v in m.times_ms.items()},
                                "device": m.device, "measured": when}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{arch}-", suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": FORMAT, "entries": dict(sorted(entries.items()))}, f, indent=1)
    os.replace(tmp, path)
    return path


def fingerprint(arch: str | None = None) -> str:
    """A hash of the choices stored for ``arch`` (every architecture's when None: ``target="cuda"``
    learns its arch from the device only later): compile-cache keys of GPU targets include it, so
    a new measurement recompiles instead of loading a module built on the old tiles. Hashes what
    :func:`load_table` reads, so a half-written temporary file (a run cut short) changes nothing."""
    root = tuning_dir()
    h = hashlib.sha256(b"tuning")
    if root is None or not root.is_dir():
        return h.hexdigest()
    arches = [arch] if arch else sorted(f.stem for f in root.glob("*.json") if not f.name.startswith("."))
    for a in arches:
        h.update(f"{a}\0{load_table(a).entries!r}\0".encode())
    return h.hexdigest()
