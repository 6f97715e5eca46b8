"""Which lane holds which matrix element: the PTX ISA's fragment layouts for ``mma.sync`` and
``ldmatrix``, as plain functions of ``(lane, element)``.

Every user of the layouts reads them from here — the schedules (which accumulator element of
which lane is output ``(row, col)``), the CPU emulation of :class:`~sextant.kernel.ir.Mma`
and :class:`~sextant.kernel.ir.LdMatrix` (``codegen.llvm_cpu``), the docs — so a layout is
written once. Tests check these tables against an independent reading of the ISA and against
``mmasim``'s model of the arithmetic.

Notation of the PTX ISA (§9.7.14.5.7–8, "Matrix Fragments for mma.m16n8k*"): ``g = lane >> 2``
(the "group"), ``t = lane % 4`` (the thread in the group); element ``i`` of a fragment counts
"low to high" over the lane's registers (an ``.f16x2`` register holds elements 2r, 2r+1).
"""

from __future__ import annotations

from dataclasses import dataclass

from sextant.graph.dtypes import DType

WARP = 32


@dataclass(frozen=True)
class MmaShape:
    """One ``mma.sync`` shape and operand kind: fragment sizes per lane and its layouts."""

    m: int
    n: int
    k: int
    kind: str  # "f16" | "bf16" | "tf32": how A and B are read

    @property
    def a_elems(self) -> int:
        return self.m * self.k // WARP

    @property
    def b_elems(self) -> int:
        return self.k * self.n // WARP

    @property
    def c_elems(self) -> int:
        return self.m * self.n // WARP

    @property
    def ptx(self) -> str:
        return f"m{self.m}n{self.n}k{self.k}"

    def a_coord(self, lane: int, i: int) -> tuple[int, int]:
        """``(row, k)`` of A element ``i`` of ``lane`` (A is M×K, row-major "row")."""
        g, t = lane >> 2, lane & 3
        if self.kind == "tf32":  # m16n8k8.tf32: a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
            return g + 8 * (i & 1), t + 4 * (i >> 1)
        # f16/bf16: pairs (i, i+1) are adjacent columns; i>>1 alternates rows g / g+8, then k+8
        return g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)

    def b_coord(self, lane: int, i: int) -> tuple[int, int]:
        """``(k, col)`` of B element ``i`` of ``lane`` (B is K×N, "col": each lane holds a column)."""
        g, t = lane >> 2, lane & 3
        if self.kind == "tf32":  # b0 = B[t][g], b1 = B[t+4][g]
            return t + 4 * i, g
        return 2 * t + (i & 1) + 8 * (i >> 1), g

    def c_coord(self, lane: int, i: int) -> tuple[int, int]:
        """``(row, col)`` of C/D element ``i`` of ``lane`` (the same for every input kind)."""
        g, t = lane >> 2, lane & 3
        return g + 8 * (i >> 1), 2 * t + (i & 1)


MMA_SHAPES: dict[tuple[tuple[int, int, int], str], MmaShape] = {
    ((16, 8, 16), "f16"): MmaShape(16, 8, 16, "f16"),
    ((16, 8, 16), "bf16"): MmaShape(16, 8, 16, "bf16"),
    ((16, 8, 8), "f16"): MmaShape(16, 8, 8, "f16"),
    ((16, 8, 8), "bf16"): MmaShape(16, 8, 8, "bf16"),
    ((16, 8, 8), "tf32"): MmaShape(16, 8, 8, "tf32"),
}
_KIND = {DType.f16: "f16", DType.bf16: "bf16", DType.f32: "tf32"}


def mma_shape(shape: tuple[int, int, int], ab: DType) -> MmaShape | None:
    """The layout of an ``Mma`` of ``shape`` whose A/B buffers hold ``ab`` (f32 means tf32),
    or None when the hardware has no such instruction."""
    kind = _KIND.get(ab)
    return MMA_SHAPES.get((tuple(shape), kind)) if kind else None  # type: ignore[arg-type]


def mma_accumulators(shape: MmaShape, ab: DType) -> tuple[DType, ...]:
    """The C/D dtypes an ``Mma`` with these inputs may use: f32, and f16 for f16 inputs."""
    return (DType.f32, DType.f16) if ab == DType.f16 else (DType.f32,)


def ldmatrix_source(lane: int, j: int, e: int, trans: bool) -> tuple[int, int]:
    """Where element ``e`` (0, 1) of matrix ``j`` that ``lane`` receives from ``ldmatrix``
    comes from: ``(the lane whose row address is used, the column within that row)``.

    Lanes ``8j … 8j+7`` give matrix ``j``'s row addresses; lane ``l`` receives row ``l // 4``,
    columns ``2(l % 4) + e`` — or, with ``.trans``, the transposed matrix's element: row
    ``2(l % 4) + e``, column ``l // 4``."""
    if trans:
        return 8 * j + 2 * (lane & 3) + e, lane >> 2
    return 8 * j + (lane >> 2), 2 * (lane & 3) + e

