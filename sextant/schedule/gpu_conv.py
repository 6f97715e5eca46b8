"""GPU convolution as an implicit GEMM: the tiled matmul mapping with the im2col matrix never stored.

A convolution group (1-D, 2-D or 3-D; transposed convolutions reach the scheduler as ordinary
convolutions of a zero-interleaved, padded input, which is inlined index arithmetic here too)
becomes, per channel group ``g``, the product

    C[co, m] = Σ_k W[g·Cout_g + co, k] · X[k, m]

with ``m`` the output position ``(n, o_1, .., o_d)`` (all images and all output positions) and ``k``
the reduction ``(ci, kk_1, .., kk_d)`` over the group's input channels and the kernel window. ``X`` is
the im2col matrix: ``X[k, m]`` is the input at channel ``g·Cin_g + ci`` and spatial position
``o·stride − padding + kk·dilation``, or 0 in the padding. It is read straight from the input when
the tile is staged into shared memory, so it costs no memory and no extra kernel.

On ``sm_90a`` an f16/bf16 convolution runs on warpgroup MMAs instead (``gpu_wgmma_conv``: the
weights by TMA, the im2col fragment gathered into registers) when its weight allows.

Tiles, micro-tiles and barriers are those of the matmul (:class:`~sextant.schedule.gpu_kernels.GemmTiles`);
only the operand indexing and the output's NCHW store differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sextant.graph.symbolic import SymbolicShapeError, is_symbolic
from sextant.kernel.ir import Cast, Expr, Kernel, Load
from sextant.kernel.sizes import capacity, with_grid
from sextant.schedule.gpu_kernels import (
    CONV_GEMM_MIN_CHANNELS,
    MM_MICRO_M,
    MM_MICRO_N,
    MM_THREADS_X,
    MM_THREADS_Y,
    MM_TILE_K,
    MM_TILE_M,
    MM_TILE_N,
    GemmTiles,
    TileElement,
    _bool,
    _check_shared,
    _grid,
    gpu_direct_conv_kernel,
)
from sextant.schedule.gpu_mma import TC_DTYPES, Operand, emit_mma_gemm, sm_version, tuned_tile
from sextant.schedule.gpu_wgmma_conv import gpu_wgmma_conv_kernel, uses_wgmma_conv
from sextant.schedule.indexing import Index, accum_dtype, c, delinearize, iadd, imul, may_be_nonzero
from sextant.schedule.kernels import setup_kernel, store_epilogue
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc


def conv_uses_tensor_cores(group: Group, target: TargetDesc) -> bool:
    """An f16/bf16 convolution on sm_80+: its implicit GEMM runs on ``mma.sync`` (``gpu_mma``)."""
    cv = group.anchor
    x, w = cv.inputs
    return (target.is_gpu and sm_version(target) >= 80 and x.dtype == w.dtype == cv.dtype
            and x.dtype in TC_DTYPES and cv.type.numel > 0)


def gpu_conv_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Convolution as an implicit GEMM through shared-memory tiles, epilogue fused into the store.

    * **Which operand is which.** GEMM rows are output channels of the group, columns are output
      positions (``N·OH·OW``: images are columns too, so a 1×1 conv over small images still
      fills the tiles), ``K = Cin_g·KH·KW``. This orientation lets the matmul's tile layouts serve
      unchanged: the A tile (64 channels × 16 k) is read along a weight row, contiguous in memory
      (``W[co, ci, kh, kw]`` is row-major over ``k``), and the B tile (16 k × 64 positions) with
      consecutive threads on consecutive output positions — consecutive input addresses for
      stride 1 (coalesced) — and the epilogue's stores, along the columns, are coalesced in the
      NCHW output. (The other orientation, positions as rows, would store with a stride of
      ``OH·OW`` between neighbouring threads.)
    * **Tiles.** As for the matmul: a 16×16-thread block owns 64 channels × 64 positions, each
      thread a 4×4 register micro-tile (16 FMAs per 8 shared loads); K steps by 16 through 2 × 4 KiB
      of shared memory (f32 tiles; f16/bf16 inputs are widened as they are staged and accumulate in
      f32, rounded once at the store), ``Barrier`` after the loads and after the rank-1 updates.
    * **Padding, stride, dilation** live in the B tile's load: the input position of ``(k, m)``
      is ``o·stride − padding + kk·dilation``; where it falls in the padding the load is skipped
      and the tile slot gets a zero, like the guards at ragged tile edges (channels, positions
      and K that are not multiples of the tile). Dims without padding need no such check.
    * **Groups** are grid z: block ``(x, y, g)`` computes position tile ``x`` and channel tile
      ``y`` of group ``g`` (folded into x beyond CUDA's 65535 limit on y and z).
    * **Epilogue**: bias, BatchNorm's scale and shift, activation, residual — per element of the
      micro-tile at output index ``(n, g·Cout_g + co, o…)``.

    Falls back to the direct mapping (:func:`~sextant.schedule.gpu_kernels.gpu_direct_conv_kernel`)
    below ``CONV_GEMM_MIN_CHANNELS`` output channels per group — depthwise convolutions, where all
    but one row of each 64-row tile would be zeros."""
    cv_ = group.anchor
    if is_symbolic(cv_.shape[1]) or is_symbolic(cv_.inputs[0].shape[1]) or is_symbolic(cv_.inputs[1].shape):
        raise SymbolicShapeError("the GPU convolutions need static channels and kernel sizes (each binding is "
                                 "compiled on its own)")

    cv = group.anchor
    x, w = cv.inputs
    groups: int = cv.attr("groups")
    cout_g, cin_g, ksp = w.shape[0] // groups, w.shape[1], tuple(w.shape[2:])
    if cout_g < CONV_GEMM_MIN_CHANNELS:
        return gpu_direct_conv_kernel(group, stored, target, name)
    if uses_wgmma_conv(group, target):
        hopper = gpu_wgmma_conv_kernel(group, stored, target, name)
        if hopper is not None:
            return hopper
    stride, padding, dilation = (cv.attr(a) for a in ("stride", "padding", "dilation"))
    nb, osp, isp = cv.shape[0], tuple(cv.shape[2:]), tuple(x.shape[2:])
    positions, k = nb * math.prod(osp), cin_g * math.prod(ksp)
    e, params, _ = setup_kernel(group, stored)
    tensor_cores = conv_uses_tensor_cores(group, target)
    tc_tile, chosen = (tuned_tile("conv-mma", cout_g, capacity(positions), k, groups, cv.dtype, target)
                       if tensor_cores else (None, {}))  # for the largest batch
    bm_, bn_ = (tc_tile.bm, tc_tile.bn) if tc_tile else (MM_TILE_M, MM_TILE_N)
    grid, (bn, bm, g) = _grid(e, (-(-positions // bn_), -(-cout_g // bm_), groups))
    if tc_tile is not None:
        meta = {"mapping": "tensor-core-implicit-gemm", **tc_tile.meta(), "gemm": (cout_g, positions, k),
                "groups": groups, "mma": "m16n8k16." + cv.dtype.value, **chosen}
    else:
        meta = {"mapping": "implicit-gemm", "tile": (MM_TILE_M, MM_TILE_N, MM_TILE_K),
                "micro_tile": (MM_MICRO_M, MM_MICRO_N), "gemm": (cout_g, positions, k), "groups": groups}
    if not may_be_nonzero(cv.type.numel):
        return with_grid(Kernel(name, tuple(params), (1, 1, 1), (tc_tile.threads if tc_tile else MM_THREADS_X,
                                                                 1 if tc_tile else MM_THREADS_Y, 1), (), meta=meta),
                         grid)
    channel0 = imul(g, cout_g)

    def position(m: Expr) -> tuple[Expr, Index]:
        """Image and output spatial index of GEMM column ``m``."""
        n, *o = delinearize(m, (nb, *osp))
        return n, tuple(o)

    def weight(row: Expr, col: Expr) -> tuple[list[Expr], Callable[[], Expr]]:
        """A[row, col]: weight of channel ``row`` of the group at reduction index ``col`` — a stored
        weight at its flat offset ``co·K + col`` (no index split and rejoin), an inlined one (e.g.
        a transposed conv's flipped kernel) through its index arithmetic."""
        co = iadd(channel0, row)
        if id(w) in e.buffers:
            return [], lambda: Load(e.buffers[id(w)], iadd(imul(co, k), col), w.dtype)
        idx = (co, *delinearize(col, (cin_g, *ksp)))
        return [], lambda: e.value(w, idx)

    def im2col(row: Expr, col: Expr) -> tuple[list[Expr], Callable[[], Expr]]:
        """B[row, col]: the input under kernel offset ``row`` of output position ``col`` (the
        position is bound to registers; the padding checks become the load's conditions)."""
        ci, *kk = delinearize(row, (cin_g, *ksp))
        n, o = position(col)
        inside: list[Expr] = []
        pos: list[Expr] = []
        for d in range(len(osp)):
            p = e.bind(iadd(iadd(imul(o[d], stride[d]), imul(kk[d], dilation[d])), c(-padding[d])), "ip")
            if padding[d]:
                inside += [_bool("ge", p, c(0)), _bool("lt", p, c(isp[d]))]
            pos.append(p)
        idx = (n, iadd(imul(g, cin_g), ci), *pos)
        return inside, lambda: e.value(x, idx)

    w_tile: TileElement = weight
    x_tile: TileElement = im2col
    if tc_tile is not None:  # the same operands on tensor cores (gpu_mma); weight rows by cp.async
        chunk = None
        if id(w) in e.buffers and k * w.dtype.itemsize % 16 == 0:
            chunk = lambda row, col: (e.buffers[id(w)], iadd(imul(iadd(channel0, row), k), col))

        def epilogue(row: Expr, col: Expr, acc: Expr) -> None:
            e.regs[id(cv)] = e.bind(acc if acc.dtype == cv.dtype else Cast(acc, cv.dtype), "c")
            n, o = position(col)
            store_epilogue(e, group, (n, iadd(channel0, row), *o))
            e.regs.pop(id(cv))

        shared, local = emit_mma_gemm(e, tc_tile, w.dtype, cout_g, positions, k, bm, bn, Operand(w_tile, chunk),
                                      Operand(x_tile), epilogue, out_dtype=cv.dtype)
        _check_shared(name, shared, target)
        return with_grid(Kernel(name, tuple(params), (1, 1, 1), (tc_tile.threads, 1, 1), tuple(e.stmts),
                                shared=tuple(shared), local=local, meta=meta), grid)
    tiles = GemmTiles(e, accum_dtype(cv.dtype))
    i0, j0 = tiles.start(bm, bn)

    def load_tiles(k0: Expr) -> None:
        tiles.load_tile("As", MM_TILE_M, MM_TILE_K, i0, k0, cout_g, k, w_tile)
        tiles.load_tile("Bs", MM_TILE_K, MM_TILE_N, k0, j0, k, positions, x_tile)

    def store(row: Expr, col: Expr) -> None:
        n, o = position(col)
        store_epilogue(e, group, (n, iadd(channel0, row), *o))

    tiles.k_loop(k, load_tiles)
    tiles.store(i0, j0, cout_g, positions, cv, store)
    return tiles.kernel(name, params, grid, target, meta)

