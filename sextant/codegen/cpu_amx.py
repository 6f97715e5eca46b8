"""The CPU's AMX tile matmul (:class:`~sextant.kernel.ir.TileMatmul`) as LLVM IR.

LLVM (llvmlite 0.50) selects AMX from its ``.internal`` intrinsics on values of type ``x86_amx``,
each call carrying the tile's shape (rows, bytes per row) as ``i16`` operands:
``llvm.x86.tilezero.internal``, ``llvm.x86.tileloadd64.internal`` (a base pointer and a row
stride in bytes), ``llvm.x86.tdpbf16ps.internal`` (M, N bytes, K bytes, then the accumulator and
both operands) and ``llvm.x86.tilestored64.internal``. The backend derives the tile
configuration from those shapes and writes ``ldtilecfg`` (and ``tilerelease``) itself. The
accumulators are ``x86_amx`` phis of the k loop, so they stay in tile registers for all of K:
per k step of 32, two tile loads of A (16 rows × 32 bf16, row stride K·2 bytes), two of B (16
pairs of K × 16 columns, 64 bytes apart: the pair dot's layout) and four ``tdpbf16ps``. After
the loop the four accumulators are stored to the statement's f32 local buffer, which the
epilogue reads as any other.

llvmlite's IR builder has no ``x86_amx`` type; a ``scalar_math.NamedType`` prints its name, which is
all the textual IR LLVM parses needs. Linux must grant a process the AMX state before its first tile
instruction (``sextant.host.host_amx`` asks, once per process); without the grant the first
``ldtilecfg`` is a SIGILL. Without AMX — another CPU, or the checked and counting builds — the
kernel's tile matmuls were expanded into pair dots before lowering (``kernel/tiles.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from sextant.codegen.scalar_math import F32, NamedType
from sextant.host import host_amx
from sextant.kernel.ir import TILE_K, TILE_ROWS, TileMatmul

if TYPE_CHECKING:
    from sextant.codegen.llvm_cpu import _KernelLowering

I16, I64 = ir.IntType(16), ir.IntType(64)
ROW_BYTES = 64  # every tile here: 16 rows of 64 bytes


AMX = NamedType("x86_amx")  # a tile register's value


def native_amx() -> bool:
    """Whether tile matmuls are lowered to AMX instructions (else expanded into pair dots first)."""
    return host_amx()


def tile_matmul(low: _KernelLowering, s: TileMatmul) -> None:
    b, m = low.b, low.math
    shape = [ir.Constant(I16, TILE_ROWS), ir.Constant(I16, ROW_BYTES)]
    zero = m.declare("llvm.x86.tilezero.internal", AMX, [I16, I16])
    load = m.declare("llvm.x86.tileloadd64.internal", AMX, [I16, I16, ir.PointerType(), I64])
    dot = m.declare("llvm.x86.tdpbf16ps.internal", AMX, [I16, I16, I16, AMX, AMX, AMX])
    store = m.declare("llvm.x86.tilestored64.internal", ir.VoidType(), [I16, I16, ir.PointerType(), I64, AMX])
    _, a_ptr = low._elem_ptr(s.a, low._value(s.a_off))
    _, b_ptr = low._elem_ptr(s.b, low._value(s.b_off))
    _, out_ptr = low._elem_ptr(s.out, low._i32(0))
    tiles = [(r, t) for r in range(s.row_tiles) for t in range(s.col_tiles)]
    zeros = [b.call(zero, shape) for _ in tiles]
    steps = s.k // TILE_K

    entry = b.block
    loop = b.append_basic_block("tiles.k")
    done = b.append_basic_block("tiles.done")
    b.branch(loop)
    b.position_at_end(loop)
    kt = b.phi(I64, "kt")
    accs = [b.phi(AMX, f"acc{r}{t}") for r, t in tiles]

    def at(ptr: ir.Value, elems: ir.Value | int, ty: ir.Type) -> ir.Value:
        off = elems if isinstance(elems, ir.Value) else ir.Constant(I64, elems)
        return b.gep(ptr, [off], inbounds=True, source_etype=ty)

    k_elems = b.mul(kt, ir.Constant(I64, TILE_K))  # A: 32 values of K per step
    pair_elems = b.mul(kt, ir.Constant(I64, TILE_K * TILE_ROWS))  # B: 16 pairs × 16 columns × 2 per step
    a_tiles = [b.call(load, [*shape, at(at(a_ptr, k_elems, I16), r * TILE_ROWS * s.a_stride, I16),
                             ir.Constant(I64, 2 * s.a_stride)]) for r in range(s.row_tiles)]
    b_tiles = [b.call(load, [*shape, at(at(b_ptr, pair_elems, I16), t * s.b_tile_stride, I16),
                             ir.Constant(I64, ROW_BYTES)]) for t in range(s.col_tiles)]
    new = [b.call(dot, [*shape, ir.Constant(I16, ROW_BYTES), acc, a_tiles[r], b_tiles[t]])
           for acc, (r, t) in zip(accs, tiles)]
    nxt = b.add(kt, ir.Constant(I64, 1))
    b.cbranch(b.icmp_unsigned("==", nxt, ir.Constant(I64, steps)), done, loop)
    kt.add_incoming(ir.Constant(I64, 0), entry)
    kt.add_incoming(nxt, loop)
    for phi, z, v in zip(accs, zeros, new):
        phi.add_incoming(z, entry)
        phi.add_incoming(v, loop)

    b.position_at_end(done)
    for v, (r, t) in zip(new, tiles):
        ptr = at(out_ptr, r * TILE_ROWS * s.cols + t * TILE_ROWS, F32)
        b.call(store, [*shape, ptr, ir.Constant(I64, 4 * s.cols), v])


def sapphire_rapids_assembly(kernels: list) -> str:
    """``kernels`` compiled at O3 for a Sapphire Rapids core (AMX, AVX-512-BF16), on any host: what
    the tile matmuls become where they run natively (for tests and docs on machines without AMX)."""
    import llvmlite.binding as llvm

    from sextant.codegen.llvm_cpu import _init_llvm, emit_module

    _init_llvm()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu="sapphirerapids", features="+amx-tile,+amx-bf16,+avx512f,+avx512bf16", opt=3)
    mod = llvm.parse_assembly(str(emit_module(kernels, tm, vector_bytes=64, amx=True)))
    mod.verify()
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    return tm.emit_assembly(mod)
