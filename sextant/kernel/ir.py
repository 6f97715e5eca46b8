"""Kernel IR: a loop-level SIMT program, as a GPU runs it.

A :class:`Kernel` is executed by every thread of every block of its launch grid. Threads see
their coordinates through :class:`Special` values (``tid.x``, ``bid.y``, ...), own mutable
scalar registers (:class:`Var`) and per-thread arrays (``local`` buffers), share ``shared``
buffers within a block, and synchronise with :class:`Barrier`. :class:`WarpReduce` combines a
value across the lanes of a warp.

The same IR is lowered to PTX (threads are hardware threads) and to the CPU (thread
dimensions become loops; a barrier splits them — see ``sextant/codegen``). Nodes are small
immutable dataclasses; expressions are hashable, so they can be memoised and simplified.

Index arithmetic is ``i32``. Values use the graph IR's dtypes (:class:`DType`); elementwise
math reuses the graph IR's op names and semantics (``exp``, ``maximum``, ``where``, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Union

from sextant.graph.dtypes import DType
from sextant.graph.symbolic import SymDim

INDEX = DType.i32  # the type of all index arithmetic


# -- expressions ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Const:
    value: int | float | bool
    dtype: DType = INDEX


class _HashOnce:
    """A slot for the hash of a node that is a dict key everywhere (range facts are keyed by
    registers, coordinates and compound expressions, the emitters memoise by index): a dataclass's
    hash builds and hashes a tuple of its fields, recursively, on every lookup."""

    __slots__ = ("_hash",)

    def __hash__(self) -> int:
        try:
            return self._hash  # type: ignore[no-any-return]
        except AttributeError:
            h = hash(tuple(getattr(self, f) for f in self.__match_args__))  # type: ignore[attr-defined]
            object.__setattr__(self, "_hash", h)
            return h


@dataclass(frozen=True, slots=True)
class Var(_HashOnce):
    """A per-thread scalar register (mutable through :class:`Assign`), a loop variable or a
    scalar kernel argument."""

    name: str
    dtype: DType = INDEX


@dataclass(frozen=True, slots=True)
class Special(_HashOnce):
    """Thread coordinates: ``tid``/``bid`` (thread index in block, block index in grid) and
    ``bdim``/``gdim`` (block and grid sizes), each with an axis ``x``/``y``/``z``."""

    kind: str  # "tid" | "bid" | "bdim" | "gdim"
    axis: str  # "x" | "y" | "z"

    @property
    def dtype(self) -> DType:
        return INDEX


@dataclass(frozen=True, slots=True)
class Unary(_HashOnce):
    op: str  # a graph-IR unary op name
    a: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Binary(_HashOnce):
    op: str  # a graph-IR binary op name (comparisons give bool)
    a: Expr
    b: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Select(_HashOnce):
    cond: Expr
    a: Expr
    b: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Cast(_HashOnce):
    a: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Load(_HashOnce):
    """Element ``index`` of a buffer (a kernel argument, a shared or a local buffer)."""

    buffer: str
    index: Expr
    dtype: DType


for _cls in (Var, Special, Unary, Binary, Select, Cast, Load):
    _cls.__hash__ = _HashOnce.__hash__  # type: ignore[method-assign]  # the dataclass set its own
Expr = Union[Const, Var, Special, Unary, Binary, Select, Cast, Load]  # noqa: UP007


# -- statements ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Assign:
    """``var = value``; the first assignment declares the register."""

    var: Var
    value: Expr


@dataclass(frozen=True, slots=True)
class Store:
    buffer: str
    index: Expr
    value: Expr


@dataclass(frozen=True, slots=True)
class AtomicAdd:
    """``buffer[index] += value`` as one indivisible read-modify-write of a ``global`` buffer:
    threads that add to the same element all land, in an unspecified order (PTX ``red.global.add``
    through LLVM's ``atomicrmw``). What a scatter-add needs when many threads hit one element;
    a float sum's rounding then depends on the order, so it is not bitwise reproducible."""

    buffer: str
    index: Expr
    value: Expr


@dataclass(frozen=True, slots=True)
class For:
    """``for var in range(start, stop, step)``; ``unroll`` is a hint to code generation."""

    var: Var
    start: Expr
    stop: Expr
    step: int
    body: tuple[Stmt, ...]
    unroll: bool = False


@dataclass(frozen=True, slots=True)
class If:
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...] = ()


