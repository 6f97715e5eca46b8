"""Kernel IR → LLVM IR (NVPTX) → O3 → PTX: the GPU flavour of ``llvm_cpu``.

On the GPU the kernel IR's SIMT model is the hardware's, so the lowering is direct (no phases):

* each kernel is a ``ptx_kernel`` function with one ``ptr addrspace(1)`` parameter per global
  buffer (``kernel.params`` order) and ``.reqntid`` = its block, so ``bdim`` is a constant and
  ``tid`` gets a range (the driver refuses any other block shape); ``bid``/``gdim`` are read
  from ``%ctaid``/``%nctaid``;
* ``shared`` buffers are ``addrspace(3)`` globals (one per kernel and buffer) — or, past the
  48 KiB a block may declare statically, 16-byte-aligned slices of one ``extern`` dynamic shared
  array whose size the runtime passes at launch (:func:`dynamic_shared_bytes`, after raising the
  kernel's limit with ``cuFuncSetAttribute``); ``local`` buffers are allocas (SROA puts them in
  registers when every index is constant, else ``.local`` memory);
* ``Barrier`` is ``bar.sync 0``; ``WarpReduce`` a butterfly of ``shfl.sync.bfly`` (see
  :meth:`_Lowering._warp_reduce` for partial warps);
* scalar semantics are ``scalar_math``'s (torch's), with C math from libdevice
  (``libdevice.NvptxMath``): no LLVM math intrinsic NVPTX cannot select is ever emitted.

All kernels go into one module: libdevice is linked once, every non-kernel function is
internalised (so O3 inlines libdevice and global DCE drops the rest), and the NVPTX target
machine emits one PTX text.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import llvmlite.binding as llvm
from llvmlite import ir

from sextant.codegen import nvptx_hopper as hopper
from sextant.codegen import nvptx_tensor_core as tc
from sextant.codegen.errors import CodegenError
from sextant.codegen.libdevice import link_libdevice, nvptx_math
from sextant.codegen.llvm_cpu import _compile_lock, _init_llvm  # one LLVM context: one lock for all targets
from sextant.codegen.lowering import LoweringBase
from sextant.codegen.scalar_math import I1, I8, I16, I32, I64, ScalarMath, mem_type, reg_type
from sextant.codegen.simt import WARP_OPS, register_types
from sextant.graph.dtypes import DType
from sextant.kernel.devices import max_shared_bytes
from sextant.kernel.ir import (
    Barrier,
    Buffer,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    Expr,
    Kernel,
    LdMatrix,
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    Mma,
    PairDot,
    SetMaxNReg,
    Special,
    Stmt,
    TileMatmul,
    TmaLoad,
    Var,
    WarpReduce,
    Wgmma,
    WgmmaCommit,
    WgmmaFence,
    WgmmaWait,
)
from sextant.kernel.shared_memory import dynamic_shared_bytes, shared_alignment, shared_bytes, shared_offsets
from sextant.kernel.wgmma import TensorMap, kernel_tensor_maps

TRIPLE = "nvptx64-nvidia-cuda"
DEFAULT_ARCH = "sm_90"
GLOBAL, SHARED = 1, 3  # NVPTX address spaces
WARP = 32
# every global buffer starts 16-byte aligned (CUDA allocations are 256-byte aligned, the arena's
# offsets 64-byte aligned; the runtime copies a misaligned input view): lets 128-bit accesses form
PARAM_ALIGN = 16
_AXES = {"x": 0, "y": 1, "z": 2}
_SREG = {"tid": "tid", "bid": "ctaid", "bdim": "ntid", "gdim": "nctaid"}
_WARP_OP = {"sum": "add", "prod": "mul", "max": "maximum", "min": "minimum"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ARCH = re.compile(r"sm_(\d+)([af]?)\Z")
# the PTX ISA each GPU needs (the default, 8.0, covers sm_50 … sm_90a and CUDA ≥ 12.0's ptxas)
_MIN_PTX = {100: 86, 101: 86, 103: 88, 110: 90, 120: 87, 121: 88}


@dataclass(frozen=True)
class PtxKernel:
    """One ``.entry`` of a :class:`PtxModule` and how to launch it."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: tuple[str, ...]  # global buffers, in parameter order
    shared_bytes: int  # shared memory: static, or dynamic when over MAX_STATIC_SHARED
    tensor_maps: tuple[TensorMap, ...] = ()  # TMA descriptors passed after the sizes (runtime encodes them)


