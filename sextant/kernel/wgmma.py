"""Hopper's warpgroup MMA and tensor-memory-accelerator layouts, as plain functions.

Like ``fragments`` for ``mma.sync``, every user reads the layouts from here: the schedules
(which accumulator of which thread is output ``(row, col)``; how to lay a tile out in shared
memory and describe it), the CPU emulation (``codegen.cpu_hopper``: which shared-memory element
a descriptor names, where a TMA box lands), the NVPTX lowering (the descriptor's bits) and the
docs. Sources: PTX ISA §9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"
(register fragments of D for ``.m64nNk16``; the shared-memory matrix descriptor and its
canonical K-major layouts) and §5.5 "Tensor Access Modes" / the CUDA driver's
``CU_TENSOR_MAP_SWIZZLE_*`` (the swizzle pattern TMA writes).

**D fragments.** A warpgroup is 4 consecutive warps (128 threads, the first warp's id a multiple
of 4); warp ``w`` of it holds rows ``16w … 16w+15`` of the 64-row result. In each warp, with
``g = lane >> 2`` and ``t = lane % 4`` as for ``mma.sync``, accumulator ``i`` (of ``N/2``) is
row ``16w + g + 8·((i >> 1) & 1)``, column ``8·(i >> 2) + 2t + (i & 1)``: the m16n8 C layout
repeated over the ``N/8`` column blocks.

**Shared-memory operands.** A is 64×K, B is N×K (B's columns, "K-major": for ``x @ W.T`` the
weight as it is stored) — or MN-major (the instruction's transpose bit: ``x @ W`` with ``W``
stored K×N, see :func:`mnmajor_offset`). Both are read through a 64-bit *matrix descriptor*:
start address, leading- and stride-dimension byte offsets (LBO, SBO) and a swizzle mode.

* No swizzle ("interleaved"): the matrix is tiled into *core matrices* of 8 rows × 16 bytes,
  each stored as 128 contiguous bytes (row ``r % 8`` at ``16·(r % 8)``); core matrices that
  follow along K are LBO bytes apart, along M/N SBO bytes apart.
* Swizzle of S = 32, 64 or 128 bytes: 8 rows of S bytes each (row ``r % 8`` at ``S·(r % 8)``,
  K contiguous within it) form an *atom*; atoms that follow along M/N are SBO bytes apart
  (LBO is not used: one instruction's K of 16 elements never leaves the row). The 16-byte
  chunks of each row are permuted by XOR with the row: address bits ``[4, 4+log2(S/16))`` ^=
  bits ``[7, 7+log2(S/16))``. The pattern is a function of the *address*, so a swizzled
  buffer starts at a multiple of 1024 bytes and the K steps of one row advance the start by
  32 bytes (16 f16) — exactly what TMA writes with the same swizzle.
"""

from __future__ import annotations

from dataclasses import dataclass

from sextant.kernel.ir import For, If, Stmt, TmaLoad

WARPGROUP = 128  # threads
WGMMA_M = 64
SWIZZLES = (0, 32, 64, 128)  # bytes; 0 is the interleaved (unswizzled) core-matrix layout
_MODE = {0: 0, 128: 1, 64: 2, 32: 3}  # the descriptor's bits 62-63
SWIZZLE_ALIGN = 1024  # bytes: a swizzled buffer's start (the pattern repeats every 8 rows of 128 B)
CORE_ROWS, CORE_BYTES = 8, 16
MAX_TMA_BOX = 256  # elements per box dimension


def d_coord(thread: int, i: int) -> tuple[int, int]:
    """``(row, col)`` of wgmma accumulator ``i`` of warpgroup thread ``thread`` (any N)."""
    warp, lane = (thread % WARPGROUP) >> 5, thread & 31
    g, t = lane >> 2, lane & 3
    return 16 * warp + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1)


def a_coord(thread: int, i: int) -> tuple[int, int]:
    """``(row, k)`` of element ``i`` (of 8) of warpgroup thread ``thread``'s A fragment when A is in
    registers (``RegMatrix``): the m16n8k16 A layout of ``mma.sync``, warp ``w`` holding rows
    ``16w …`` — pairs ``(g, 2t)``, ``(g+8, 2t)``, ``(g, 2t+8)``, ``(g+8, 2t+8)``."""
    warp, lane = (thread % WARPGROUP) >> 5, thread & 31
    g, t = lane >> 2, lane & 3
    return 16 * warp + g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)


REGISTERS_PER_SM = 65536


