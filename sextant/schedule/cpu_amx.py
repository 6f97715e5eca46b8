"""bf16 GEMMs on the CPU's AMX matrix tiles: 32×32 micro-tiles of C, each one ``TileMatmul``.

Where the CPU has AMX (``TargetDesc.amx``: Sapphire Rapids and later Xeons), one ``tdpbf16ps``
multiplies a 16×32 bf16 tile of A by a 32×16 tile of B into 16×16 f32 accumulators — 16 K of
multiply-adds per cycle and lane where AVX-512-BF16's ``vdpbf16ps`` does 2. A bf16 matmul whose
B is a weight (a param or a movement of one, static sizes) is mapped here when its A can be read
by tile loads in place: a stored bf16 value (or a reshape of one), row-major with K contiguous,
K a multiple of 32 (a tile row holds 32 values: a ragged K would read the next row's), and at
least 32 rows of static M.

- B is laid out at compile time in pairs of K (``cpu_pairs.pair_weight``: ``[strips, K/2, 16, 2]``,
  "VNNI" order) with N padded to whole pairs of strips, so a B tile is 1 KiB of contiguous memory.
- A block owns up to ``AMX_BLOCK_M`` rows × ``AMX_BLOCK_N`` columns of C, and walks them 32
  columns at a time, top to bottom in 32-row micro-tiles: the two strips of B a column tile reads
  stay in L1/L2 across its row tiles, the block's rows of A in L2.
- Each micro-tile is one :class:`~sextant.kernel.ir.TileMatmul` over all of K (2×2 accumulator
  tiles + 2 of A + 2 of B: AMX's eight registers), stored to a local f32 tile that the epilogue
  reads as the other CPU GEMMs' does (bias, activation, residual, cast to bf16).
- Rows: a last micro-tile that would run past M starts ``32 - M % 32`` rows earlier instead (tile
  loads cannot clamp a row), and stores only the rows no earlier tile of the block stored.

Where the CPU lacks AMX but a schedule was made for it (tests pin ``cpu_target(amx=True)``), the
same kernels run with each tile matmul expanded into pair dots (``kernel/tiles.py``).
"""

from __future__ import annotations

import math
from collections.abc import Container

from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.kernel.ir import TILE_K, TILE_ROWS, Binary, Buffer, Expr, For, If, Kernel, Load, TileMatmul, Var
from sextant.kernel.sizes import with_grid
from sextant.schedule.cpu_gemm import balanced_rows
from sextant.schedule.cpu_gemv import uses_gemv
from sextant.schedule.indexing import c, delinearize, iadd, idiv, imin, imod, imul, linearize
from sextant.schedule.partition import Group, is_buffer, movement_of_param
from sextant.schedule.target import TargetDesc

ROW_TILES = COL_TILES = 2  # the micro-tile: 2×2 accumulator tiles = 32×32 of C
AMX_BLOCK_M, AMX_BLOCK_N = 128, 128  # C per block (whole micro-tiles; rows balanced over blocks)


def a_in_place(group: Group, stored: Container[int]) -> Node | None:
    """The stored value the matmul's A reads — A itself, or what a chain of reshapes views — or
    None when A is computed in the kernel (``stored``: ids of the values held in memory)."""
    a = group.anchor.inputs[0]
    while not (is_buffer(a) or id(a) in stored):
        if a.op != "reshape":
            return None
        a = a.inputs[0]
    return a


def amx_candidate(group: Group, target: TargetDesc, stored: Container[int]) -> bool:
    """Whether this matmul group can run on AMX tiles (see the module docstring); the weight's
    layout (``cpu_panels.layout_gemm_weights``) decides it, and marks the group (``Group.tiles``)."""
    if target.is_gpu or not target.amx or group.kind != "matmul" or uses_gemv(group, target):
        return False
    a, b = group.anchor.inputs
    m, k, n = a.shape[-2], b.shape[-2], b.shape[-1]
    return (a.dtype == b.dtype == DType.bf16 and isinstance(k, int) and isinstance(n, int) and isinstance(m, int)
            and k % TILE_K == 0 and m >= ROW_TILES * TILE_ROWS and all(isinstance(d, int) for d in a.shape)
            and movement_of_param(b) and isinstance(b.type.numel, int) and a_in_place(group, stored) is not None)


