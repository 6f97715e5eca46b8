"""Split-K: a tensor-core GEMM whose ``M × N`` tiles cannot fill the GPU splits its K dimension.

One thread block owns one tile of C, so a decode-shaped product (``16 × 768 · 768 × 3072``: 48
tiles of 64×64) leaves most of an H100's 132 SMs idle however long its K loop is. Splitting K
into ``s`` slices gives ``s`` times the blocks, each with a K loop ``s`` times shorter; the
partial products are then summed. sextant writes the split as a graph rewrite the rest of the
scheduler already knows how to run, before fusion:

    C = A · B                                  A: [*b, M, K]   B: [*b, K, N]
 →  P = matmul(permute(reshape(A, [*b, M, s, K/s])), reshape(B, [*b, s, K/s, N]), out_dtype=f32)
    C = cast(P[0] + P[1] + ... + P[s-1])       P: [*b, s, M, N] in f32

The partial products stay f32 (the matmul's ``out_dtype``: the tensor core's own accumulator,
never rounded to f16 between slices), the batched product over the ``s`` slices runs on the
same tensor-core GEMM (A's slices are a strided view of its buffer: still copied by
``cp.async``), and the sum over the slices is an elementwise kernel — one thread per element of
C reads its ``s`` partials, consecutive threads consecutive columns (coalesced) — which picks up
the original matmul's fused epilogue (bias, activation, residual, the cast). K that is not a
multiple of ``s`` slices of whole ``BK`` tiles is zero-padded (zeros add nothing).

The cost model (:func:`split_factor`) counts the smallest tile's blocks against the SMs and
keeps each slice at least :data:`MIN_SLICE_K` deep, so the extra traffic — ``s·M·N`` f32 partials
written once and read once — stays small beside the operands it divides among more SMs.
"""

from __future__ import annotations

import math

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node
from sextant.graph.passes.rewrite import replace_nodes
from sextant.graph.symbolic import is_symbolic
from sextant.schedule.attention_match import match_attention
from sextant.schedule.gpu_mma import CANDIDATES, tensor_core_product
from sextant.schedule.target import TargetDesc

MIN_SLICE_K = 256  # each slice keeps ≥ 8 K tiles of 32: the pipeline prologue and epilogue stay small
MAX_SPLITS = 16  # beyond this the f32 partials cost more traffic than the idle SMs do


def small_tiles(m: int, n: int, batch: int) -> int:
    """Blocks of the smallest candidate tile a ``[batch] m × n`` product has."""
    return math.ceil(m / CANDIDATES[-1].bm) * math.ceil(n / CANDIDATES[-1].bn) * batch


def split_factor(m: int, n: int, k: int, batch: int, target: TargetDesc) -> int:
    """How many K slices a tensor-core product ``[batch] m × k · k × n`` should run as (1: none).

    As many slices as keep the smallest candidate tile's blocks within one wave over the SMs (a
    problem that already occupies more than half of them is left alone: a second, partial wave
    would cost what the split saves), no more than ``k // MIN_SLICE_K`` (short slices are all
    prologue and epilogue) nor :data:`MAX_SPLITS`. Symbolic sizes: none (the waves depend on them)."""
    if is_symbolic((m, n, k, batch)):
        return 1
    s = min(target.cores // small_tiles(m, n, batch), k // MIN_SLICE_K, MAX_SPLITS)
    return s if s >= 2 else 1


def slice_depth(k: int, s: int, bk: int = 32) -> tuple[int, int]:
    """``(s, depth)``: the slices and their depth in whole ``bk`` tiles. A slice count within a
    factor 2 of ``s`` that divides ``k`` into whole tiles is preferred (no padding), else ``k`` is
    padded up to ``s · depth``."""
    for t in range(s, max(2, s // 2) - 1, -1):
        if k % (t * bk) == 0:
            return t, k // t
    depth = math.ceil(k / s / bk) * bk
    return math.ceil(k / depth), depth  # no slice of padding only


def split_k(graph: Graph, target: TargetDesc) -> tuple[Graph, list[str]]:
    """``graph`` with every tensor-core matmul that :func:`split_factor` splits rewritten as
    above (matmuls of a fused attention chain excepted), and a note per split for the dump."""
    if not target.is_gpu:
        return graph, []
    found, _ = match_attention(graph, graph.users())
    in_attention = {id(m) for a in found for m in a.members}
    notes: list[str] = []

    def split(mm: Node) -> Node | None:
        """The rewrite of ``mm``, built on its original operands (``replace_nodes`` rewires them
        onto their own replacements, so an attention chain below a split projection is still
        recognised by its original nodes)."""
        if mm.op != "matmul" or id(mm) in in_attention or not tensor_core_product(mm, target):
            return None
        a, b = mm.inputs
        *batch, m, k = a.shape
        n = b.shape[-1]
        s = split_factor(m, n, k, math.prod(batch), target)
        if s == 1:
            return None
        s, depth = slice_depth(k, s)
        r = len(batch)
        gb = GraphBuilder()
        gb.loc = mm.loc
        if s * depth > k:
            extra = s * depth - k
            a = gb.pad(a, (0,) * (r + 2), (0,) * (r + 1) + (extra,))
            b = gb.pad(b, (0,) * (r + 2), (0,) * r + (extra, 0))
        a_slices = gb.permute(gb.reshape(a, (*batch, m, s, depth)), (*range(r), r + 1, r, r + 2))
        b_slices = gb.reshape(b, (*batch, s, depth, n))
        partial = gb.emit("matmul", [a_slices, b_slices], out_dtype=DType.f32)
        total = gb.reshape(gb.slice(partial, r, 0, 1), mm.shape)
        for i in range(1, s):  # one elementwise kernel sums the slices (and runs the epilogue)
            total = gb.add(total, gb.reshape(gb.slice(partial, r, i, 1), mm.shape))
        where = f" at {mm.loc}" if mm.loc else ""
        tiles = small_tiles(m, n, math.prod(batch))
        notes.append(f"split-K: matmul{where} ({'[' + 'x'.join(map(str, batch)) + '] ' if batch else ''}"
                     f"{m}x{k} . {k}x{n}: {tiles} tile(s) for {target.cores} SMs) runs as {s} slices of "
                     f"K={depth}{f' (K padded by {s * depth - k})' if s * depth > k else ''}, "
                     f"f32 partials summed by the epilogue's kernel")
        return total if mm.dtype == DType.f32 else gb.cast(total, mm.dtype)

    rewrites = {mm: rep for mm in graph.nodes if (rep := split(mm)) is not None}
    return (replace_nodes(graph, rewrites) if rewrites else graph), notes
