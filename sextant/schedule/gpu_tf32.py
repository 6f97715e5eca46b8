"""tf32 tensor cores for f32 matmuls, when the user allows them.

f32 matmuls are exact fp32 by default, as eager PyTorch's are. With
``torch.backends.cuda.matmul.allow_tf32 = True`` (or ``torch.set_float32_matmul_precision("high")``)
at compile time — the flag eager's cuBLAS and Inductor read — the GPU target carries ``tf32``
and f32 matmuls on sm_80+ run ``mma.sync.m16n8k8.tf32`` with f32 accumulation: the inputs keep
10 of their 23 mantissa bits (the hardware ignores the rest), about 1e-3 relative error per
product, eight times the throughput of CUDA-core fp32 on an H100.

The block tiles, warp tiles, the 2-stage ``cp.async`` pipeline (``pipelined_k_loop``), the
kernel around them (``tensor_core_matmul_kernel``) and the epilogue are those of the f16 GEMM
(``gpu_mma``) with ``BK = 16``: an f32 tile of 128 rows × 32 would not fit twice in 48
KiB next to B's. What differs is the fragments: ``ldmatrix`` moves 16-bit elements (its
``.trans`` would split a 32-bit one), so each lane reads its own — A's ``(g + 8·(i&1), t + 4·(i>>1))``,
B's ``(t + 4i, g)`` (``kernel.fragments``; ``g = lane/4``, ``t = lane%4``) — with plain shared loads.
Row strides make those loads conflict-free: A (and an N×K-staged B) rows are ``16 + 4 = 20`` words,
so the 8 rows ``g`` of a request start at 8 distinct multiples of 4 banks and the 4 ``t`` fill them;
a K×N-staged B row is ``BN + 8`` words (≡ 8 mod 32), so the 4 rows ``t`` start 8 banks apart and the
8 columns ``g`` fill them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sextant.graph.dtypes import DType
from sextant.kernel.fragments import MMA_SHAPES
from sextant.kernel.ir import (
    Buffer,
    Const,
    Expr,
    Kernel,
    Load,
    Mma,
    Store,
)
from sextant.kernel.sizes import capacity
from sextant.schedule.gpu_kernels import TID_X, _strided_loop
from sextant.schedule.gpu_mma import (
    Operand,
    TcTile,
    pipelined_k_loop,
    store_accumulators,
    tensor_core_matmul_kernel,
    tensor_core_product,
    tuned_tile,
)
from sextant.schedule.indexing import ValueEmitter, c, iadd, idiv, imod, imul
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc

MMA8 = MMA_SHAPES[((16, 8, 8), "tf32")]
BK = 16
CANDIDATES = (TcTile(128, 128, BK, 2, 4, stages=2), TcTile(64, 64, BK, 2, 2, stages=3))  # 37 / 29 KiB shared
PAD_ROWS_K = 4  # A and N×K-staged B: row stride BK + 4 = 20 words
PAD_ROWS_N = 8  # K×N-staged B: row stride BN + 8 ≡ 8 (mod 32) words


def uses_tf32(group: Group, target: TargetDesc) -> bool:
    """An f32 matmul on sm_80+ for a target compiled with tf32 allowed."""
    return tensor_core_product(group.anchor, target) and group.anchor.dtype == group.anchor.inputs[0].dtype == DType.f32


def emit_tf32_gemm(e: ValueEmitter, tile: TcTile, m: int, n: int, k: int, bm: Expr, bn: Expr, a: Operand,
                   b: Operand, epilogue: Callable[[Expr, Expr, Expr], None],
                   out_dtype: DType | None = None) -> tuple[list[Buffer], tuple[Buffer, ...]]:
    """The block's ``tile`` of ``C = A·B`` on tf32 tensor cores, then ``epilogue(row, col, acc)`` on
    the f32 accumulators where they are (an f32 tile staged through shared memory would write 2
    lanes per bank; ``out_dtype`` is accepted for the common signature)."""
    f32 = DType.f32
    a_stride = tile.bk + PAD_ROWS_K
    b_stride = tile.bk + PAD_ROWS_K if b.nk else tile.bn + PAD_ROWS_N
    sa = tile.bm * a_stride
    sb = (tile.bn if b.nk else tile.bk) * b_stride
    mi, ni = tile.mi, tile.ni
    shared = [Buffer("As", f32, tile.stages * sa, "shared"), Buffer("Bs", f32, tile.stages * sb, "shared")]
    local = (Buffer("fa", f32, mi * MMA8.a_elems, "local"), Buffer("fb", f32, ni * MMA8.b_elems, "local"),
             Buffer("acc", f32, mi * ni * MMA8.c_elems, "local"))
    lane = e.bind(imod(TID_X, 32), "lane")
    warp = e.bind(idiv(TID_X, 32), "warp")
    wrow = e.bind(imul(idiv(warp, tile.wn), tile.bm // tile.wm), "wrow")
    wcol = e.bind(imul(imod(warp, tile.wn), tile.bn // tile.wn), "wcol")
    i0, j0 = e.bind(imul(bm, tile.bm), "i0"), e.bind(imul(bn, tile.bn), "j0")
    g, tq = e.bind(idiv(lane, 4), "g"), e.bind(imod(lane, 4), "t")
    _strided_loop(e, c(0), mi * ni * MMA8.c_elems, 1, lambda u: e.emit(Store("acc", u, Const(0.0, f32))), "u",
                  unroll=True)
    def k_step(a_base: Expr, b_base: Expr) -> None:
        for ks in range(0, tile.bk, MMA8.k):
            for x in range(mi):
                for i in range(MMA8.a_elems):  # a_i = A[g + 8(i&1)][t + 4(i>>1)]
                    row = iadd(wrow, iadd(g, c(16 * x + 8 * (i & 1))))
                    at = iadd(a_base, iadd(imul(row, a_stride), iadd(tq, c(ks + 4 * (i >> 1)))))
                    e.emit(Store("fa", c(x * MMA8.a_elems + i), Load("As", at, f32)))
            for y in range(ni):
                for i in range(MMA8.b_elems):  # b_i = B[t + 4i][g]
                    col = iadd(wcol, iadd(g, c(8 * y)))
                    kk = iadd(tq, c(ks + 4 * i))
                    at = iadd(imul(col, b_stride), kk) if b.nk else iadd(imul(kk, b_stride), col)
                    e.emit(Store("fb", c(y * MMA8.b_elems + i), Load("Bs", iadd(b_base, at), f32)))
            for x in range(mi):
                for y in range(ni):
                    acc = c((x * ni + y) * MMA8.c_elems)
                    e.emit(Mma((16, 8, 8), "acc", acc, "fa", c(x * MMA8.a_elems), "fb", c(y * MMA8.b_elems),
                               "acc", acc))

    pipelined_k_loop(e, tile, f32, m, n, k, i0, j0, a, b, (a_stride, b_stride), (sa, sb), k_step)
    store_accumulators(e, tile, m, n, i0, j0, wrow, wcol, lane, epilogue)
    return shared, local


def gpu_tf32_matmul_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    mm = group.anchor
    (*batch, m, _), n = mm.inputs[0].shape, mm.shape[-1]
    k = mm.inputs[0].shape[-1]
    tile, chosen = tuned_tile("tf32", capacity(m), capacity(n), capacity(k), capacity(math.prod(batch)),
                              mm.inputs[0].dtype, target, CANDIDATES)
    return tensor_core_matmul_kernel(group, stored, target, name, tile, emit_tf32_gemm, "tensor-core-tf32",
                                     "m16n8k8.tf32", chosen)
