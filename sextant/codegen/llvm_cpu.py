"""Kernel IR → LLVM IR → O3 → MCJIT: SIMT kernels run faithfully on the host CPU.

Each kernel becomes ``void NAME(i8** args, i32 block_begin, i32 block_end)``: ``args`` holds
the global buffers in ``kernel.params`` order and the function runs the linear block ids
``[block_begin, block_end)`` one after another (the runtime spreads ranges over cores).

Within a block, the threads run as loops over the phases that ``simt.plan_kernel`` cut the
body into (a one-thread block runs its body directly). Every register gets a stack slot
(scalar, or one element per thread when it is live across phases) and LLVM's SROA/mem2reg
turns the scalars back into SSA values; ``shared`` buffers are one array per block
invocation, ``local`` buffers one array per thread where needed. Arrays larger than
``HEAP_BYTES`` (or past ``STACK_BYTES`` in all) come from ``malloc`` instead of the stack.

An unrolled loop whose iterations are independent lanes (``codegen.lanes``) is emitted as
``<W x T>`` vector code, W filling the host's vector registers. Each kernel is its own module,
optimised with the O3 pipeline for the host CPU (so loops vectorise with AVX2/AVX-512) and
compiled to an object — from the on-disk cache, or on all cores (``codegen.objects``); one
MCJIT engine loads them all.

``check_races=True`` (or ``SEXTANT_CHECK_RACES=1``) compiles a checked variant that catches
shared-memory races, out-of-bounds accesses and divergent warp reductions (``race_check``).
"""

from __future__ import annotations

import ctypes.util
import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir

from sextant.codegen import cpu_amx
from sextant.codegen import cpu_hopper as hopper
from sextant.codegen import cpu_tensor_core as tc
from sextant.codegen.counters import AccessCounter, CountInfo, CountingCpuModule
from sextant.codegen.cpu_matrix import pair_dot
from sextant.codegen.cpu_module import CpuModule, estimate_work
from sextant.codegen.errors import CodegenError
from sextant.codegen.lane_builder import LaneBuilder
from sextant.codegen.lanes import CONTIGUOUS, LanePlan, plan_lanes
from sextant.codegen.lowering import LoweringBase
from sextant.codegen.objects import DEFAULT_OPTIONS, PassOptions, build_objects, cache_key, optimize, source_fingerprint
from sextant.codegen.race_check import CheckedCpuModule, KernelChecker, checks_enabled, report_symbol
from sextant.codegen.scalar_math import I32, I64, ScalarMath, mem_type, reg_type
from sextant.codegen.simt import (
    Item,
    LdmRead,
    LdmStage,
    MmaCompute,
    MmaStage,
    Phase,
    PhaseStmt,
    SimtPlan,
    Sync,
    UniformFor,
    WgmmaCompute,
    WgmmaStage,
    XchgReduce,
    XchgStore,
    expr_loads,
    iter_stmts,
    plan_kernel,
)
from sextant.gcpause import gc_paused
from sextant.graph.dtypes import DType
from sextant.host import host_vector_bytes
from sextant.kernel.ir import (
    INDEX,
    Assign,
    Binary,
    Buffer,
    Const,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    Expr,
    For,
    Kernel,
    Load,
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    Mma,
    PairDot,
    Select,
    SetMaxNReg,
    Special,
    TileMatmul,
    TmaLoad,
    Var,
    Wgmma,
    WgmmaCommit,
    WgmmaFence,
    WgmmaWait,
)
from sextant.kernel.sizes import dim_expr
from sextant.kernel.tiles import expand_tiles

PTR = ir.PointerType()
HEAP_BYTES = 64 * 1024  # arrays larger than this are malloc'd, not on the (thread's) stack ...
STACK_BYTES = 256 * 1024  # ... and so is everything past this much stack per kernel
_AXES = {"x": 0, "y": 1, "z": 2}
_BYTES = {"i1": 1, "i8": 1, "i16": 2, "half": 2, "float": 4, "i32": 4, "i64": 8}
_WARP_OP = {"sum": "add", "prod": "mul", "max": "maximum", "min": "minimum"}

_init_lock = threading.Lock()
_compile_lock = threading.Lock()
_initialised = False


def _init_llvm() -> None:
    global _initialised
    with _init_lock:
        if _initialised:
            return
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        libm = ctypes.util.find_library("m")
        if libm:  # libm is normally in the process already; make sure MCJIT can resolve from it
            llvm.load_library_permanently(libm)
        _initialised = True