@dataclass(frozen=True)
class PtxModule:
    """The PTX of a set of kernels, and what produced it (for inspection and tests)."""

    ptx: str
    arch: str
    kernels: tuple[PtxKernel, ...]
    llvm_ir: str  # as lowered, before libdevice and O3
    optimized_ir: str
    libdevice: tuple[str, ...]  # the __nv_* functions linked in
    timings: dict[str, float] = field(default_factory=dict, compare=False)  # seconds per stage

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.kernels]

    def kernel(self, name: str) -> PtxKernel:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(f"no kernel {name!r} in this module (has {', '.join(self.names)})")


def ptx_features(arch: str, ptx_isa: int | None = None) -> str:
    """The target feature string selecting a PTX ISA version ``arch`` accepts: 8.0 unless the
    GPU needs newer (``ptx_isa``, e.g. 83 for 8.3, overrides; CUDA 13.0's ptxas reads ≤ 9.0)."""
    m = _ARCH.match(arch)
    if not m:
        raise CodegenError(f"unknown GPU architecture {arch!r}; expected e.g. 'sm_80' or 'sm_90a'")
    need = max(_MIN_PTX.get(int(m.group(1)), 80), 88 if m.group(2) == "f" else 80)
    return f"+ptx{ptx_isa if ptx_isa is not None else need}"


def nvptx_target_machine(arch: str = DEFAULT_ARCH, ptx_isa: int | None = None) -> llvm.TargetMachine:
    _init_llvm()
    target = llvm.Target.from_triple(TRIPLE)
    return target.create_target_machine(cpu=arch, features=ptx_features(arch, ptx_isa), opt=3)


def emit_llvm(kernels: Sequence[Kernel], tm: llvm.TargetMachine | None = None, arch: str = DEFAULT_ARCH) -> ir.Module:
    """The unoptimised NVPTX module holding every kernel (libdevice not linked yet); ``arch`` is
    what ``tm`` targets (tensor-core statements check it: NVPTX aborts on what it cannot select)."""
    tm = tm or nvptx_target_machine()
    module = ir.Module("sextant_nvptx")
    module.triple = TRIPLE
    module.data_layout = str(tm.target_data)
    # libdevice's __nvvm_reflect("__CUDA_FTZ"): keep denormals, as torch does
    module.add_named_metadata("llvm.module.flags", [ir.Constant(I32, 4), ir.MetaDataString(module, "nvvm-reflect-ftz"),
                                                    ir.Constant(I32, 0)])
    seen: set[str] = set()
    for k in kernels:
        if not _NAME.match(k.name):
            raise CodegenError(f"kernel name {k.name!r} is not a valid PTX identifier")
        if k.name in seen:
            raise CodegenError(f"two kernels are named {k.name!r}")
        seen.add(k.name)
        _Lowering(module, k, arch).emit()
    return module