@dataclass(frozen=True, slots=True)
class Barrier:
    """All threads of the block reach this point before any continues (``bar.sync 0``)."""


@dataclass(frozen=True, slots=True)
class WarpReduce:
    """``var = op(value over the lanes of this thread's warp)``, every lane gets the result.

    ``width`` lanes (a power of two ≤ the warp size) form each group; on the GPU a butterfly of
    ``shfl.sync.bfly``; on the CPU an exchange through a per-thread array. All lanes of the
    warp must execute it (like a barrier)."""

    var: Var
    op: str  # "sum" | "max" | "min" | "prod"
    value: Expr
    width: int = 32


# -- tensor-core (warp-collective) and asynchronous-copy statements -----------------------------
@dataclass(frozen=True, slots=True)
class Mma:
    """``d = a · b + c`` for one ``M×N×K`` tile, computed by the 32 lanes of a warp together
    (PTX ``mma.sync.aligned.m16n8k16.row.col``): each lane holds a *fragment* of every operand —
    a run of elements of a ``local`` buffer starting at ``*_off`` — laid out as the PTX ISA
    defines (``sextant.kernel.fragments``). ``a``/``b`` are f16 or bf16 (or f32 read as tf32 for
    ``m16n8k8``); ``c``/``d`` f32 (or f16 with f16 inputs). Every lane of the warp executes it,
    never under lane-divergent control flow; offsets are thread-uniform."""

    shape: tuple[int, int, int]  # (M, N, K): (16, 8, 16) or (16, 8, 8)
    d: str
    d_off: Expr
    a: str
    a_off: Expr
    b: str
    b_off: Expr
    c: str
    c_off: Expr


@dataclass(frozen=True, slots=True)
class LdMatrix:
    """``count`` (1, 2, 4) 8×8 matrices of 16-bit elements from ``shared`` memory into
    fragments, by the warp together (``ldmatrix.sync.aligned.m8n8.x{count}[.trans].b16``):
    lane ``l < 8·count`` gives, as ``index`` (in elements of ``src``), the start of row
    ``l % 8`` of matrix ``l // 8``; each lane receives 2 elements of each matrix into
    ``dst[dst_off + 2j …]`` (row ``l // 4``, columns ``2(l % 4) …``; ``trans``: the transposed
    matrix). Rows are 16-byte aligned."""

    dst: str
    dst_off: Expr
    src: str
    index: Expr
    count: int = 4
    trans: bool = False


@dataclass(frozen=True, slots=True)
class CpAsync:
    """Start copying ``count`` elements (4, 8 or 16 bytes, naturally aligned) from global
    ``src[src_index]`` to shared ``dst[dst_index]`` (``cp.async``); the copy belongs to the
    thread's current group, and the data may be read only after :class:`CpAsyncWait` (and, by
    other threads, a :class:`Barrier`). With ``pred`` false nothing is read and zeros are
    written (``src-size`` 0): the tile tail."""

    dst: str
    dst_index: Expr
    src: str
    src_index: Expr
    count: int
    pred: Expr | None = None


@dataclass(frozen=True, slots=True)
class CpAsyncCommit:
    """Close this thread's current group of :class:`CpAsync` copies (``cp.async.commit_group``)."""


@dataclass(frozen=True, slots=True)
class CpAsyncWait:
    """Wait until at most ``pending`` of this thread's committed groups are still in flight
    (``cp.async.wait_group``): the copies of all older groups are then complete."""

    pending: int = 0