def host_target_machine() -> llvm.TargetMachine:
    """A target machine for this CPU (its name and features, so O3 uses AVX2/AVX-512/FMA).

    With AVX-512, 512-bit vectors are asked for: LLVM's tuning for Intel server cores (Sapphire/
    Emerald Rapids) prefers 256-bit ones, but the schedules size their register tiles by the widest
    vectors (``TargetDesc.vector_bytes``): an 8×32 matmul tile in ymm registers needs all 32 for its
    accumulators and spills (measured: Linear 768→768 on 128 rows 33 → 71 GFLOP/s on a loaded
    2-core Emerald Rapids)."""
    _init_llvm()
    target = llvm.Target.from_default_triple()
    features = llvm.get_host_cpu_features().flatten()
    if "+avx512f" in features.split(","):
        features += ",-prefer-256-bit"
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=features, opt=3, jit=True)


def emit_module(kernels: Sequence[Kernel], tm: llvm.TargetMachine | None = None, *,
                check_races: bool = False, lowerings: list[_KernelLowering] | None = None,
                vector_bytes: int | None = None, count_accesses: bool = False, amx: bool | None = None) -> ir.Module:
    """The unoptimised LLVM module holding ``kernels`` (no JIT); unrolled loops become vectors of
    ``vector_bytes`` (default: the host's widest registers); tile matmuls become AMX instructions
    when ``amx`` (default: where this process may run them), else pair dots."""
    tm = tm or host_target_machine()
    module = ir.Module("sextant_cpu")
    module.triple = tm.triple
    module.data_layout = str(tm.target_data)
    seen: set[str] = set()
    for k in kernels:
        if k.name in seen:
            raise CodegenError(f"two kernels are named {k.name!r}")
        seen.add(k.name)
        low = _KernelLowering(module, k, check_races, host_vector_bytes() if vector_bytes is None else vector_bytes,
                              count_accesses, amx)
        low.emit()
        if lowerings is not None:
            lowerings.append(low)
    return module


@functools.cache
def _lowering_fingerprint() -> str:
    """A hash of the source of everything that decides what LLVM IR a kernel becomes (this
    package, the kernel IR, the graph IR's op and dtype definitions): a cached object keyed by
    the kernel IR is stale as soon as any of it changes."""
    root = Path(__file__).resolve().parents[1]
    return source_fingerprint([*root.joinpath("codegen").glob("*.py"), *root.joinpath("kernel").glob("*.py"),
                               root / "graph" / "ops.py", root / "graph" / "dtypes.py"])


def kernel_key(kernel: Kernel, tm: llvm.TargetMachine, options: PassOptions, vector_bytes: int) -> str:
    """The cache key of a kernel's object, from its kernel IR (no LLVM IR needs generating to look
    it up): the IR's complete dataclass form, the lowering's source and the vector width, and
    what ``objects.cache_key`` adds (toolchain, host CPU, pass options). A kernel holding tile
    matmuls also keys on whether they become AMX instructions: an AMX CPU whose process Linux
    refused the tile state must not load another process's native object (a SIGILL)."""
    k = kernel
    ir_form = repr((k.name, k.params, k.grid, k.block, k.body, k.shared, k.local, k.sizes, k.meta.get("grid")))
    tiles = any(isinstance(s, TileMatmul) for s in iter_stmts(k.body))
    lowering = f"{vector_bytes} amx={cpu_amx.native_amx()}" if tiles else f"{vector_bytes}"
    return cache_key(f"kernel-ir {_lowering_fingerprint()} {lowering}\n{ir_form}", tm, options)


