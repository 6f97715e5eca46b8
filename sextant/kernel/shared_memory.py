"""How a GPU kernel's ``shared`` buffers are laid out: sizes, alignments, and when they become one
dynamic array. Kernel-IR facts that the PTX lowering, the CUDA runtime (the launch's dynamic size)
and the dumps and reports (a block's shared bytes beside ptxas's figure) all need — below all of
them in the pipeline, so none imports the code generator for them."""

from __future__ import annotations

from sextant.kernel.ir import Kernel, SmemMatrix, TmaLoad, Wgmma, iter_stmts
from sextant.kernel.wgmma import SWIZZLE_ALIGN

MAX_STATIC_SHARED = 48 * 1024  # more is dynamic shared memory (opted into per kernel at load time)


def shared_bytes(k: Kernel) -> int:
    """The bytes of ``k``'s shared buffers, unaligned."""
    return sum(s.size * s.dtype.itemsize for s in k.shared)


def shared_alignment(k: Kernel) -> dict[str, int]:
    """Shared buffers that need more than 16-byte alignment: a TMA destination 128 bytes, a swizzled
    TMA destination or wgmma operand 1024 (the swizzle is a function of the address's bits 4-9)."""
    out: dict[str, int] = {}

    def need(name: str, a: int) -> None:
        out[name] = max(out.get(name, 16), a)

    for s in iter_stmts(k.body):
        if isinstance(s, TmaLoad):
            need(s.dst, SWIZZLE_ALIGN if s.swizzle else 128)
        elif isinstance(s, Wgmma):
            for m in (s.a, s.b):
                if isinstance(m, SmemMatrix):
                    need(m.buffer, SWIZZLE_ALIGN if m.swizzle else 16)
    return out


def shared_offsets(k: Kernel) -> tuple[list[int], int]:
    """Each shared buffer's byte offset in one dynamic array (16-byte aligned: vector and
    ``ldmatrix``/``cp.async`` accesses; more for TMA and swizzled wgmma operands), and the array's size."""
    offsets, end = [], 0
    align = shared_alignment(k)
    for s in k.shared:
        a = align.get(s.name, 16)
        end = -(-end // a) * a
        offsets.append(end)
        end += -(-s.size * s.dtype.itemsize // 16) * 16
    return offsets, end


def dynamic_shared_bytes(k: Kernel) -> int:
    """The dynamic shared memory ``k`` is launched with: 0 when its buffers fit the static 48 KiB."""
    return shared_offsets(k)[1] if shared_bytes(k) > MAX_STATIC_SHARED else 0


def block_shared_bytes(k: Kernel, ptxas_static: int) -> int:
    """The shared memory one block of ``k`` uses: ptxas's figure counts only the static
    declarations, so the dynamic array (a kernel past 48 KiB) is added to it."""
    return ptxas_static + dynamic_shared_bytes(k)