# -- the CPU's bf16 dot-product instruction -----------------------------------------------------
@dataclass(frozen=True, slots=True)
class PairDot:
    """``acc[acc_off + l] += a_hi · b[b_off + 2l + 1] + a_lo · b[b_off + 2l]`` for ``l < lanes``:
    ``lanes`` f32 accumulators each take the dot product of one pair of bf16 values of A (the same
    pair for every lane, a GEMM row's ``A[i, k]``, ``A[i, k+1]``) with its own pair of B (B laid
    out in pairs of consecutive K, "VNNI" order). x86's AVX-512-BF16 ``vdpbf16ps`` does it in one
    instruction (``codegen/cpu_matrix.py``); elsewhere it is vector f32 arithmetic with the same
    rounding: the products are exact in f32, added to the accumulator high one first, each add
    rounded. ``acc`` is an f32 ``local`` buffer, ``b`` a bf16 buffer, ``a_lo``/``a_hi`` bf16
    values; a CPU statement (a one-thread block), which the GPU lowering refuses."""

    acc: str
    acc_off: Expr
    a_lo: Expr
    a_hi: Expr
    b: str
    b_off: Expr
    lanes: int = 16


PAIR_DOT_LANES = (4, 8, 16)  # 128-, 256- and 512-bit vectors of f32


@dataclass(frozen=True, slots=True)
class TileMatmul:
    """A bf16 GEMM micro-tile on x86's AMX matrix tiles: over all of ``k``,

    ``out[r·C + c] = Σ_q A[a_off + r·a_stride + q] · B(q, c)`` for ``r < 16·row_tiles``,
    ``c < C = 16·col_tiles``, where B is laid out in pairs of K per strip of 16 columns (the pair
    dot's ``[strips, K/2, 16, 2]``): column ``16t + j`` of B at ``b_off + t·b_tile_stride +
    (q/2)·32 + 2j + q%2``. ``out`` (f32, local) is overwritten, not accumulated into.

    With AMX (``codegen/cpu_amx.py``) each k step of 32 is ``row_tiles`` + ``col_tiles`` tile loads
    and ``row_tiles·col_tiles`` ``tdpbf16ps``, the accumulators staying in tile registers; 2×2
    (4 accumulators + 2 + 2 operands) fills AMX's eight. Elsewhere (another CPU, the checked and
    counting builds) it is the same sums as pair dots (:func:`sextant.kernel.tiles.expand_tiles`):
    the products of bf16 values are exact in f32, only the order of the f32 adds may differ from
    the instruction's. A CPU statement (a one-thread block)."""

    out: str
    a: str
    a_off: Expr
    a_stride: int  # elements between A's rows (K for a row-major A read in place)
    b: str
    b_off: Expr
    b_tile_stride: int  # elements between B's strips of 16 columns
    k: int  # a multiple of TILE_K
    row_tiles: int = 2
    col_tiles: int = 2

    @property
    def rows(self) -> int:
        return TILE_ROWS * self.row_tiles

    @property
    def cols(self) -> int:
        return TILE_ROWS * self.col_tiles


TILE_ROWS, TILE_K = 16, 32  # an AMX tile: 16 rows of 64 bytes (16 f32 or 32 bf16 values)
AMX_TILES = 8  # tile registers


# -- Hopper (sm_90a): warpgroup MMA fed by TMA, mbarriers ------------------------------------------
@dataclass(frozen=True, slots=True)
class SmemMatrix:
    """A ``wgmma`` operand in shared memory, as its matrix descriptor describes it: K-major (or
    MN-major, ``major="mn"``), the descriptor's start address at element ``offset`` of ``buffer``;
    ``swizzle`` 0 (interleaved 8×16-byte core matrices) or 32/64/128 bytes (8-row atoms); ``lbo`` and
    ``sbo`` the descriptor's leading- and stride-dimension byte offsets (``sextant.kernel.wgmma`` has
    the layouts)."""

    buffer: str
    offset: Expr
    swizzle: int = 128
    lbo: int = 0
    sbo: int = 1024
    major: str = "k"  # "k": K contiguous; "mn": M (A) or N (B) contiguous, the instruction's transpose bit