def compile_kernels(kernels: Sequence[Kernel], *, check_races: bool | None = None,
                    options: PassOptions = DEFAULT_OPTIONS, count_accesses: bool = False) -> CpuModule:
    """Lower each kernel into its own LLVM module, optimise it at O3 and load the machine code.

    Objects come from the on-disk cache, keyed by the kernel IR, or are generated and compiled
    on all cores (``codegen.objects``). ``check_races`` (default: the ``SEXTANT_CHECK_RACES``
    environment variable) compiles the checked variant: launches raise
    ``race_check.KernelCheckError`` on a shared-memory race, an out-of-bounds access or a
    divergent warp reduction. ``count_accesses`` compiles the counting variant instead
    (``counters.CountingCpuModule``: bank conflicts, coalescing, MMA instructions)."""
    if count_accesses:
        return _compile_counting(kernels)
    if checks_enabled(check_races):
        return _compile_checked(kernels)
    tm = host_target_machine()
    kernels = list(kernels)
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        raise CodegenError(f"two kernels are named {next(n for n in names if names.count(n) > 1)!r}")
    vector_bytes = host_vector_bytes()
    texts: dict[int, str] = {}

    def text(i: int) -> str:
        if i not in texts:
            with gc_paused():
                texts[i] = str(emit_module([kernels[i]], tm, vector_bytes=vector_bytes))
        return texts[i]

    with gc_paused():
        keys = [kernel_key(k, tm, options, vector_bytes) for k in kernels]
    with _compile_lock:  # llvmlite parses into LLVM's global context, which is not thread-safe
        objects, cached = build_objects(keys, text, tm, options, size_hint=lambda i: estimate_work(kernels[i]))
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
        for obj in objects:
            engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        engine.finalize_object()
        addresses = {k.name: engine.get_function_address(k.name) for k in kernels}

    def generated() -> str:  # for dumps, reports and tests: generated again when not at hand
        return "\n".join(text(i) for i in range(len(kernels)))

    def optimized() -> str:  # ... and optimised again, in this process
        with _compile_lock:
            return "\n".join(str(optimize(text(i), tm, options)) for i in range(len(kernels)))

    module = CpuModule(kernels, addresses, keepalive=(engine, objects), llvm_ir=generated, optimized_ir=optimized)
    module.cached_objects = cached
    return module


def _compile_counting(kernels: Sequence[Kernel]) -> CountingCpuModule:
    """The counting build (``codegen.counters``): one module, lightly optimised, run inline."""
    tm = host_target_machine()
    lowerings: list[_KernelLowering] = []
    with gc_paused():
        text = str(emit_module(kernels, tm, count_accesses=True, lowerings=lowerings))
    with _compile_lock:
        llmod = optimize(text, tm, PassOptions(speed_level=1))
        engine = llvm.create_mcjit_compiler(llmod, tm)
        engine.finalize_object()
        addresses = {k.name: engine.get_function_address(k.name) for k in kernels}
        infos = {}
        for low in lowerings:
            assert low.counter is not None
            k = low.kernel
            shapes = [s.shape for s in iter_stmts(k.body) if isinstance(s, Mma)]
            info = CountInfo(k, low.counter.sites, 2 * shapes[0][0] * shapes[0][1] * shapes[0][2] if shapes else 0)
            symbols = [low.counter.mma_symbol, f"sextant.count.{k.name}.steps", f"sextant.count.{k.name}.ustep"]
            symbols += [f"sextant.count.{k.name}.{i}.{part}" for i in range(len(info.sites))
                        for part in ("rec", "stamp", "n")]
            info.addresses = {s: engine.get_global_value_address(s) for s in symbols}
            infos[k.name] = info
    return CountingCpuModule(list(kernels), addresses, infos, keepalive=(engine, llmod), llvm_ir=text)


def _compile_checked(kernels: Sequence[Kernel]) -> CheckedCpuModule:
    """The checked build: one module, optimised lightly (a test mode), JIT-compiled in process."""
    tm = host_target_machine()
    lowerings: list[_KernelLowering] = []
    with gc_paused():
        module = emit_module(kernels, tm, check_races=True, lowerings=lowerings)
        text = str(module)
    with _compile_lock:
        llmod = optimize(text, tm, PassOptions(speed_level=1))
        optimized = str(llmod)
        engine = llvm.create_mcjit_compiler(llmod, tm)
        engine.finalize_object()
        addresses = {k.name: engine.get_function_address(k.name) for k in kernels}
        reports = {k.name: engine.get_global_value_address(report_symbol(k.name)) for k in kernels}
    infos = {low.kernel.name: low.checker.info for low in lowerings if low.checker is not None}
    return CheckedCpuModule(list(kernels), addresses, reports, infos, keepalive=(engine, llmod), llvm_ir=text,
                            optimized_ir=optimized)


