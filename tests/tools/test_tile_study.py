"""``tools/tile_study`` works up to the GPU calls: ``--dry-run`` compiles every candidate and
variant tile for cuda-sim (the same kernels and PTX as on a GPU), checks each against the f32
product and writes the table — so a GPU session is not spent on a harness bug."""

from __future__ import annotations

from pathlib import Path

import pytest

from sextant.schedule import gpu_mma
from sextant.tools import tile_study


@pytest.mark.slow  # ~35 s; make test-slow
def test_dry_run_compiles_and_checks_every_tile(tmp_path: Path) -> None:
    out = tmp_path / "tiles.md"
    code = tile_study.main(["--dry-run", "--variants", "--shapes", "4096x4096x4096", "--dtypes", "bf16",
                            "--out", str(out)])
    assert code == 0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| 80×96×72")]
    tiles = gpu_mma.CANDIDATES + tile_study.VARIANTS
    assert len(rows) == len(tiles)
    assert sorted(int(r[3]) for r in rows) == list(range(1, len(tiles) + 1))  # a model rank each
    for row, tile in zip(rows, tiles, strict=True):
        assert row[2].startswith(f"{tile.bm}×{tile.bn}×{tile.bk} ({tile.stages})")
        assert row[2].endswith("*") == (tile not in gpu_mma.CANDIDATES)
        assert int(row[8]) <= tile.registers  # ptxas kept to the tile's .maxnreg
        assert row[9].startswith("max err") and float(row[9].split()[-1]) < 5e-2


def test_forced_tile_is_restored() -> None:
    before = gpu_mma.choose_tile
    with tile_study.forced_tile(tile_study.VARIANTS[0]):
        assert gpu_mma.choose_tile(1, 1, 1, None) is tile_study.VARIANTS[0]
    assert gpu_mma.choose_tile is before