def uses_amx(group: Group, target: TargetDesc) -> bool:
    """Whether the CPU maps this matmul group on AMX tiles."""
    return group.tiles and target.amx and not target.is_gpu


def amx_matmul_kernel(group: Group, stored: set[int], name: str) -> Kernel:
    from sextant.schedule.kernels import BID, matmul_epilogue, setup_kernel

    mm = group.anchor
    a, b = mm.inputs
    *batch, m, k = a.shape
    n = b.shape[-1]
    e, params, _ = setup_kernel(group, stored)
    p = group.packed[id(b)]
    strips = p.shape[-4]
    rows, cols = ROW_TILES * TILE_ROWS, COL_TILES * TILE_ROWS
    bm = balanced_rows(m, AMX_BLOCK_M, rows)
    bn = min(AMX_BLOCK_N, strips * TILE_ROWS)
    blocks_m, blocks_n = math.ceil(m / bm), math.ceil(strips * TILE_ROWS / bn)
    per_batch = blocks_m * blocks_n
    nb = math.prod(batch)
    src = e.buffers[id(a_in_place(group, stored))]
    tile = Buffer("tile", DType.f32, rows * cols, "local")

    t = BID
    bidx = delinearize(e.bind(idiv(t, per_batch), "bb"), tuple(batch)) if batch else ()
    rem = e.bind(imod(t, per_batch), "t") if batch else t
    istart = e.bind(imul(idiv(rem, blocks_n), bm), "is")
    iend = e.bind(imin(iadd(istart, c(bm)), c(m)), "ie")
    jstart = e.bind(imul(imod(rem, blocks_n), bn), "js")
    a_base = linearize((*bidx, c(0), c(0)), a.shape) if batch else c(0)
    b_base = linearize((*bidx, c(0), c(0), c(0), c(0)), p.shape) if batch else c(0)

    def loop(var: Var, start: Expr, stop: Expr, step: int, body) -> None:
        with e.scope() as stmts:
            body()
        e.emit(For(var, start, stop, step, tuple(stmts)))

    jt, it, r, j = e.var("j0"), e.var("i0"), e.var("r"), e.var("j")

    def column_tile() -> None:
        strip = e.bind(idiv(jt, TILE_ROWS), "strip")

        def row_tile() -> None:
            i0 = e.bind(imin(it, c(m - rows)), "i0s")  # a last tile past M starts earlier
            e.emit(TileMatmul("tile", src, e.bind(iadd(a_base, imul(i0, k)), "ao"), k, e.buffers[id(p)],
                              e.bind(iadd(b_base, imul(strip, k * TILE_ROWS)), "bo"), k * TILE_ROWS, k,
                              ROW_TILES, COL_TILES))
            # rows an earlier tile stored
            first = e.bind(Binary("maximum", iadd(it, imul(i0, -1)), c(0), DType.i32), "r0")

            def out_row() -> None:
                i = e.bind(iadd(i0, r), "i")

                def out_col() -> None:
                    jj = iadd(jt, j)
                    value = Load("tile", iadd(imul(r, cols), j), DType.f32)
                    if n % cols == 0:
                        matmul_epilogue(e, group, (*bidx, i, jj), value)
                    else:  # the padded columns of the last tile are computed, not stored
                        with e.scope() as then:
                            matmul_epilogue(e, group, (*bidx, i, jj), value)
                        e.emit(If(Binary("lt", jj, c(n), DType.bool), tuple(then)))

                with e.scope() as inner:
                    out_col()
                e.emit(For(j, c(0), c(cols), 1, tuple(inner), n % cols == 0))

            loop(r, first, c(rows), 1, out_row)

        loop(it, istart, iend, rows, row_tile)

    loop(jt, jstart, imin(iadd(jstart, c(bn)), c(strips * TILE_ROWS)), cols, column_tile)
    kernel = Kernel(name, tuple(params), (1, 1, 1), (1, 1, 1), tuple(e.stmts), local=(tile,))
    kernel.meta.update(mapping="cpu-amx", weight="[" + ", ".join(map(str, p.shape)) + "] in pairs of K")
    return with_grid(kernel, (nb * per_batch, 1, 1))