def launch_registers(threads: int) -> int:
    """The registers per thread a block of ``threads`` launches with when one block fills an SM
    (a multiple of 8, at most 255): the ``.maxnreg`` a kernel that moves registers between its
    warpgroups with ``setmaxnreg`` must declare — ptxas ignores ``setmaxnreg`` when the count at
    entry is not fixed (its C7508)."""
    return min(248, REGISTERS_PER_SM // threads // 8 * 8)


def wgmma_n_ok(n: int) -> bool:
    """N of an f16/bf16 ``wgmma``: a multiple of 8 from 8 to 256."""
    return isinstance(n, int) and 8 <= n <= 256 and n % 8 == 0


# -- shared-memory layouts --------------------------------------------------------------------
def kmajor_offset(row: int, k: int, itemsize: int, swizzle: int, lbo: int, sbo: int) -> int:
    """Byte offset from a descriptor's start address of element ``(row, k)`` of a K-major
    operand, *before* the swizzle (``swizzle_address`` applies it to the whole address)."""
    if swizzle == 0:
        per = CORE_BYTES // itemsize  # elements in a core-matrix row
        return (row // CORE_ROWS) * sbo + (k // per) * lbo + (row % CORE_ROWS) * CORE_BYTES + (k % per) * itemsize
    return (row // CORE_ROWS) * sbo + (row % CORE_ROWS) * swizzle + k * itemsize


def mnmajor_offset(mn: int, k: int, itemsize: int, swizzle: int, lbo: int, sbo: int) -> int:
    """The same for an MN-major operand (``transpose`` bit set: M or N contiguous — B of ``x @ W`` with
    ``W`` stored ``K × N``). Interleaved: core matrices of 8 K-rows × 16 bytes along MN, the next along
    MN ``sbo`` bytes away and along K ``lbo``; swizzled: rows of ``swizzle`` bytes along MN, one per K,
    8 K-rows an atom, atoms along K ``sbo`` apart and along MN ``lbo`` apart (LBO and SBO trade roles)."""
    if swizzle == 0:
        per = CORE_BYTES // itemsize
        return (mn // per) * sbo + (k // CORE_ROWS) * lbo + (k % CORE_ROWS) * CORE_BYTES + (mn % per) * itemsize
    per = swizzle // itemsize
    return (mn // per) * lbo + (k // CORE_ROWS) * sbo + (k % CORE_ROWS) * swizzle + (mn % per) * itemsize



def swizzle_address(addr: int, swizzle: int) -> int:
    """The shared-memory byte address a swizzled access of ``addr`` touches (16-byte chunk ^ row)."""
    if swizzle == 0:
        return addr
    bits = (swizzle // 16).bit_length() - 1  # 1, 2, 3
    mask = (1 << bits) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def descriptor(start: int, swizzle: int, lbo: int, sbo: int) -> int:
    """The 64-bit matrix descriptor: bits 0–13 start >> 4, 16–29 LBO >> 4, 32–45 SBO >> 4,
    62–63 the swizzle mode (0 none, 1 128 B, 2 64 B, 3 32 B); base offset 0."""
    return (((start & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32)
            | (_MODE[swizzle] << 62))


def descriptor_fields(desc: int) -> tuple[int, int, int, int]:
    """``(start, swizzle, lbo, sbo)`` back from a descriptor (for tests and dumps)."""
    mode = {v: k for k, v in _MODE.items()}[(desc >> 62) & 3]
    return (desc & 0x3FFF) << 4, mode, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def tma_box_offset(r: int, c: int, box_cols: int, itemsize: int, swizzle: int) -> int:
    """Byte offset, from the (aligned) destination, where TMA writes box element ``(r, c)``: the
    box row-major, each row ``box_cols·itemsize`` bytes, then the swizzle."""
    return swizzle_address((r * box_cols + c) * itemsize, swizzle)



# -- tensor maps ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMap:
    """What a ``TmaLoad`` needs the runtime to encode (``cuTensorMapEncodeTiled``) and pass as a
    128-byte ``__grid_constant__`` kernel parameter: global buffer ``src`` viewed as a
    ``shape`` (rows, cols) matrix with rows ``stride`` elements apart (one of a batch: ``outer_dims``),
    copied in ``box`` tiles with the ``swizzle``; out-of-bounds elements read as zero."""

    src: str
    shape: tuple[int, int]
    stride: int
    box: tuple[int, int]
    swizzle: int
    outer_dims: tuple[tuple[int, int], ...] = ()  # (size, stride) of dimensions outside the matrix, outermost first

    @property
    def rank(self) -> int:
        return 2 + len(self.outer_dims)


def tensor_map_of(s: TmaLoad) -> TensorMap:
    """The tensor map a ``TmaLoad`` statement reads through."""
    return TensorMap(s.src, s.shape, s.stride, s.box, s.swizzle, s.outer_dims)


def kernel_tensor_maps(body: tuple[Stmt, ...]) -> tuple[TensorMap, ...]:
    """The distinct tensor maps of a kernel body, in order of first use: the kernel's trailing
    parameters, after its buffers and sizes."""
    out: dict[TensorMap, None] = {}

    def walk(stmts: tuple[Stmt, ...]) -> None:
        for s in stmts:
            if isinstance(s, TmaLoad):
                out.setdefault(tensor_map_of(s))
            elif isinstance(s, For):
                walk(s.body)
            elif isinstance(s, If):
                walk(s.then)
                walk(s.orelse)

    walk(body)
    return tuple(out)