@dataclass(frozen=True, slots=True)
class RegMatrix:
    """A ``wgmma`` A operand in registers: each thread's 8 f16/bf16 elements of the 64×16 tile are
    ``buffer[offset … offset+7]`` (a local buffer), in the layout ``kernel.wgmma.a_coord`` gives —
    that of ``mma.sync``'s m16n8k16 A fragment, warp ``w`` of the warpgroup holding rows ``16w …``.
    The D fragment of a previous wgmma, cast, is such an A (FlashAttention's P·V keeps P there)."""

    buffer: str
    offset: Expr


@dataclass(frozen=True, slots=True)
class Wgmma:
    """``D += A · Bᵀ`` for a 64×``n``×16 tile, by the 128 threads of a warpgroup together
    (``wgmma.mma_async.sync.aligned.m64nNk16.f32``): A (64×16) and B (``n``×16, B's columns) are
    f16/bf16 in shared memory (A may be in registers instead, a :class:`RegMatrix`); each thread's
    ``n/2`` f32 accumulators are ``d[d_off …]`` in the layout ``kernel.wgmma.d_coord`` gives.
    *Asynchronous*: issued after a :class:`WgmmaFence`, closed into a group by
    :class:`WgmmaCommit`; its accumulators may be read, and its operands overwritten, only after a
    :class:`WgmmaWait` covers that group."""

    n: int
    d: str
    d_off: Expr
    a: SmemMatrix | RegMatrix
    b: SmemMatrix


@dataclass(frozen=True, slots=True)
class WgmmaFence:
    """``wgmma.fence``: accumulator registers written before it are what the next wgmmas read."""


@dataclass(frozen=True, slots=True)
class WgmmaCommit:
    """``wgmma.commit_group``: the warpgroup's uncommitted wgmmas become one group."""


@dataclass(frozen=True, slots=True)
class WgmmaWait:
    """``wgmma.wait_group``: wait until at most ``pending`` groups are in flight. ``accs`` names the
    accumulator buffers of the wgmmas it waits for: the GPU lowering passes them through the wait
    (tied registers), so no read of them can move above it. A local ``i32`` buffer named there
    passes through too: what is computed from it stays below the wait (a persistent GEMM's
    epilogue addresses — LLVM sank them above it, and ptxas then serialised the wgmmas, C7514)."""

    pending: int
    accs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MbarrierInit:
    """``mbarrier.init``: barrier ``bar[index]`` (a shared ``i64``) expects ``count`` arrivals per
    phase; its phase 0 begins. One thread initialises; a :class:`Barrier` follows before use."""

    bar: str
    index: Expr
    count: int


@dataclass(frozen=True, slots=True)
class MbarrierArrive:
    """``mbarrier.arrive.expect_tx``: this thread arrives at ``bar[index]`` and announces ``tx``
    bytes of asynchronous copies (:class:`TmaLoad`) that complete its current phase. The phase
    completes when every expected thread has arrived and every announced byte has landed."""

    bar: str
    index: Expr
    tx: int = 0


@dataclass(frozen=True, slots=True)
class MbarrierWait:
    """``mbarrier.try_wait.parity`` in a loop: wait until the phase of ``bar[index]`` with parity
    ``parity`` (0 or 1: phases alternate) has completed. Thread-uniform control flow only."""

    bar: str
    index: Expr
    parity: Expr


