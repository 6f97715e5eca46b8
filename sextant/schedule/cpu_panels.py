"""Weights in panels: a matmul's constant B laid out strip by strip at compile time, for the CPU GEMM.

The micro-kernel (``cpu_gemm``) walks B one strip of ``nr`` columns at a time, top to bottom over
K. Read from a row-major ``[K, N]`` weight, each k step of a strip is a new row ``N·4`` bytes on:
for GPT-2's 768→2304 product, 768 rows 9 KiB apart, a new 4 KiB page every step. The strip then
lives in as many cache lines and TLB entries as it has rows, and row strides that are multiples
of 4 KiB alias in the caches besides. The kernel used to copy the strip into a local buffer on its
first row tile when the stride was such a multiple, and read it in place otherwise.

A weight is a constant, so the copy can be made once, when the program is compiled: B becomes
``[*batch, N/nr, K, nr]`` — each strip contiguous, zero-padded to whole strips — and the kernel
streams it sequentially with no copy at run time and no edge path for a ragged last strip (the
padded columns are computed and not stored). Measured on 2 Zen 3 cores (AVX2, interleaved
best-of-32, GFLOP/s, panels off → on; MKL on the same shape beside it): 256×768→2304 93 → 141
(MKL 117), 128×3072→768 80 → 108 (93), 256×3072→768 90 → 139 (121), 128×768→768 77 → 99 (98),
GPT-2's LM head 256×768→50257 67 → 109 (66). Without panels the strides that are multiples of
4 KiB (768→3072) were copied per block at run time, the others read in place.

Taken for f32 and f16 (widened) weights — a param, or a movement of one, with static sizes — of
CPU matmuls that are neither a GEMV (``cpu_gemv`` reads W in place) nor on the bf16 pair dot
product (``cpu_pairs``, whose layout is this one with pairs of K interleaved).
"""

from __future__ import annotations

import math

from sextant.graph.builder import GraphBuilder
from sextant.graph.ir import Graph, Node
from sextant.kernel.ir import TILE_ROWS
from sextant.schedule.cpu_amx import COL_TILES, amx_candidate, uses_amx
from sextant.schedule.cpu_gemv import uses_gemv
from sextant.schedule.cpu_pairs import pair_weight, uses_pair_dot
from sextant.schedule.partition import Group, append_layouts, movement_of_param, params_only
from sextant.schedule.target import TargetDesc


def uses_panels(group: Group, target: TargetDesc) -> bool:
    """Whether this CPU matmul reads its B from a weight laid out in panels (the module docstring)."""
    if (target.is_gpu or group.kind != "matmul" or uses_gemv(group, target) or uses_pair_dot(group, target)
            or uses_amx(group, target)):
        return False
    b = group.anchor.inputs[1]
    k, n = b.shape[-2], b.shape[-1]
    return (isinstance(k, int) and isinstance(n, int) and b.dtype.is_float and movement_of_param(b)
            and isinstance(b.type.numel, int))


def panel_weight(b: Node, nr: int) -> Node:
    """``b`` (``[*batch, K, N]``) as ``[*batch, N/nr, K, nr]``, padded with zeros to whole strips."""
    *batch, k, n = b.shape
    nb = len(batch)
    g = GraphBuilder()
    g.loc = b.loc
    n2 = math.ceil(n / nr) * nr
    t = g.pad(b, (0,) * (nb + 2), (0,) * (nb + 1) + (n2 - n,)) if n2 != n else b
    t = g.reshape(t, (*batch, k, n2 // nr, nr))
    return g.permute(t, (*range(nb), nb + 1, nb, nb + 2))


def strip_columns(group: Group, target: TargetDesc) -> int:
    """Columns of a weight's strip: the micro-tile's ``nr`` — for panels ``kernels.panel_tile``'s
    four f32 vectors, for pairs ``kernels.pair_columns``'s three (narrower for a matrix narrower
    than that)."""
    from sextant.schedule.kernels import pair_columns, panel_tile

    b = group.anchor.inputs[1]
    if uses_pair_dot(group, target):
        return pair_columns(target, b.shape[-1], params_only(b))
    return panel_tile(target, b.shape[-1])[1]


def layout_gemm_weights(graph: Graph, groups: list[Group], target: TargetDesc) -> tuple[Graph, list[Node]]:
    """Give every CPU matmul with a constant B its compile-time layout (``Group.packed``): in pairs
    of K for the pair dot product, in panels otherwise. A bf16 B computed per call that goes on the
    pair dot (``cpu_pairs.uses_pair_dot``) is laid out by a kernel of its own inserted before the
    product's (``groups`` gains it in place). Returns the graph with the layout nodes appended (the
    program's graph names every buffer it holds) and the nodes to be evaluated into constants."""
    layouts = []
    stored = {id(o) for g in groups for o in g.outputs}
    for g in groups:
        g.tiles = amx_candidate(g, target, stored)
        if g.tiles:  # pairs of K in strips of 16 columns, N padded to whole column tiles
            b = g.anchor.inputs[1]
            layouts.append((g, b, pair_weight(b, TILE_ROWS, COL_TILES * TILE_ROWS)))
            continue
        if uses_pair_dot(g, target):
            layout = pair_weight
        elif uses_panels(g, target):
            layout = panel_weight
        else:
            continue
        b = g.anchor.inputs[1]
        layouts.append((g, b, layout(b, strip_columns(g, target))))
    return append_layouts(graph, layouts, groups)  # a B that is not a weight (pairs only) per call
