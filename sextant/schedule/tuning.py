"""Measured tile choices: which candidate a tensor-core GEMM or convolution uses, per problem.

Each GPU mapping that picks a block tile (``gpu_mma``, ``gpu_tf32``, ``gpu_conv``, ``gpu_wgmma``,
``gpu_wgmma_conv``) ranks a small set of verified candidates with the cost model
(``schedule/gemm_cost.py``) or a heuristic. An autotuner (``sextant.tools.tune``) times those same
candidates on a real GPU and stores the winner per problem; a :class:`TileTable` carries the
stored winners into a compile, on the target (:attr:`TargetDesc.tiles`), so a schedule stays a
pure function of its inputs — no global knob. A problem the table does not know, or a stored
name that is no longer a candidate (the candidate set changed since it was measured), falls back
to the model.

Every kernel built on a chosen tile records its :class:`TileProblem` and the candidates it could
have used in its ``meta`` (``"problem"``, ``"candidates"``): that is how the tuner finds a
model's problems without re-deriving them from the graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from sextant.graph.dtypes import DType

if TYPE_CHECKING:
    from sextant.schedule.target import TargetDesc


class NamedTile(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=NamedTile)


@dataclass(frozen=True, order=True)
class TileProblem:
    """One tile decision: the mapping that makes it, its ``m × n`` output (× ``batch``), its
    reduction length ``k``, the operands' dtype and the GPU architecture. For convolutions ``m``,
    ``n``, ``k`` are those of the implicit GEMM (as the mapping sees them)."""

    mapping: str  # "mma", "tf32", "conv-mma", "wgmma", "conv-wgmma"
    m: int
    n: int
    k: int
    batch: int
    dtype: str
    arch: str

    @property
    def key(self) -> str:
        """The textual form, as stored: ``wgmma/sm_90a/f16/4096x4096x4096*1`` (m×n×k*batch)."""
        return f"{self.mapping}/{self.arch}/{self.dtype}/{self.m}x{self.n}x{self.k}*{self.batch}"

    @classmethod
    def parse(cls, key: str) -> TileProblem:
        try:
            mapping, arch, dtype, sizes = key.split("/")
            mnk, batch = sizes.split("*")
            m, n, k = (int(x) for x in mnk.split("x"))
            return cls(mapping, m, n, k, int(batch), dtype, arch)
        except ValueError:
            raise ValueError(f"not a tile problem: {key!r} (expected mapping/arch/dtype/MxNxK*batch)") from None


@dataclass(frozen=True)
class TileTable:
    """Chosen candidate names per problem (immutable and hashable, so it can sit on a target)."""

    entries: tuple[tuple[TileProblem, str], ...] = field(default=())

    @classmethod
    def of(cls, choices: Mapping[TileProblem, str] | Iterable[tuple[TileProblem, str]]) -> TileTable:
        items = choices.items() if isinstance(choices, Mapping) else choices
        return cls(tuple(sorted(dict(items).items())))

    def get(self, problem: TileProblem) -> str | None:
        for p, name in self.entries:
            if p == problem:
                return name
        return None

    def __len__(self) -> int:
        return len(self.entries)


NO_TILES = TileTable()


def pick(problem: TileProblem, table: TileTable, candidates: Sequence[T], default: T) -> tuple[T, dict]:
    """The tile for ``problem``: the table's entry when it names one of ``candidates``, else
    ``default`` (the model's choice); with the ``meta`` a kernel records about the choice."""
    chosen, source = default, "model"
    name = table.get(problem)
    if name is not None:
        found = [t for t in candidates if t.name == name]
        if found:
            chosen, source = found[0], "tuned"
    meta = {"problem": problem.key, "candidates": tuple(t.name for t in candidates), "tile_name": chosen.name,
            "tile_source": source}
    return chosen, meta


def choose(mapping: str, m: int, n: int, k: int, batch: int, dtype: DType, target: TargetDesc,
           candidates: Sequence[T], default: T) -> tuple[T, dict]:
    """:func:`pick` for one mapping's problem on ``target`` (its table, its arch): the one place
    the problems a kernel records are keyed, so the tuner's forced choices always apply."""
    problem = TileProblem(mapping, m, n, k, batch, dtype.value, target.name)
    return pick(problem, target.tiles, candidates, default)