def emit_ptx(kernels: Sequence[Kernel], arch: str = DEFAULT_ARCH, ptx_isa: int | None = None) -> PtxModule:
    """Lower ``kernels`` into one LLVM module, link libdevice, optimise at O3 for ``arch`` and
    emit PTX (``ptx_isa``: e.g. 80 for PTX 8.0; by default the oldest one ``arch`` accepts). No kernels
    (a model whose outputs are its inputs, weights or empty tensors) give a PTX module with none."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    tm = nvptx_target_machine(arch, ptx_isa)
    module = emit_llvm(kernels, tm, arch)
    text = hopper.grid_constant_params(str(module))
    timings["lower"] = time.perf_counter() - t0
    names = {k.name for k in kernels}
    with _compile_lock:
        t = time.perf_counter()
        try:
            llmod = llvm.parse_assembly(text)
            llmod.verify()
        except RuntimeError as e:  # a code generator bug: show the IR's first lines
            raise CodegenError(f"generated LLVM IR is invalid: {e}\n{text[:4000]}") from e
        timings["parse"] = time.perf_counter() - t
        t = time.perf_counter()
        linked = link_libdevice(llmod)
        for fn in llmod.functions:  # only the kernels are entry points
            if not fn.is_declaration and fn.name not in names:
                fn.linkage = llvm.Linkage.internal
        timings["libdevice"] = time.perf_counter() - t
        t = time.perf_counter()
        pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
        pb.getModulePassManager().run(llmod, pb)
        optimized = str(llmod)
        timings["optimize"] = time.perf_counter() - t
        t = time.perf_counter()
        asm = tm.emit_assembly(llmod)
        timings["emit"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    unresolved = re.findall(r"^\.extern \.func .*?(\w+)\s*\(", asm, re.MULTILINE)
    if unresolved:
        raise CodegenError(f"the PTX calls undefined function(s) {', '.join(unresolved)}")
    infos = tuple(PtxKernel(k.name, k.grid, k.block, tuple(p.name for p in k.params), shared_bytes(k),
                            kernel_tensor_maps(k.body)) for k in kernels)
    return PtxModule(asm, arch, infos, text, optimized, tuple(linked), timings)


_PTX_ENTRY = re.compile(r"^(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)\s*\(")


def ptx_entry_spans(ptx: str) -> dict[str, tuple[int, int]]:
    """The line range ``[start, end)`` of each ``.entry`` of a PTX text (header to its closing
    brace), by kernel name: the one place that splits PTX per kernel (dumps, report, docs)."""
    out: dict[str, tuple[int, int]] = {}
    lines = ptx.splitlines()
    i = 0
    while i < len(lines):
        m = _PTX_ENTRY.match(lines[i])
        if not m:
            i += 1
            continue
        start, depth, opened = i, 0, False
        while i < len(lines):
            depth += lines[i].count("{") - lines[i].count("}")
            opened = opened or "{" in lines[i]
            i += 1
            if opened and depth == 0:
                break
        out[m.group(1)] = (start, i)
    return out


def ptx_entries(ptx: str) -> dict[str, str]:
    """Each ``.entry`` of a PTX text (header to closing brace), by kernel name."""
    lines = ptx.splitlines()
    return {name: "\n".join(lines[a:b]) for name, (a, b) in ptx_entry_spans(ptx).items()}


def _sm(arch: str) -> int:
    """``sm_90a`` → 90; 0 for a name the lowering cannot read (ptx_features rejects it)."""
    m = _ARCH.match(arch)
    return int(m.group(1)) if m else 0


# -- lowering of one kernel ----------------------------------------------------------------------
class _Lowering(LoweringBase):
    def __init__(self, module: ir.Module, kernel: Kernel, arch: str = DEFAULT_ARCH):
        self.module = module
        self.kernel = kernel
        self.arch = arch
        gptr = ir.PointerType(addrspace=GLOBAL)
        # buffers, then the sizes of a kernel over symbolic sizes (i32 scalars: kernel/sizes.py)
        # ... then the tensor maps of its TMA loads (byval grid constants: nvptx_hopper.grid_constant_params)
        maps = kernel_tensor_maps(kernel.body)
        self.fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [gptr] * len(kernel.params) + [I32] * len(
            kernel.sizes) + [ir.PointerType()] * len(maps)), kernel.name)
        self.tensor_maps: dict[TensorMap, ir.Value] = {}
        for i, (tm, arg) in enumerate(zip(maps, self.fn.args[len(kernel.params) + len(kernel.sizes):], strict=True)):
            arg.name = hopper.tensor_map_param(i)
            self.tensor_maps[tm] = arg
        self.fn.calling_convention = "ptx_kernel"
        self.fn.attributes.add("nounwind")
        md = module.add_named_metadata("nvvm.annotations")  # LLVM ≥ 21 upgrades these to "nvvm.reqntid"
        for axis, n in zip("xyz", kernel.block, strict=True):
            md.add(module.add_metadata([self.fn, ir.MetaDataString(module, f"reqntid{axis}"), ir.Constant(I32, n)]))
        if kernel.meta.get("max_registers"):  # .maxnreg: the register budget the mapping's occupancy assumes
            md.add(module.add_metadata([self.fn, ir.MetaDataString(module, "maxnreg"),
                                        ir.Constant(I32, int(kernel.meta["max_registers"]))]))
        self.b = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.sm = _sm(arch)
        self.math = ScalarMath(module, self.b, nvptx_math(self.sm))
        self.buffers: dict[str, tuple[Buffer, ir.Value]] = {}
        self.slots: dict[str, ir.Value] = {}
        self.var_types: dict[str, DType] = {}
        self.memo: dict[int, tuple[Expr, ir.Value]] = {}
        self._ltid: ir.Value | None = None

    # -- storage -----------------------------------------------------------------------------
    def _preamble(self) -> None:
        k = self.kernel
        if min(k.block) < 1 or min(k.grid) < 1:
            raise self._fail(f"launch grid {k.grid} / block {k.block} has an empty dimension")
        if k.threads_per_block > 1024:
            raise self._fail(f"a block of {k.threads_per_block} threads exceeds the GPU's 1024")
        for p, arg in zip(k.params, self.fn.args[:len(k.params)], strict=True):
            if p.space != "global":
                raise self._fail(f"parameter {p.name} is in {p.space!r} memory, expected 'global'")
            arg.name = p.name
            arg.attributes.align = PARAM_ALIGN
            self.buffers[p.name] = (p, arg)
        if shared_bytes(k) > max_shared_bytes(self.sm):
            raise self._fail(f"{shared_bytes(k)} bytes of shared memory exceed the {max_shared_bytes(self.sm)} bytes "
                             f"a block may use on {self.arch} (48 KiB static, the rest dynamic)")
        if dynamic_shared_bytes(k):
            self._dynamic_shared(k)
        else:
            self._static_shared(k)
        for loc in k.local:
            a = self.b.alloca(ir.ArrayType(mem_type(loc.dtype), loc.size), name=f"local.{loc.name}")
            a.align = 16
            a.type = ir.PointerType()
            self.buffers[loc.name] = (loc, a)
        self.var_types = register_types(k, k.body)
        for name, dt in self.var_types.items():
            a = self.b.alloca(reg_type(dt), name=f"r.{name}")
            a.type = ir.PointerType()
            self.slots[name] = a
        for size, arg in zip(k.sizes, self.fn.args[len(k.params):len(k.params) + len(k.sizes)], strict=True):
            arg.name = size.var.name
            if size.var.name in self.slots:  # a size the body reads
                self.b.store(arg, self.slots[size.var.name])

    def read_var(self, v: Var) -> ir.Value:
        if v.name not in self.slots:
            raise self._fail(f"register {v.name!r} is not defined")
        return self.b.load(self.slots[v.name], typ=reg_type(v.dtype))

    def write_var(self, v: Var, value: ir.Value) -> None:
        self.b.store(value, self.slots[v.name])

    def _elem_ptr(self, name: str, index: ir.Value) -> tuple[Buffer, ir.Value]:
        if not isinstance(index.type, ir.IntType) or index.type.width < 32:
            raise self._fail(f"the index into {name} is not an i32/i64 value")
        if name not in self.buffers:
            raise self._fail(f"no buffer named {name!r}")
        buf, base = self.buffers[name]
        return buf, self.b.gep(base, [index], inbounds=True, source_etype=mem_type(buf.dtype))

    # -- structure ---------------------------------------------------------------------------
    def _static_shared(self, k: Kernel) -> None:
        """One internal ``.shared`` array per buffer (up to 48 KiB in all)."""
        align = shared_alignment(k)
        for s in k.shared:
            ty = ir.ArrayType(mem_type(s.dtype), s.size)
            g = ir.GlobalVariable(self.module, ty, f"{k.name}.{s.name}", addrspace=SHARED)
            g.linkage = "internal"
            g.initializer = ir.Constant(ty, ir.Undefined)  # .shared memory cannot be initialised
            g.align = align.get(s.name, 16)
            g.type = ir.PointerType(addrspace=SHARED)
            self.buffers[s.name] = (s, g)

    def _dynamic_shared(self, k: Kernel) -> None:
        """Shared buffers as slices of the kernel's ``extern .shared`` array (over 48 KiB)."""
        arr = ir.GlobalVariable(self.module, ir.ArrayType(I8, 0), f"{k.name}_dynamic_shared", addrspace=SHARED)
        arr.linkage = "external"
        arr.align = max([16, *shared_alignment(k).values()])
        arr.type = ir.PointerType(addrspace=SHARED)
        offsets, _ = shared_offsets(k)
        for s, off in zip(k.shared, offsets, strict=True):
            ptr = self.b.gep(arr, [self._i32(off)], source_etype=I8, name=f"{k.name}.{s.name}")
            self.buffers[s.name] = (s, ptr)

    def emit(self) -> None:
        self._preamble()
        self._stmts(self.kernel.body)
        self.b.ret_void()

    def _stmts(self, stmts: Sequence[Stmt]) -> None:
        for s in stmts:
            self._stmt(s)

    def _stmt(self, s: Stmt) -> None:
        self.memo = {}
        if self._structured_stmt(s):
            pass
        elif isinstance(s, Barrier):
            self._barrier()
        elif isinstance(s, WarpReduce):
            self._warp_reduce(s)
        elif isinstance(s, Mma):
            tc.mma(self, s)
        elif isinstance(s, LdMatrix):
            tc.ldmatrix(self, s)
        elif isinstance(s, CpAsync):
            tc.cp_async(self, s)
        elif isinstance(s, CpAsyncCommit | CpAsyncWait):
            tc.cp_async_group(self, s)
        elif isinstance(s, Wgmma):
            hopper.wgmma(self, s)
        elif isinstance(s, SetMaxNReg):
            hopper.set_max_nreg(self, s)
        elif isinstance(s, WgmmaFence | WgmmaCommit | WgmmaWait):
            hopper.wgmma_sync(self, s)
        elif isinstance(s, MbarrierInit | MbarrierArrive | MbarrierWait):
            hopper.mbarrier(self, s)
        elif isinstance(s, TmaLoad):
            hopper.tma_load(self, s)
        elif isinstance(s, PairDot):
            raise self._fail("a pair dot is the CPU's bf16 instruction (AVX-512-BF16); GPU kernels multiply bf16 "
                             "with mma.sync")
        elif isinstance(s, TileMatmul):
            raise self._fail("a tile matmul is the CPU's AMX instruction; GPU kernels multiply bf16 with mma.sync")
        else:
            raise self._fail(f"unknown statement {type(s).__name__}")

    # -- synchronisation ---------------------------------------------------------------------
    def _barrier(self) -> None:
        if llvm.llvm_version_info >= (21,):  # barrier0 is auto-upgraded to this since LLVM 21
            self.math.call("llvm.nvvm.barrier.cta.sync.aligned.all", ir.VoidType(), [self._i32(0)])
        else:
            self.math.call("llvm.nvvm.barrier0", ir.VoidType(), [])

    def _linear_tid(self) -> ir.Value:
        """The thread's index in its block, x fastest: hardware warps are consecutive ones."""
        if self._ltid is None:
            with self.b.goto_entry_block():  # once per kernel, dominating every use
                bx, by, _ = self.kernel.block
                tx, ty, tz = (self._special(Special("tid", a)) for a in "xyz")
                b, nsw = self.b, ["nsw", "nuw"]
                self._ltid = b.add(b.mul(b.add(b.mul(tz, self._i32(by), flags=nsw), ty, flags=nsw),
                                         self._i32(bx), flags=nsw), tx, flags=nsw)
        return self._ltid

    def _warp_reduce(self, s: WarpReduce) -> None:
        """``var = op(value over the lanes of this thread's group of width)``.

        When every group is full (threads per block a multiple of the width), a butterfly:
        log2(width) ``shfl.sync.bfly`` steps leave the result in every lane. A block whose
        size is not a multiple of the width has a partial last group, whose missing lanes a
        butterfly would read: there, a ``shfl.sync.down`` tree that skips lanes past the
        block's end gathers the result in the group's first lane, and ``shfl.sync.idx``
        broadcasts it. The member mask is the lanes of this warp that exist."""
        k, dt, w = self.kernel, s.var.dtype, s.width
        if s.op not in WARP_OPS:
            raise self._fail(f"WarpReduce op {s.op!r} is not one of {WARP_OPS}")
        if not (1 <= w <= WARP and w & (w - 1) == 0):
            raise self._fail(f"WarpReduce width {w} is not a power of two ≤ {WARP}")
        if s.value.dtype != dt:
            raise self._fail(f"WarpReduce into {s.var.name} ({dt.value}) of a {s.value.dtype.value} value")
        if s.op in ("sum", "prod") and dt == DType.bool:
            raise self._fail(f"WarpReduce {s.op} of bool")
        b, T = self.b, k.threads_per_block
        v = self._value(s.value)
        combine = lambda x, y: self.math.binary(_WARP_OP[s.op], x, y, dt)
        clamp = self._i32(((WARP - w) << 8) | (WARP - 1))  # segment of w lanes, as CUDA's width
        mask: ir.Value = self._i32(-1)
        if T % WARP:
            lanes = b.sub(self._i32(T), b.and_(self._linear_tid(), self._i32(~(WARP - 1))), flags=["nsw"])
            full = b.icmp_signed(">=", lanes, self._i32(WARP))
            mask = b.select(full, self._i32(-1), b.sub(b.shl(self._i32(1), lanes), self._i32(1)))
        if T % w == 0:
            off = w // 2
            while off:
                v = combine(v, self._shfl("bfly", mask, v, self._i32(off), clamp, dt))
                off //= 2
        else:
            ltid = self._linear_tid()
            lane = b.and_(ltid, self._i32(w - 1))
            valid = b.sub(self._i32(T), b.sub(ltid, lane), flags=["nsw"])  # lanes of this group that exist
            off = w // 2
            while off:
                other = self._shfl("down", mask, v, self._i32(off), clamp, dt)
                v = b.select(b.icmp_signed("<", b.add(lane, self._i32(off)), valid), combine(v, other), v)
                off //= 2
            v = self._shfl("idx", mask, v, self._i32(0), clamp, dt)
        self.write_var(s.var, v)

    def _shfl(self, mode: str, mask: ir.Value, v: ir.Value, lane: ir.Value, clamp: ir.Value, dt: DType) -> ir.Value:
        """One ``shfl.sync.MODE`` of a value of any dtype (as 32-bit words)."""
        b = self.b

        def word(x: ir.Value) -> ir.Value:
            kind = "f32" if x.type == ir.FloatType() else "i32"
            return self.math.call(f"llvm.nvvm.shfl.sync.{mode}.{kind}", x.type, [mask, x, lane, clamp])

        if v.type in (ir.FloatType(), I32):
            return word(v)
        if v.type == I64:
            lo, hi = b.trunc(v, I32), b.trunc(b.lshr(v, ir.Constant(I64, 32)), I32)
            lo, hi = word(lo), word(hi)
            return b.or_(b.zext(lo, I64), b.shl(b.zext(hi, I64), ir.Constant(I64, 32)))
        if v.type == ir.HalfType():
            r = word(b.zext(b.bitcast(v, I16), I32))
            return b.bitcast(b.trunc(r, I16), ir.HalfType())
        if v.type in (I1, I8, I16):
            return b.trunc(word(b.zext(v, I32)), v.type)
        raise self._fail(f"WarpReduce of {dt.value} is not supported")

    # -- expressions -------------------------------------------------------------------------
    def _special(self, e: Special) -> ir.Value:
        """``tid``/``bid``/``gdim`` from the special registers; ``bdim`` is the constant block
        (``.reqntid`` makes it exact) and ``tid`` gets its range, for LLVM's benefit."""
        if e.kind not in _SREG or e.axis not in _AXES:
            raise self._fail(f"unknown special register {e.kind}.{e.axis}")
        n = self.kernel.block[_AXES[e.axis]]
        if e.kind == "bdim":
            return self._i32(n)
        if e.kind == "tid" and n == 1:
            return self._i32(0)
        v = self.math.call(f"llvm.nvvm.read.ptx.sreg.{_SREG[e.kind]}.{e.axis}", I32, [])
        if e.kind == "tid":
            v.set_metadata("range", self.module.add_metadata([self._i32(0), self._i32(n)]))
        return v