# -- lowering of one kernel ----------------------------------------------------------------------
class _KernelLowering(LoweringBase):
    def __init__(self, module: ir.Module, kernel: Kernel, check: bool = False, vector_bytes: int = 32,
                 count: bool = False, amx: bool | None = None):
        if check or count or not (cpu_amx.native_amx() if amx is None else amx):  # as pair dots (kernel/tiles.py)
            kernel = expand_tiles(kernel)
        self.kernel = kernel
        self.plan: SimtPlan = plan_kernel(kernel, mark_barriers=check)
        fnty = ir.FunctionType(ir.VoidType(), [PTR, I32, I32])
        self.fn = ir.Function(module, fnty, kernel.name)
        self.fn.attributes.add("nounwind")
        self.b: LaneBuilder = LaneBuilder(self.fn.append_basic_block("entry"))
        self.math = ScalarMath(module, self.b)
        self.module = module
        self.buffers: dict[str, tuple[Buffer, ir.Value]] = {}
        self.per_thread_buffers: set[str] = set()
        self.slots: dict[str, ir.Value] = {}
        self.heap: list[ir.Value] = []
        self.stack_bytes = 0
        self.memo: dict[int, tuple[Expr, ir.Value]] = {}
        self.tid: tuple[ir.Value, ir.Value, ir.Value] = (self._i32(0),) * 3
        self.ltid: ir.Value = self._i32(0)
        self.bid: tuple[ir.Value, ir.Value, ir.Value] = (self._i32(0),) * 3
        self.block_linear: ir.Value = self._i32(0)
        self.checker = KernelChecker(self) if check else None
        self.counter = AccessCounter(self) if count else None
        # lanes of an unrolled loop emitted as vectors (0: every loop unrolled one iteration at a
        # time); the checked build stays scalar, its checks look at one index at a time
        self.vector_lanes = 0 if check or count else vector_bytes // 4
        self.lanes: LanePlan | None = None
        self.lane_vals: dict[str, ir.Value] = {}
        self.lane_memo: dict[int, tuple[Expr, ir.Value]] = {}

    def _op(self, e: Expr, operand: Callable[[Expr], ir.Value]) -> ir.Value | None:
        """As the base class; but in a kernel with several threads a bit mask of an index is applied
        through an *opaque* copy of the mask. LLVM 22's loop vectoriser miscompiles the thread loop
        when an index is ``(tid & 7) + (row << 3)`` with ``row`` of a known range (a table row picked
        by a position, broadcast over the threads): it loads lanes 8.. of the vector from the next
        row, as if the mask were not there. Opaque, the mask makes such a load a gather (correct);
        the copy is a loop invariant, hoisted out of the thread loop."""
        if (isinstance(e, Binary) and e.op == "bitwise_and" and e.dtype == INDEX and self.kernel.threads_per_block > 1
                and isinstance(e.b, Const)):
            x, mask = operand(e.a), operand(e.b)
            if isinstance(x.type, ir.IntType) and isinstance(mask, ir.Constant):
                opaque = self.b.call(ir.InlineAsm(ir.FunctionType(x.type, [x.type]), "", "=r,0"), [mask])
                return self.b.and_(x, opaque)
        return super()._op(e, operand)

    # -- storage -----------------------------------------------------------------------------
    def _array(self, ty: ir.Type, count: int, name: str) -> ir.Value:
        """``count`` elements of ``ty``: an entry-block alloca, or malloc'd when large."""
        nbytes = count * _BYTES[str(ty)]
        if nbytes > HEAP_BYTES or self.stack_bytes + nbytes > STACK_BYTES:
            malloc = self.math.declare("malloc", PTR, [I64])
            p = self.b.call(malloc, [ir.Constant(I64, nbytes)], name=name)
            self.heap.append(p)
            return p
        self.stack_bytes += nbytes
        a = self.b.alloca(ir.ArrayType(ty, count) if count != 1 else ty, name=name)
        a.align = 64 if count > 1 else None
        a.type = PTR  # llvmlite types allocas as typed pointers; everything here is opaque
        return a

    def _preamble(self, args: ir.Value) -> None:
        k, plan, T = self.kernel, self.plan, self.kernel.threads_per_block
        for i, p in enumerate(k.params):
            if p.space != "global":
                raise self._fail(f"parameter {p.name} is in {p.space!r} memory, expected 'global'")
            slot = self.b.gep(args, [self._i32(i)], inbounds=True, source_etype=PTR)
            self.buffers[p.name] = (p, self.b.load(slot, name=f"arg.{p.name}", typ=PTR))
        self._alias_scopes([p.name for p in k.params])
        for s in k.shared:
            self.buffers[s.name] = (s, self._array(mem_type(s.dtype), s.size, f"shared.{s.name}"))
        for loc in k.local:
            per_thread = loc.name in plan.per_thread_locals
            if per_thread:
                self.per_thread_buffers.add(loc.name)
            self.buffers[loc.name] = (loc, self._array(mem_type(loc.dtype), loc.size * (T if per_thread else 1),
                                                       f"local.{loc.name}"))
        for slot_name, dt in plan.exchanges.items():
            n = plan.exchange_sizes.get(slot_name, T)
            self.buffers[slot_name] = (Buffer(slot_name, dt, n, "local"), self._array(mem_type(dt), n, slot_name))
        for name, dt in plan.var_types.items():
            n = T if name in plan.per_thread_vars else 1
            self.slots[name] = self._array(reg_type(dt), n, f"r.{name}")
        for j, size in enumerate(k.sizes):  # after the buffers, each size as a pointer-sized integer
            slot = self.b.gep(args, [self._i32(len(k.params) + j)], inbounds=True, source_etype=PTR)
            raw = self.b.ptrtoint(self.b.load(slot, typ=PTR), I64)
            name = size.var.name
            if name not in self.slots:  # a size only the grid reads
                self.slots[name] = self._array(I32, 1, f"r.{name}")
            if name in plan.per_thread_vars:
                raise self._fail(f"size argument {name} is per-thread")
            self.b.store(self.b.trunc(raw, I32, name=name), self.slots[name])
        if self.checker is not None:
            self.checker.preamble()

    def _alias_scopes(self, names: list[str]) -> None:
        """One alias scope per global buffer: every access says which buffer it touches and that
        it touches none of the others. A kernel's buffers never overlap (the memory plan gives
        each live value its own bytes, outputs are fresh), but LLVM cannot know that of pointers
        it loads from the argument array: without this, a loop whose loads are gathers (a pad's
        clamped index) could not get the runtime overlap checks vectorising needs, and stayed
        scalar — UNet's pad+SiLU kernels ran at 55 ns an element."""
        self.scopes: dict[str, tuple[ir.MDValue, ir.MDValue]] = {}
        if len(names) < 2:
            return
        m = self.module
        domain = m.add_metadata([ir.MetaDataString(m, f"sextant.{self.kernel.name}")])
        scope = {n: m.add_metadata([ir.MetaDataString(m, f"sextant.{self.kernel.name}.{n}"), domain])
                 for n in names}
        for n in names:
            self.scopes[n] = (m.add_metadata([scope[n]]), m.add_metadata([scope[o] for o in names if o != n]))

    def _access(self, inst: ir.Instruction, buffer: str) -> ir.Instruction:
        tags = self.scopes.get(buffer)
        if tags is not None:
            inst.set_metadata("alias.scope", tags[0])
            inst.set_metadata("noalias", tags[1])
        return inst

    def _var_ptr(self, name: str) -> ir.Value:
        slot = self.slots[name]
        if name in self.plan.per_thread_vars:
            return self.b.gep(slot, [self.ltid], inbounds=True, source_etype=reg_type(self.plan.var_types[name]))
        return slot

    def read_var(self, v: Var) -> ir.Value:
        if v.name not in self.slots:
            raise self._fail(f"register {v.name!r} is not defined")
        return self.b.load(self._var_ptr(v.name), typ=reg_type(v.dtype))

    def write_var(self, v: Var, value: ir.Value) -> None:
        self.b.store(value, self._var_ptr(v.name))

    def _elem_ptr(self, name: str, index: ir.Value) -> tuple[Buffer, ir.Value]:
        if not isinstance(index.type, ir.IntType) or index.type.width < 32:
            raise self._fail(f"the index into {name} is not an i32/i64 value")
        if name not in self.buffers:
            raise self._fail(f"no buffer named {name!r}")
        buf, base = self.buffers[name]
        if name in self.per_thread_buffers:
            index = self.b.add(self.b.mul(self.ltid, self._i32(buf.size), flags=["nsw"]), self._index(index),
                               flags=["nsw"])
        return buf, self.b.gep(base, [index], inbounds=True, source_etype=mem_type(buf.dtype))

    def _index(self, v: ir.Value) -> ir.Value:
        return self.b.trunc(v, I32) if v.type == I64 else v

    # -- structure ---------------------------------------------------------------------------
    def emit(self) -> None:
        args, begin, end = self.fn.args
        args.name, begin.name, end.name = "args", "block_begin", "block_end"
        self._preamble(args)
        gx, gy, _ = self.kernel.grid
        symbolic = self.kernel.meta.get("grid")  # extents over size arguments, per launch
        one_d = self.kernel.num_blocks == gx and (symbolic is None or (symbolic[1], symbolic[2]) == (1, 1))
        if symbolic is not None:
            self.grid_values = tuple(self._value(dim_expr(d)) for d in symbolic)
            gxv, gyv = self.grid_values[:2]
        else:
            gxv, gyv = self._i32(gx), self._i32(gy)

        def block(bl: ir.Value) -> None:
            b = self.b
            self.block_linear = bl
            if self.checker is not None:
                self.checker.block_start()
            if one_d:  # 1-D grid: the linear id is bid.x
                self.bid = (bl, self._i32(0), self._i32(0))
                self._items(self.plan.items)
                return
            bx = b.urem(bl, gxv) if gx > 1 else self._i32(0)
            rest = b.udiv(bl, gxv) if gx > 1 else bl
            by = b.urem(rest, gyv) if gy > 1 else self._i32(0)
            bz = b.udiv(rest, gyv) if gy > 1 else rest
            self.bid = (bx, by, bz)
            self._items(self.plan.items)

        self._loop(begin, end, 1, block, "block")
        if self.heap:
            free = self.math.declare("free", ir.VoidType(), [PTR])
            for p in self.heap:
                self.b.call(free, [p])
        self.b.ret_void()

    def _items(self, items: Sequence[Item]) -> None:
        for it in items:
            self._uniform_context()
            if isinstance(it, Sync):
                if self.checker is not None:
                    self.checker.sync()
            elif isinstance(it, Phase):
                if self.checker is not None:
                    self.checker.phase_start()
                self._threads(lambda it=it: self._stmts(it.stmts))
            elif isinstance(it, UniformFor):
                loop = it.loop
                start, stop = self._bounds(loop)

                def body(iv: ir.Value, it: UniformFor = it) -> None:
                    self._uniform_context()
                    if self.counter is not None:
                        self.counter.iteration(uniform=True)
                    self.write_var(it.loop.var, iv)
                    self._items(it.body)

                self._loop(start, stop, loop.step, body, f"u.{loop.var.name}")
            else:
                self.memo = {}
                cond = self._cond(it.cond)
                with self.b.if_else(cond) as (then, orelse):
                    with then:
                        self._items(it.then)
                    with orelse:
                        self._items(it.orelse)

    def _uniform_context(self) -> None:
        """Code outside the thread loops reads per-thread registers of thread 0."""
        self.tid = (self._i32(0),) * 3
        self.ltid = self._i32(0)

    def _threads(self, body: Callable[[], None]) -> None:
        """Run ``body`` for every thread of the block: nested z/y/x loops (x innermost, so
        consecutive threads are consecutive iterations the vectoriser can pack)."""
        bx, by, bz = self.kernel.block
        zero = self._i32(0)
        tids = [zero, zero, zero]

        def level(axis: int) -> None:
            if axis < 0:
                self.tid = (tids[0], tids[1], tids[2])
                lin = tids[0]
                if by * bz > 1:
                    b, nsw = self.b, ["nsw", "nuw"]  # thread ids are small and non-negative
                    lin = b.add(b.mul(b.add(b.mul(tids[2], self._i32(by), flags=nsw), tids[1], flags=nsw),
                                      self._i32(bx), flags=nsw), tids[0], flags=nsw)
                self.ltid = lin
                body()
                return
            extent = self.kernel.block[axis]
            if extent == 1:
                tids[axis] = zero
                level(axis - 1)
                return

            def inner(iv: ir.Value) -> None:
                tids[axis] = iv
                level(axis - 1)

            self._loop(zero, self._i32(extent), 1, inner, f"t{'xyz'[axis]}")

        if bx * by * bz < 1:
            raise self._fail(f"block {self.kernel.block} has no threads")
        level(2)

    # -- statements --------------------------------------------------------------------------
    def _stmts(self, stmts: Sequence[PhaseStmt]) -> None:
        if self.counter is not None:  # accesses of one statement list are grouped by the counters
            self.counter.lists.append(id(stmts))
            if self.counter.loop_body:
                self.counter.loop_body = False
                self.counter.iteration(uniform=False)
        for s in stmts:
            self._stmt(s)
        if self.counter is not None:
            self.counter.lists.pop()

    def _stmt(self, s: PhaseStmt) -> None:
        self.memo = {}
        b = self.b
        if self._structured_stmt(s):
            pass
        elif isinstance(s, XchgStore):
            val = self._value(s.value)
            buf, ptr = self._elem_ptr(s.slot, self.ltid)
            b.store(self.math.to_mem(val, buf.dtype), ptr)
            if self.checker is not None:
                self.checker.xchg_store(s.slot)
        elif isinstance(s, XchgReduce):
            self._warp_reduce(s)
        elif isinstance(s, MmaStage):
            tc.mma_stage(self, s)
        elif isinstance(s, MmaCompute):
            tc.mma_compute(self, s)
        elif isinstance(s, LdmStage):
            tc.ldm_stage(self, s)
        elif isinstance(s, LdmRead):
            tc.ldm_read(self, s)
        elif isinstance(s, CpAsync):
            tc.cp_async(self, s)
        elif isinstance(s, CpAsyncCommit | CpAsyncWait):
            if self.checker is not None:
                self.checker.async_group(s)
        elif isinstance(s, PairDot):
            pair_dot(self, s)
        elif isinstance(s, TileMatmul):
            cpu_amx.tile_matmul(self, s)
        elif isinstance(s, Wgmma):
            hopper.wgmma(self, s)
        elif isinstance(s, WgmmaStage):
            hopper.wgmma_stage(self, s)
        elif isinstance(s, WgmmaCompute):
            hopper.wgmma(self, s.wgmma, s.slot)
        elif isinstance(s, TmaLoad):
            hopper.tma_load(self, s)
        elif isinstance(s, MbarrierInit | MbarrierArrive | MbarrierWait):
            hopper.mbarrier(self, s)
        elif isinstance(s, WgmmaFence | WgmmaCommit | WgmmaWait | SetMaxNReg):
            pass  # the wgmma completed when it was issued; registers are not a CPU resource
        else:
            raise self._fail(f"unexpected statement {type(s).__name__} inside a phase")

    def _bounds(self, s: For) -> tuple[ir.Value, ir.Value]:
        self.memo = {}  # loop bounds are evaluated afresh in each phase's thread context
        return super()._bounds(s)

    def _warp_reduce(self, s: XchgReduce) -> None:
        """``var = op(lanes of this thread's group)`` in lane order; lanes past the block's last
        thread (a partial warp) are skipped."""
        b, T, w = self.b, self.kernel.threads_per_block, s.width
        dt = s.var.dtype
        if s.op in ("sum", "prod") and dt == DType.bool:
            raise self._fail(f"WarpReduce {s.op} of bool")
        if self.checker is not None:
            self.checker.warp_converged(s.slot, s.var.name)
        base = b.and_(self.ltid, self._i32(~(w - 1)))

        def lane(i: int) -> tuple[ir.Value, ir.Value | None]:
            idx = b.add(base, self._i32(i)) if i else base
            ok = None if T % w == 0 else b.icmp_signed("<", idx, self._i32(T))
            if ok is not None:
                idx = b.select(ok, idx, base)
            _, ptr = self._elem_ptr(s.slot, idx)
            return self.math.from_mem(b.load(ptr, typ=mem_type(dt)), dt), ok

        acc, _ = lane(0)
        for i in range(1, min(w, T)):
            v, ok = lane(i)
            r = self.math.binary(_WARP_OP[s.op], acc, v, dt)
            acc = r if ok is None else b.select(ok, r, acc)
        self.write_var(s.var, acc)

    # -- unrolled loops as vector code (sextant.codegen.lanes) -------------------------------
    def _for(self, s: For) -> None:
        plan = plan_lanes(s, self.vector_lanes) if s.unroll and self.vector_lanes >= 4 else None
        if plan is None:
            if self.counter is not None:
                self.counter.loop_body = True
            super()._for(s)
            if self.counter is not None:
                self.counter.loop_body = False  # (a loop unrolled to no iterations lowers no body)
            return
        outer = (self.lanes, self.lane_vals)
        self.lanes, self.lane_vals = plan, {}
        w, var_of = plan.width, {st.var.name: st.var for st in s.body if isinstance(st, Assign)}
        ity = reg_type(s.var.dtype)
        for first in range(plan.start, plan.start + plan.trips, w):
            self.lane_vals[s.var.name] = ir.Constant(ir.VectorType(ity, w), list(range(first, first + w)))
            for st in s.body:
                self.memo, self.lane_memo = {}, {}
                if isinstance(st, Assign):
                    if st.value.dtype != st.var.dtype:
                        raise self._fail(f"assigning a {st.value.dtype.value} value to register {st.var.name} "
                                         f"({st.var.dtype.value})")
                    value = self._lane(st.value)
                    if st.var.name in plan.varying:
                        self.lane_vals[st.var.name] = self.b.splat(value, w)
                    else:
                        self.write_var(st.var, value)
                else:
                    self._lane_store(st.buffer, st.index, st.value)
        last = ir.Constant(I32, w - 1)
        finals = {name: self.b.extract_element(v, last) for name, v in self.lane_vals.items()}
        self.lanes, self.lane_vals = outer
        self.memo, self.lane_memo = {}, {}
        for name, v in finals.items():  # what code after the loop sees: the last iteration's values
            if name in self.slots:
                self.write_var(var_of.get(name, s.var), v)

    def _lane_ptr(self, buffer: str, index: Expr, dtype: DType) -> tuple[ir.Value, Buffer]:
        """The address of lane 0's element of a contiguous access."""
        idx = self._lane(index)
        if isinstance(idx.type, ir.VectorType):
            idx = self.b.extract_element(idx, ir.Constant(I32, 0))
        buf, ptr = self._elem_ptr(buffer, idx)
        if buf.dtype != dtype:
            raise self._fail(f"access of {dtype.value} to {buf.name} ({buf.dtype.value})")
        return ptr, buf

    def _lane_store(self, buffer: str, index: Expr, value: Expr) -> None:
        assert self.lanes is not None and self.lanes.coefficient(index) == CONTIGUOUS
        val = self.b.splat(self._lane(value), self.lanes.width)
        ptr, buf = self._lane_ptr(buffer, index, value.dtype)
        self._access(self.b.store(self.math.to_mem(val, buf.dtype), ptr, align=_BYTES[str(mem_type(buf.dtype))]),
                     buffer)

    def _lane(self, e: Expr) -> ir.Value:
        """``e`` for the current lanes: a scalar when it is the same in all of them, else a vector."""
        plan = self.lanes
        assert plan is not None
        if not plan.varies(e):
            return self._value(e)
        hit = self.lane_memo.get(id(e))
        if hit is not None:
            return hit[1]
        v = self._lane_expr(e, plan)
        self.lane_memo[id(e)] = (e, v)
        return v

    def _lane_expr(self, e: Expr, plan: LanePlan) -> ir.Value:
        m, w = self.math, plan.width
        if isinstance(e, Var):
            return self.lane_vals[e.name]
        if isinstance(e, Load):
            mty = mem_type(e.dtype)
            if plan.coefficient(e.index) == CONTIGUOUS:
                ptr, _ = self._lane_ptr(e.buffer, e.index, e.dtype)
                raw = self._access(self.b.load(ptr, typ=ir.VectorType(mty, w), align=_BYTES[str(mty)]), e.buffer)
            else:  # a gather, lane by lane
                idx = self.b.splat(self._lane(e.index), w)
                raw = ir.Constant(ir.VectorType(mty, w), ir.Undefined)
                for lane in range(w):
                    at = ir.Constant(I32, lane)
                    buf, ptr = self._elem_ptr(e.buffer, self.b.extract_element(idx, at))
                    if buf.dtype != e.dtype:
                        raise self._fail(f"load of {e.dtype.value} from {buf.name} ({buf.dtype.value})")
                    raw = self.b.insert_element(raw, self._access(self.b.load(ptr, typ=mty), e.buffer), at)
            return m.from_mem(raw, e.dtype)
        op = self._op(e, self._lane)
        if op is not None:
            return op
        if isinstance(e, Select):
            self._check_type("where", [e.cond.dtype, e.a.dtype, e.b.dtype], e.dtype)
            return self._lane_select(e, w)
        if isinstance(e, Const):
            return m.const(e.value, e.dtype)
        raise self._fail(f"unknown expression {e!r} in vectorised lanes")

    def _lane_select(self, e: Select, w: int) -> ir.Value:
        """A vector select; when the condition is the same in every lane and an arm loads memory,
        only the chosen arm runs (plan_lanes refuses loops where the condition varies)."""
        cond = self._lane(e.cond)
        if isinstance(cond.type, ir.VectorType) or not (expr_loads(e.a) or expr_loads(e.b)):
            return self.math.select(cond, self._lane(e.a), self._lane(e.b))
        return self._branch(cond, lambda: self.b.splat(self._lane(e.a), w), lambda: self.b.splat(self._lane(e.b), w))

    def _memos(self) -> tuple[dict, ...]:
        return (self.memo, self.lane_memo)

    def _set_memos(self, memos: tuple[dict, ...]) -> None:
        self.memo, self.lane_memo = memos

    # -- expressions (the rest is LoweringBase's) ---------------------------------------------
    def _load_index(self, buffer: str, index: ir.Value) -> ir.Value:
        if self.counter is not None:
            self.counter.record(buffer, index, store=False)
        return index if self.checker is None else self.checker.access(buffer, index, store=False)

    def _store_index(self, buffer: str, index: ir.Value) -> ir.Value:
        if self.counter is not None:
            self.counter.record(buffer, index, store=True)
        return index if self.checker is None else self.checker.access(buffer, index, store=True)

    def _special(self, e: Special) -> ir.Value:
        axis = _AXES[e.axis]
        if e.kind == "tid":
            return self.tid[axis]
        if e.kind == "bid":
            return self.bid[axis]
        if e.kind == "bdim":
            return self._i32(self.kernel.block[axis])
        if e.kind == "gdim":
            if "grid" in self.kernel.meta:  # per launch
                return self.grid_values[axis]
            return self._i32(self.kernel.grid[axis])
        raise self._fail(f"unknown special register {e.kind}.{e.axis}")