@dataclass(frozen=True, slots=True)
class TmaLoad:
    """``cp.async.bulk.tensor.Nd`` (TMA): copy the ``box`` (rows, cols) of global ``src`` — viewed as
    a ``shape`` (rows, cols) matrix whose rows are ``stride`` elements apart — whose top-left element
    is ``(row, col)`` into shared ``dst[dst_off …]``, row-major and swizzled (``swizzle`` bytes, as
    ``kernel.wgmma.tma_box_offset``); elements outside the matrix read as zero. Completes on
    ``bar[bar_index]`` with the box's bytes. Issued by one thread; the tensor map it names is built by
    the runtime (``runtime.tensor_maps``) and passed as a kernel parameter.

    ``outer`` adds up to three dimensions outside the matrix (a batch of matrices, heads):
    coordinates ``outer[i]`` (outermost first) over ``outer_dims[i] = (size, stride)``, the box one
    element deep along each — the matrix copied is the one at those coordinates."""

    dst: str
    dst_off: Expr
    src: str
    row: Expr
    col: Expr
    box: tuple[int, int]
    shape: tuple[int, int]
    stride: int
    swizzle: int
    bar: str
    bar_index: Expr
    outer: tuple[Expr, ...] = ()
    outer_dims: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SetMaxNReg:
    """``setmaxnreg.{inc,dec}.sync.aligned.u32``: each thread of this warpgroup now has ``count``
    registers (24 to 256, a multiple of 8) — with ``inc`` it waits for them, without it gives the
    rest back. Warp specialisation: a producer that only issues copies shrinks, the consumers that
    hold accumulators grow. Every thread of the warpgroup executes it; the CPU ignores it."""

    count: int
    inc: bool


Stmt = Union[Assign, Store, AtomicAdd, For, If, Barrier, WarpReduce, Mma, LdMatrix, CpAsync, CpAsyncCommit,  # noqa: UP007
             CpAsyncWait, PairDot, TileMatmul, Wgmma, WgmmaFence, WgmmaCommit, WgmmaWait, MbarrierInit,
             MbarrierArrive, MbarrierWait, TmaLoad, SetMaxNReg]
WARP_COLLECTIVE = (WarpReduce, Mma, LdMatrix)  # every lane of the warp executes these together
ASYNC_COPY = (CpAsync, CpAsyncCommit, CpAsyncWait)
CPU_MATRIX = (PairDot, TileMatmul)  # the CPU's matrix statements (one-thread blocks)
HOPPER = (Wgmma, WgmmaFence, WgmmaCommit, WgmmaWait, MbarrierInit, MbarrierArrive, MbarrierWait, TmaLoad,
          SetMaxNReg)


def iter_stmts(stmts: Sequence[Stmt]) -> Iterator[Stmt]:
    """Every statement of ``stmts``, nested ones after the loop or branch holding them."""
    for s in stmts:
        yield s
        if isinstance(s, For):
            yield from iter_stmts(s.body)
        elif isinstance(s, If):
            yield from iter_stmts(s.then)
            yield from iter_stmts(s.orelse)


def stmt_operands(s: Stmt) -> tuple[Expr, ...]:
    """The expressions a tensor-core, async-copy or pair-dot statement evaluates (offsets, indices,
    predicate, values)."""
    if isinstance(s, Mma):
        return (s.d_off, s.a_off, s.b_off, s.c_off)
    if isinstance(s, LdMatrix):
        return (s.dst_off, s.index)
    if isinstance(s, CpAsync):
        return (s.dst_index, s.src_index) + ((s.pred,) if s.pred is not None else ())
    if isinstance(s, PairDot):
        return (s.acc_off, s.a_lo, s.a_hi, s.b_off)
    if isinstance(s, TileMatmul):
        return (s.a_off, s.b_off)
    if isinstance(s, Wgmma):
        return (s.d_off, s.a.offset, s.b.offset)
    if isinstance(s, MbarrierInit | MbarrierArrive):
        return (s.index,)
    if isinstance(s, MbarrierWait):
        return (s.index, s.parity)
    if isinstance(s, TmaLoad):
        return (s.dst_off, s.row, s.col, s.bar_index, *s.outer)
    return ()


