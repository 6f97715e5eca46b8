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

from dataclasses import dataclass, field
from typing import Union

from sextant.graph.dtypes import DType

INDEX = DType.i32  # the type of all index arithmetic


# -- expressions ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Const:
    value: int | float | bool
    dtype: DType = INDEX


class _HashOnce:
    """A slot for the hash of a leaf node that is a dict key everywhere (range facts are keyed by
    registers and coordinates): a dataclass's hash builds and hashes a tuple on every lookup."""

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
class Unary:
    op: str  # a graph-IR unary op name
    a: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Binary:
    op: str  # a graph-IR binary op name (comparisons give bool)
    a: Expr
    b: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Select:
    cond: Expr
    a: Expr
    b: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Cast:
    a: Expr
    dtype: DType


@dataclass(frozen=True, slots=True)
class Load:
    """Element ``index`` of a buffer (a kernel argument, a shared or a local buffer)."""

    buffer: str
    index: Expr
    dtype: DType


Var.__hash__ = Special.__hash__ = _HashOnce.__hash__  # type: ignore[method-assign]  # the dataclass set its own
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


Stmt = Union[Assign, Store, For, If, Barrier, WarpReduce]  # noqa: UP007


# -- kernels ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Buffer:
    """A kernel argument (global memory), a block's ``shared`` buffer, or a thread's ``local`` array."""

    name: str
    dtype: DType
    size: int  # elements
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
