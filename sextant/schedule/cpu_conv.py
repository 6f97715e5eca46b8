"""Convolution on the CPU as an implicit GEMM through the matmul's register micro-kernel.

Per group ``g`` a convolution is ``C[i, j] = Σ_q A[i, q] · B[q, j]`` with

- rows ``i`` = (batch, output position): all of them, so a batch-1 layer with 2×2 outputs still
  fills micro-tiles across its positions;
- columns ``j`` = output channels of the group: the vector dimension, because B is the weight,
  laid out ``[G, K, Cout_g]`` (padded with zeros to whole vectors) once at compile time, so each
  k step loads ``nr`` contiguous weights;
- ``q`` = (input channel, kernel offsets), the order of the weight's own dims; A is the input's
  im2col, never materialised: each micro-tile computes its rows' output positions once, and per
  k step reads ``mr`` input values through that offset (a bounds check selects zero for padding).

Per k step the micro-kernel needs each row's input offset for that k's (channel, kernel offsets);
a window of up to ``MAX_UNROLLED_TAPS`` taps is unrolled in the k loop (``Gemm.k_unroll``), so the
loop runs once per input channel and a tap's offset is the channel's plus a constant — computed
per step, ``k / 9``, ``k / 3 % 3``, ``k % 3`` were a dozen integer instructions beside 16 FMAs,
which kept a 6-wide Intel core's front end busy: 3×3 layers ran at half the GFLOP/s. A larger
window unrolls its innermost row (:func:`unrolled_taps`; ResNet's 7×7 stem 43 → 66 GFLOP/s, a
5×5 layer 33 → 59, 2 Zen 3 cores).

In bf16 on a CPU with AVX-512-BF16 the weight is laid out in pairs of K and the k loop runs
``PairDot`` steps (:func:`uses_pair_conv`; the reads of A are the same, two per pair): ResNet-50's
3×3 layers 160–186 → 326–366 GFLOP/s on 2 Zen 4 cores, where oneDNN's bf16 reaches 290–319.

A 1×1 convolution over positions that fill whole strips is not mapped here at all: it is the
matmul ``W @ x`` with positions as the vector columns (:func:`pointwise_as_matmul`), where B is
contiguous without any layout.

The output is NCHW, contiguous along the rows (positions) and a plane apart along the columns:
a full micro-tile's epilogue runs column by column with its rows as vector lanes
(``Gemm.column_epilogue``; stores of 8 positions at once instead of one). ResNet-50's 1×1 layers
with BN, residual and ReLU fused, 2 Zen 4 cores: fp32 256→1024 at 14×14 132 → 152 GFLOP/s, 128→512
at 28×28 105 → 138; bf16 165 → 175 and 176 → 194; 3×3 layers (K ≥ 576) within 5 %.

Why this orientation rather than output channels as rows and positions as the vector: positions
are contiguous in memory only within an output row and only at stride 1 — the vector loads would
become gathers — while the weight can be laid out at will. The cost is ``mr`` scalar loads (each
broadcast into a vector) per k step, the same as the matmul's A.

Depthwise convolutions (one channel per group: padded to a vector, most GEMM lanes would be zeros)
have their own mapping, vectorised along the output row (:func:`depthwise_kernel`), or over the
whole plane where rows are short (:func:`_depthwise_planes`); the rest
(3-D depthwise, weights computed from an input) keep the direct mapping (``kernels.conv_kernel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Node, make_node
from sextant.graph.passes.rewrite import rebuild
from sextant.graph.symbolic import SymbolicShapeError, is_symbolic
from sextant.kernel.ir import Binary, Buffer, Cast, Const, Expr, If, Kernel, Load, Select, Store, Var
from sextant.schedule.cpu_gemm import Gemm, gemm_kernel
from sextant.schedule.cpu_pairs import pair_lanes, pair_weight
from sextant.schedule.indexing import Index, accum_dtype, c, delinearize, iadd, idiv, imod, imul, linearize, strides
from sextant.schedule.partition import Group, append_layouts
from sextant.schedule.target import TargetDesc

MIN_GROUP_COLUMNS = 2  # output channels per group below which (depthwise) the GEMM is not used
CONV_BLOCK_M, CONV_BLOCK_N = 128, 64  # C tile per block, as for matmul
CONV_BLOCK_K, CONV_BLOCKED_K_FROM = 512, 4096  # K blocks of the implicit GEMM (see conv_k_block)
POINTWISE_MATMUL_MIN_POSITIONS = 512  # a ragged count of positions from which a 1×1 layer is W @ x
PAIR_POINTWISE_MIN_K = 128  # input channels from which a bf16 1×1 layer stays on the pair dot (pointwise_as_matmul)
MAX_UNROLLED_TAPS = 9  # a kernel window of up to this many taps is unrolled in the k loop (see conv_gemm_kernel)


def conv_columns(cv: Node, target: TargetDesc) -> int:
    """The GEMM's column tile: ``kernels.wide_tile``'s four vectors of f32 lanes where it applies
    (not on the pair dot, whose tile keeps two), else two vectors, one for narrower groups, and for
    groups narrower than a vector the next power of two (≥ 4): the zero padding wastes under half."""
    from sextant.schedule.kernels import wide_columns, wide_tile

    lanes = max(1, target.vector_bytes // 4)
    cout_g = cv.inputs[1].shape[0] // cv.attr("groups")
    if wide_tile(target, cout_g) and not uses_pair_conv(cv, target):
        return wide_columns(target)
    if cout_g > lanes:
        return 2 * lanes
    w = 4
    while w < cout_g:
        w *= 2
    return min(w, lanes)


def uses_gemm(cv: Node) -> bool:
    w = cv.inputs[1]
    return w.shape[0] // cv.attr("groups") >= MIN_GROUP_COLUMNS


def pair_steps_per_trip(cv: Node) -> int | None:
    """Pair steps per trip of the implicit GEMM's k loop on the bf16 pair dot, or None where K does
    not split into whole trips (the layer then keeps the widening path).

    A pair step takes k and k + 1, which straddle taps and channels: a trip covers whole windows
    *and* whole pairs — ``lcm(taps, 2)`` k steps, two input channels of a 3×3 layer — so every
    tap's input offset is still the trip's plus a constant. Where K is not a whole number of such
    trips (an odd channel count: a stem's 3 × 49) each pair step would divide k by the window."""
    w = cv.inputs[1]
    per_trip = math.lcm(unrolled_taps(w.shape[2:]), 2)
    return None if math.prod(w.shape[1:]) % per_trip else per_trip // 2


def uses_pair_conv(cv: Node, target: TargetDesc) -> bool:
    """Whether an implicit-GEMM convolution runs on the pair dot product (``cpu_pairs``): bf16
    input and weight, a CPU with the instruction, static sizes, K in whole trips."""
    x, w = cv.inputs
    return (not target.is_gpu and target.pair_dot and x.dtype == w.dtype == DType.bf16 and uses_gemm(cv)
            and not is_symbolic(cv.shape) and not is_symbolic(x.shape) and pair_steps_per_trip(cv) is not None)


def gemm_weight(cv: Node, target: TargetDesc) -> Node:
    """The weight as ``[G, strips, K, nr]``: output channels padded with zeros to whole strips of ``nr``
    columns, each strip contiguous, so a micro-tile streams its weights sequentially (a ``[K, Cout]``
    layout read ``nr`` columns at a time strides by rows: latency-bound for a batch-1 layer, where
    the weights are read once). On the pair dot (:func:`uses_pair_conv`) ``[G, strips, K/2, nr, 2]``,
    pairs of K interleaved as ``cpu_pairs.pair_weight`` lays out a matmul's. Evaluated at compile
    time."""
    w = cv.inputs[1]
    groups = cv.attr("groups")
    cout_g, k = w.shape[0] // groups, math.prod(w.shape[1:])
    nr = conv_columns(cv, target)
    b = GraphBuilder()
    b.loc = w.loc
    if uses_pair_conv(cv, target):
        return pair_weight(b.permute(b.reshape(w, (groups, cout_g, k)), (0, 2, 1)), nr)
    t = b.pad(b.permute(b.reshape(w, (groups, cout_g, k)), (0, 2, 1)), (0, 0, 0), (0, 0, -cout_g % nr))
    strips = t.shape[-1] // nr
    return b.permute(b.reshape(t, (groups, k, strips, nr)), (0, 2, 1, 3))


def conv_gemm_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    from sextant.schedule.kernels import BID, setup_kernel, store_epilogue, tile_rows

    cv = group.anchor
    x, w = cv.inputs
    wt = group.packed[id(w)]
    stride, padding, dilation, groups = (cv.attr(a) for a in ("stride", "padding", "dilation", "groups"))
    nsp = len(cv.shape) - 2
    batch, out_sp, in_sp = cv.shape[0], cv.shape[2:], x.shape[2:]
    cin_g, ksp = w.shape[1], w.shape[2:]
    cout_g = w.shape[0] // groups
    m, k = batch * math.prod(out_sp), cin_g * math.prod(ksp)
    npad = wt.shape[1] * wt.shape[3]
    e, params, _ = setup_kernel(group, stored)
    acc_t = accum_dtype(cv.dtype)
    nr = conv_columns(cv, target)
    mr = tile_rows(target, nr)
    taps: dict[str, tuple[Expr, ...]] = {}  # per k variable: (input channel, kernel offsets), bound once

    def tap(kk: Expr) -> tuple[Expr, ...]:
        key = repr(kk)
        if key not in taps:
            taps[key] = tuple(e.bind(v, "q") for v in delinearize(kk, (cin_g, *ksp)))
        return taps[key]

    in_strides = strides(in_sp)
    plane = math.prod(in_sp)

    def offset(bidx: Index, kk: Expr) -> Expr:
        """Where tap ``kk`` reads relative to a row's first input element (the same for every row)."""
        key = "off" + repr(kk) + repr(bidx)
        if key not in taps:
            ci, *kd = tap(kk)
            off = imul(iadd(imul(bidx[0], cin_g), ci) if groups > 1 else ci, plane)
            for d in range(nsp):
                off = iadd(off, imul(kd[d], dilation[d] * in_strides[d]))
            taps[key] = (e.bind(off, "off"),)
        return taps[key][0]

    def direct_rows(bidx: Index, i0: Expr, count: int) -> list[Callable[[Expr], Expr]]:
        """A stored, unpadded input: each read is one add from the row's base offset."""
        name = e.buffers[id(x)]
        readers = []
        for r in range(count):
            nn, *o = delinearize(e.bind(iadd(i0, c(r)), "row"), (batch, *out_sp))
            base = imul(nn, x.shape[1] * plane)
            for d in range(nsp):
                base = iadd(base, imul(o[d], stride[d] * in_strides[d]))
            base = e.bind(base, "base")

            def read(kk: Expr, base: Expr = base) -> Expr:
                return Load(name, iadd(base, offset(bidx, kk)), x.dtype)

            readers.append(read)
        return readers

    def rows(bidx: Index, i0: Expr, count: int) -> list[Callable[[Expr], Expr]]:
        if id(x) in e.buffers and not any(padding):
            return direct_rows(bidx, i0, count)
        gch = imul(bidx[0], cin_g) if groups > 1 else c(0)
        readers = []
        for r in range(count):
            nn, *o = delinearize(e.bind(iadd(i0, c(r)), "row"), (batch, *out_sp))
            nn = e.bind(nn, "n")
            base = [e.bind(iadd(imul(o[d], stride[d]), c(-padding[d])), "p") for d in range(nsp)]

            def read(kk: Expr, nn: Expr = nn, base: list[Expr] = base) -> Expr:
                ci, *kd = tap(kk)
                inb: Expr | None = None
                pos = []
                for d in range(nsp):
                    p = e.bind(iadd(base[d], imul(kd[d], dilation[d])), "p")
                    if padding[d]:
                        ok = e.bind(Binary("bitwise_and", Binary("ge", p, c(0), DType.bool),
                                           Binary("lt", p, c(in_sp[d]), DType.bool), DType.bool), "inb")
                        p = e.bind(Select(ok, p, c(0), p.dtype), "p")
                        inb = ok if inb is None else e.bind(Binary("bitwise_and", inb, ok, DType.bool), "inb")
                    pos.append(p)
                v = e.value(x, (nn, iadd(gch, ci), *pos))
                return v if inb is None else Select(inb, v, Const(0.0, v.dtype), v.dtype)

            readers.append(read)
        return readers

    gidx = (lambda bidx: bidx[0]) if groups > 1 else (lambda bidx: c(0))

    def col(bidx: Index, kk: Expr, j0: Expr, j: Expr, strip: Expr | None) -> Expr:
        assert strip is not None, "the padded weight has whole strips: no edge path"
        return e.value(wt, (gidx(bidx), strip, kk, j))

    def epilogue(bidx: Index, i: Expr, j: Expr, value: Expr) -> None:
        nn, *o = delinearize(i, (batch, *out_sp))
        co = iadd(imul(bidx[0], cout_g), j) if groups > 1 else j
        e.regs[id(cv)] = e.bind(value if acc_t == cv.dtype else Cast(value, cv.dtype), "c")
        store_epilogue(e, group, (nn, co, *o))
        e.regs.pop(id(cv))

    on_pairs = uses_pair_conv(cv, target)

    def pairs(bidx: Index, strip: Expr) -> tuple[str, Expr]:  # the weight [G, strips, K/2, nr, 2] (gemm_weight)
        return e.buffers[id(wt)], linearize((gidx(bidx), strip, c(0), c(0), c(0)), wt.shape)

    spec = Gemm((groups,) if groups > 1 else (), m, npad, k, acc_t, rows, col, epilogue, mr, nr,
                CONV_BLOCK_M, CONV_BLOCK_N, n_store=cout_g, pairs=pairs if on_pairs else None,
                pair_lanes=pair_lanes(target, nr), column_epilogue=True,
                k_unroll=(trip := pair_steps_per_trip(cv) if on_pairs else unrolled_taps(ksp)),
                k_block=conv_k_block(k, trip, on_pairs))
    kernel = gemm_kernel(e, spec, name, params, BID)
    if on_pairs:
        kernel.meta.update(mapping="cpu-pair-dot", weight="[" + ", ".join(map(str, wt.shape)) + "] in pairs of K")
    return kernel


def conv_k_block(k: int, trip: int, pairs: bool) -> int:
    """K per block of the implicit GEMM's k loop (0: all of K at once): from ``CONV_BLOCKED_K_FROM``,
    whole trips of the unrolled k loop, about ``CONV_BLOCK_K`` (504 for a 3×3 layer).

    For each K block every row tile of the strip accumulates (``cpu_gemm``), so the strip's block
    of weights stays in L1/L2 while the row tiles pass, where a strip over all of K — 64 columns ×
    4608 × 4 bytes = 1.2 MB for ResNet-50's 512→512 3×3 layers — is streamed from L3 once per row
    tile. Measured on 2 Ice Lake Xeon cores (1.25 MB of L2 each), GFLOP/s unblocked / blocked by
    512: 512→512 3×3 at 7×7 86 → 109 and 111 → 129 (two runs); at K = 1024–2304 (256→256 3×3 at
    14×14, the 1×1 layers 1024→256 and 2048→512) within ±8 % either way, run to run, so those stay
    unblocked. (On 2 Zen 3 cores with the 32-column tile, blocking had measured even at 7×7.)"""
    if not CONV_BLOCK_K or k < CONV_BLOCKED_K_FROM:
        return 0
    per = trip * (2 if pairs else 1)  # K per trip
    return max(1, CONV_BLOCK_K // per) * per


def unrolled_taps(window: tuple[int, ...]) -> int:
    """k steps per trip of the implicit GEMM's k loop: the whole window up to
    ``MAX_UNROLLED_TAPS`` taps (a 3×3 layer's loop runs once per input channel), else its innermost
    row (a 7×7 stem's loop once per channel and kernel row). Either way a tap's offset is the
    trip's plus a constant; with no unrolling each k step divided k by the window's sizes."""
    taps = math.prod(window)
    if taps <= 1:
        return 1
    if taps <= MAX_UNROLLED_TAPS:
        return taps
    return window[-1] if 1 < window[-1] <= MAX_UNROLLED_TAPS else 1


def layout_conv_weights(graph: Graph, groups: list[Group], target: TargetDesc) -> tuple[Graph, list[Node]]:
    """Give every implicit-GEMM convolution its ``[G, K, Cout_g]`` weight (``Group.packed``).

    A weight computed from the parameters alone is laid out at compile time: those layout nodes
    are returned, to be evaluated into constants. Any other weight — an input, as every weight of a
    training graph is, or a value computed per call, as the gradients a backward convolves with
    are — is laid out per call by a kernel of its own (an ``elementwise`` group inserted before the
    convolution's): one copy of the weight, read ``M / mr`` times by the GEMM afterwards, against a
    direct convolution that would otherwise run several times slower.

    The layout nodes are appended to the graph (after everything they read) so the program's
    graph names every buffer it holds: the artifact format and the dumps refer to buffers by node.
    ``groups`` gains the per-call layout groups in place."""
    layouts = [(g, g.anchor.inputs[1], gemm_weight(g.anchor, target)) for g in groups
               if g.kind == "conv" and uses_gemm(g.anchor)]
    return append_layouts(graph, layouts, groups)


def pointwise_as_matmul(graph: Graph, columns: int, target: TargetDesc) -> Graph:
    """A 1×1 convolution (stride 1, no padding, one group) → ``W[Cout, Cin] @ x[N, Cin, positions]``.

    It is that product already, and as a matmul the output channels are the rows and the positions
    the vector columns: B is the input, contiguous along the positions, and the stores are
    contiguous too — where the implicit GEMM (positions as rows) stores each micro-tile transposed
    into NCHW, 256 scalar stores per 1024 FMAs at ResNet's K = 64 (its 64→256 1×1 layer ran at 26 %
    of the FMA peak on an Emerald Rapids VM). The weight is read in place as the matmul's A.

    Only where the positions are whole strips of the micro-tile's ``columns``, or at least
    ``POINTWISE_MATMUL_MIN_POSITIONS`` of them. The matmul's last partial strip took a scalar path,
    strided through B, which at 14×14 or 7×7 positions cost more than the orientation saved
    (1024→256 at 14×14: 120 → 27 GFLOP/s); it now runs the micro-kernel on a zero-padded copy
    (``cpu_gemm._pad_strip``). With the implicit GEMM on the wide tile (``kernels.wide_tile``), on
    2 Ice Lake Xeon cores, GFLOP/s implicit GEMM / ``W @ x``, 1×1 layers with BN and ReLU: at 28×28
    (784 positions, 24.5 strips) the matmul is ahead — 128→512 124 / 146, 512→128 101 / 145,
    32→192 54 / 78, 192→32 72 / 99, 256→64 even — and at 14×14 and 7×7 the implicit GEMM —
    256→1024 141 / 125, 1024→256 164 / 141, 512→2048 142 / 87, 64→384 84 / 62, 384→64 113 / 73
    (on 2 Zen 3 cores, before the wide tile, they had measured even at 14×14 and 7×7).

    Nor where the layer runs on the bf16 pair dot (:func:`uses_pair_conv`) with at least
    ``PAIR_POINTWISE_MIN_K`` input channels: the pair dot needs B laid out in pairs of K, which the
    weight is and the activation is not, so as ``W @ x`` both operands would widen to f32 at half
    the rate. ResNet-50's layers in bf16, 2 Zen 4 cores, GFLOP/s implicit GEMM on pairs against
    ``W @ x`` widened: 256→64 at 56×56 172 / 102, 512→128 at 28×28 318 / 177, 128→512 254 / 151;
    with 64 input channels the transposed NCHW stores weigh against 32 pair steps and the two
    measured even or the matmul ahead (64→256 155–190 / 161–177, 64→64 110 / 137)."""

    def fn(n: Node) -> Node | None:
        if (n.op != "conv" or n.attr("groups") != 1
                or (uses_pair_conv(n, target) and n.inputs[1].shape[1] >= PAIR_POINTWISE_MIN_K)):
            return None
        x, w = n.inputs
        sp = n.shape[2:]
        if (is_symbolic(n.shape) or any(d != 1 for d in w.shape[2:]) or any(n.attr("padding"))
                or any(s != 1 for s in n.attr("stride"))
                or (math.prod(sp) % columns and math.prod(sp) < POINTWISE_MATMUL_MIN_POSITIONS)):
            return None
        b = GraphBuilder()
        b.loc = n.loc
        batch, cin, cout, positions = x.shape[0], x.shape[1], w.shape[0], math.prod(sp)
        out = b.matmul(b.reshape(w, (cout, cin)), b.reshape(x, (batch, cin, positions)))
        return b.reshape(out, n.shape)

    return rebuild(graph, fn)


def explicit_padding(graph: Graph) -> Graph:
    """``conv(x, padding=p)`` → ``conv(pad(x, p), padding=0)`` for the implicit-GEMM convolutions.

    The padded input is stored once (``partition`` stores a convolution's ``pad`` operand), so the
    micro-kernel's reads need no bounds check: each costs one add from its row's base offset.
    The copy is cheap beside the convolution: every element is read ``Cout · kernel size`` times."""

    def fn(n: Node) -> Node | None:
        if n.op != "conv" or not any(n.attr("padding")) or not uses_gemm(n):
            return None
        pads = n.attr("padding")
        b = GraphBuilder()
        b.loc = n.loc
        xp = b.pad(n.inputs[0], (0, 0, *pads), (0, 0, *pads))
        return make_node("conv", (xp, n.inputs[1]), {**n.attr_dict, "padding": (0,) * len(pads)}, n.loc)

    return rebuild(graph, fn)


def is_depthwise(cv: Node) -> bool:
    """One input channel per group and at most 2 spatial dims: the row-vectorised mapping below."""
    return cv.inputs[1].shape[1] == 1 and len(cv.shape) in (3, 4) and not uses_gemm(cv)


def depthwise_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """Depthwise convolution, vectorised along the output row.

    A block takes a chunk of output rows (batch, channel, output row); per row, every kernel tap
    ``(kh, kw)`` adds ``x[.., ih, ow·s + kw·d - p] · w[c, kh, kw]`` into a local row of
    accumulators over the range of ``ow`` where the tap lands inside the input — computed at
    compile time per ``kw``, so the innermost loop has no bounds check and (at stride 1) reads
    contiguously: LLVM vectorises it. A tap row outside the input (``ih``) is skipped by one
    branch per row. Then the epilogue stores the row."""
    from sextant.schedule.kernels import _chunks, _loop, _row_loop, setup_kernel, store_epilogue

    cv = group.anchor
    x, w = cv.inputs
    if is_symbolic(cv.shape[2:]) or is_symbolic(x.shape[2:]):
        raise SymbolicShapeError("the CPU depthwise convolution needs static spatial sizes (its taps' ranges are "
                                 "computed at compile time)")
    one_d = len(cv.shape) == 3
    stride, padding, dilation = (((1,) if one_d else ()) + tuple(cv.attr(a)) for a in ("stride", "padding", "dilation"))
    batch, cout = cv.shape[:2]
    oh_n, ow_n = (1, cv.shape[2]) if one_d else cv.shape[2:]
    ih_n, iw_n = (1, x.shape[2]) if one_d else x.shape[2:]
    kh_n, kw_n = (1, w.shape[2]) if one_d else w.shape[2:]
    mult = cout // cv.attr("groups")  # output channels per input channel
    # The plane mapping: for rows shorter than two vectors but not than the kernel (a 7×7 kernel on a
    # 2×2 map has most taps outside, which the row mapping skips at compile time: measured faster), and
    # over an input that is a buffer (its reads are a flat offset within the plane, which a re-indexing
    # computed inline would misread; the CPU stores every conv input, partition.store_conv_inputs).
    if (not one_d and stride == (1, 1) and dilation == (1, 1) and kw_n <= ow_n < 2 * max(1, target.vector_bytes // 4)
            and (id(x) in stored or x.op in ("input", "param"))):
        return _depthwise_planes(group, stored, target, name)
    e, params, _ = setup_kernel(group, stored)
    acc_t = accum_dtype(cv.dtype)
    rows = batch * cout * oh_n
    blocks, per = _chunks(rows, target, ow_n * kh_n * kw_n)
    acc = Buffer("row", acc_t, ow_n, "local")

    def ix(nn: Expr, ci: Expr, ih: Expr, iw: Expr) -> tuple[Expr, ...]:
        return (nn, ci, iw) if one_d else (nn, ci, ih, iw)

    def row(r: Var) -> None:
        nn, co, oh = delinearize(r, (batch, cout, oh_n))
        ci = idiv(co, mult)
        _loop(e, ow_n, lambda j: e.emit(Store("row", j, Const(0.0, acc_t))), "z")
        for kh in range(kh_n):
            ih = e.bind(iadd(imul(oh, stride[0]), c(kh * dilation[0] - padding[0])), "ih")

            def taps(kh: int = kh, ih: Expr = ih) -> None:
                for kw in range(kw_n):
                    off = kw * dilation[1] - padding[1]
                    lo = max(0, -(off // stride[1]))  # first ow with ow·s + off ≥ 0 (ceil(-off / s))
                    hi = min(ow_n, (iw_n - 1 - off) // stride[1] + 1) if off < iw_n else 0  # past the last inside
                    if lo >= hi:
                        continue
                    wv = e.value(w, (co, c(0), c(kw)) if one_d else (co, c(0), c(kh), c(kw)))
                    wv = e.bind(wv if wv.dtype == acc_t else Cast(wv, acc_t), "w")

                    def tap(ow: Var, wv: Expr = wv, off: int = off) -> None:
                        xv = e.value(x, ix(nn, ci, ih, iadd(imul(ow, stride[1]), c(off))))
                        xv = xv if xv.dtype == acc_t else Cast(xv, acc_t)
                        e.emit(Store("row", ow, Binary("add", Load("row", ow, acc_t),
                                                       Binary("mul", xv, wv, acc_t), acc_t)))

                    _loop(e, hi, tap, "ow", start=c(lo))

            if one_d or (kh * dilation[0] - padding[0] >= 0 and (oh_n - 1) * stride[0] + kh * dilation[0]
                         - padding[0] < ih_n):
                taps()  # this tap row is inside the input for every output row
            else:
                inside = Binary("bitwise_and", Binary("ge", ih, c(0), DType.bool),
                                Binary("lt", ih, c(ih_n), DType.bool), DType.bool)
                with e.scope() as then:
                    taps()
                e.emit(If(inside, tuple(then)))

        def out(ow: Var) -> None:
            v = Load("row", ow, acc_t)
            e.regs[id(cv)] = e.bind(v if acc_t == cv.dtype else Cast(v, cv.dtype), "c")
            store_epilogue(e, group, (nn, co, ow) if one_d else (nn, co, oh, ow))
            e.regs.pop(id(cv))

        _loop(e, ow_n, out, "ow")

    if rows and ow_n:
        _row_loop(e, rows, per, row)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), local=(acc,))


def _depthwise_planes(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    """A stride-1 2-D depthwise convolution over short rows (7×7, 14×14, 28×28 maps), vectorised
    over the whole output plane instead of one row.

    A row of 7 or 14 outputs is shorter than two vectors: per row and tap the row mapping's loop
    ran scalar (MobileNet-V2's 14×14 depthwise layers at ~2% of the FMA peak). Here a block takes
    whole planes (batch, channel), and output position ``(oh, ow)`` is numbered ``q = oh·W + ow``
    with the *input's* row length ``W`` (columns ``ow ≥`` the output's width are computed and not
    stored: a pre-padded input, 16 columns for 14 outputs, wastes 1/8). Then a tap ``(kh, kw)``
    reads ``x[q + (kh - ph)·W + (kw - pw)]`` for every ``q`` — one contiguous stream — over the
    range of ``q`` that keeps the read inside the plane (computed at compile time; it excludes the
    rows outside the input), and a select drops the columns outside the row where a stored output
    can see them (only taps that reach into the zero padding). Then the epilogue stores the plane."""
    from sextant.schedule.kernels import _chunks, _loop, _row_loop, setup_kernel, store_epilogue

    cv = group.anchor
    x, w = cv.inputs
    batch, cout, oh_n, ow_n = cv.shape
    ih_n, iw_n = x.shape[2:]
    kh_n, kw_n = w.shape[2:]
    ph, pw = cv.attr("padding")
    mult = cout // cv.attr("groups")
    e, params, _ = setup_kernel(group, stored)
    acc_t = accum_dtype(cv.dtype)
    span = oh_n * iw_n  # output positions numbered with the input's row length
    blocks, per = _chunks(batch * cout, target, span * kh_n * kw_n)
    acc = Buffer("plane", acc_t, max(1, span), "local")
    zero = Const(0.0, acc_t)

    def one(r: Var) -> None:
        nn, co = delinearize(r, (batch, cout))
        ci = idiv(co, mult)
        _loop(e, span, lambda q: e.emit(Store("plane", q, zero)), "z")
        for kh in range(kh_n):
            for kw in range(kw_n):
                shift = kw - pw
                off = (kh - ph) * iw_n + shift
                lo, hi = max(0, -off), min(span, ih_n * iw_n - off)
                if lo >= hi or not (shift < iw_n and ow_n - 1 + shift >= 0):
                    continue  # no stored output sees this tap inside the input
                wv = e.value(w, (co, c(0), c(kh), c(kw)))
                wv = e.bind(wv if wv.dtype == acc_t else Cast(wv, acc_t), "w")
                masked = shift < 0 or ow_n - 1 + shift >= iw_n  # a stored column can fall outside the row

                def tap(q: Var, wv: Expr = wv, off: int = off, shift: int = shift, masked: bool = masked) -> None:
                    # the plane's flat offset as the last index (row-major, so the same address): a
                    # (src / W, src % W) pair hid from LLVM that the reads are contiguous when W is a
                    # power of two (16×16 maps ran 30% slower than with the row mapping)
                    xv = e.value(x, (nn, ci, c(0), iadd(q, c(off))))
                    xv = xv if xv.dtype == acc_t else Cast(xv, acc_t)
                    term = Binary("mul", xv, wv, acc_t)
                    if masked:
                        col = iadd(imod(q, iw_n), c(shift))
                        inside = Binary("bitwise_and", Binary("ge", col, c(0), DType.bool),
                                        Binary("lt", col, c(iw_n), DType.bool), DType.bool)
                        term = Select(inside, term, zero, acc_t)
                    e.emit(Store("plane", q, Binary("add", Load("plane", q, acc_t), term, acc_t)))

                _loop(e, hi, tap, "q", start=c(lo))

        def out(q: Expr, oh: Expr, ow: Expr) -> None:
            v = Load("plane", q, acc_t)
            e.regs[id(cv)] = e.bind(v if acc_t == cv.dtype else Cast(v, cv.dtype), "c")
            store_epilogue(e, group, (nn, co, oh, ow))
            e.regs.pop(id(cv))

        if iw_n == ow_n:  # every position is stored: one loop over the plane (it vectorises)
            _loop(e, span, lambda q: out(q, idiv(q, ow_n), imod(q, ow_n)), "q")
        else:
            _loop(e, oh_n, lambda oh: _loop(e, ow_n, lambda ow: out(iadd(imul(oh, iw_n), ow), oh, ow), "ow"), "oh")

    if batch * cout and span:
        _row_loop(e, batch * cout, per, one)
    return Kernel(name, tuple(params), (blocks, 1, 1), (1, 1, 1), tuple(e.stmts), local=(acc,))