def map_operands(s: Stmt, fn: Callable[[Expr], Expr]) -> Stmt:
    """``s`` with ``fn`` applied to each expression :func:`stmt_operands` lists."""
    if isinstance(s, Mma):
        return dataclasses.replace(s, d_off=fn(s.d_off), a_off=fn(s.a_off), b_off=fn(s.b_off), c_off=fn(s.c_off))
    if isinstance(s, LdMatrix):
        return dataclasses.replace(s, dst_off=fn(s.dst_off), index=fn(s.index))
    if isinstance(s, CpAsync):
        return dataclasses.replace(s, dst_index=fn(s.dst_index), src_index=fn(s.src_index),
                                   pred=None if s.pred is None else fn(s.pred))
    if isinstance(s, PairDot):
        return dataclasses.replace(s, acc_off=fn(s.acc_off), a_lo=fn(s.a_lo), a_hi=fn(s.a_hi), b_off=fn(s.b_off))
    if isinstance(s, TileMatmul):
        return dataclasses.replace(s, a_off=fn(s.a_off), b_off=fn(s.b_off))
    if isinstance(s, Wgmma):
        return dataclasses.replace(s, d_off=fn(s.d_off), a=dataclasses.replace(s.a, offset=fn(s.a.offset)),  # type: ignore[arg-type]
                                   b=dataclasses.replace(s.b, offset=fn(s.b.offset)))
    if isinstance(s, MbarrierInit | MbarrierArrive):
        return dataclasses.replace(s, index=fn(s.index))
    if isinstance(s, MbarrierWait):
        return dataclasses.replace(s, index=fn(s.index), parity=fn(s.parity))
    if isinstance(s, TmaLoad):
        return dataclasses.replace(s, dst_off=fn(s.dst_off), row=fn(s.row), col=fn(s.col), bar_index=fn(s.bar_index),
                                   outer=tuple(fn(x) for x in s.outer))
    return s


# -- kernels ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Size:
    """A symbolic size the kernel takes as a scalar ``i32`` argument (after its buffers), read in the
    body as ``Var("n_" + name)``; ``lo``/``hi`` are the size's declared range, which range analysis
    assumes and the runtime checks."""

    name: str
    lo: int
    hi: int

    @property
    def var(self) -> Var:
        return size_var(self.name)


SIZE_PREFIX = "n_"  # a size parameter's register name: ``n_seq`` (emitted registers end in a number)


def size_var(name: str) -> Var:
    """The register a kernel reads size ``name`` from."""
    return Var(SIZE_PREFIX + name, INDEX)


@dataclass(frozen=True, slots=True)
class Buffer:
    """A kernel argument (global memory), a block's ``shared`` buffer, or a thread's ``local`` array."""

    name: str
    dtype: DType
    size: int | SymDim  # elements (symbolic only for the global buffers of a kernel with ``sizes``)
    space: str = "global"  # "global" | "shared" | "local"
    role: str = "in"  # for global buffers: "in" | "out" | "inout"


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[Buffer, ...]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    body: tuple[Stmt, ...]
    shared: tuple[Buffer, ...] = ()
    local: tuple[Buffer, ...] = ()
    meta: dict = field(default_factory=dict, compare=False)  # e.g. the graph nodes it computes
    # symbolic sizes taken as scalar arguments; with them ``grid`` is a capacity (the grid at the
    # sizes' upper bounds) and each launch says how many blocks it runs (``kernel/sizes.py``)
    sizes: tuple[Size, ...] = ()

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def num_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def buffer(self, name: str) -> Buffer:
        for b in (*self.params, *self.shared, *self.local):
            if b.name == name:
                return b
        raise KeyError(f"kernel {self.name} has no buffer {name!r}")


# -- small constructors used by schedules ----------------------------------------------------
def c(v: int) -> Const:
    return Const(v, INDEX)


def add(a: Expr, b: Expr) -> Expr:
    return Binary("add", a, b, expr_dtype(a))


def mul(a: Expr, b: Expr) -> Expr:
    return Binary("mul", a, b, expr_dtype(a))


def lt(a: Expr, b: Expr) -> Expr:
    return Binary("lt", a, b, DType.bool)


def expr_dtype(e: Expr) -> DType:
    return e.dtype
