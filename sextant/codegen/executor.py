"""A native launch-plan interpreter: one ctypes call runs a whole forward pass on the CPU.

Calling each kernel from Python costs tens of microseconds (argument checks, a ctypes call, a
thread-pool hand-off) — more than many kernels of a small model take. ``sextant_run`` walks a
*launch plan* instead, a table of ``(kernel, arguments, blocks, flags)`` rows, and calls every
kernel through a function pointer. The plan is data, so this module is compiled once per
process, not once per model.

Several threads run the same plan, each with its own ``worker`` index: a launch flagged
parallel gives each worker an equal share of its blocks, any other launch runs on worker 0
alone. A launch flagged with a barrier is followed by a spin barrier (sense by generation
count, ``pause`` while spinning, ``sched_yield`` after a while so an oversubscribed machine
still progresses), which makes its writes visible to every worker before the next launch.

Plan layout (``i32``): ``[n, (fn, nargs, arg_offset, blocks, flags) * n]``; ``argidx[arg_offset
+ i]`` is the slot holding the launch's ``i``-th buffer pointer. ``sync`` is two ``i32``: the
arrival count and the generation.

``sextant_call(call)`` is the same walk with its seven arguments packed in one ``i64`` array
(``CALL_FIELDS``: plan, argidx, slots, fns, worker, nworkers, sync): a runner builds that array once
per thread and calls with one pointer — ctypes converts each argument of a call in Python, and
seven of them cost about twice what one does (measured: ~0.9 µs against ~0.4 µs per call).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import llvmlite.binding as llvm
from llvmlite import ir

PARALLEL = 1  # flags: the launch's blocks are split over the workers
BARRIER = 2  # ... all workers synchronise after it
FIELDS = 5  # i32 per launch row
MAX_ARGS = 512  # buffers of one launch (kernels read far fewer)
SPINS_BEFORE_YIELD = 4096

I32, I64, PTR = ir.IntType(32), ir.IntType(64), ir.PointerType()
CALL_FIELDS = 7  # i64 per packed call: plan, argidx, slots, fns, worker, nworkers, sync
RunFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p)
CallFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_lock = threading.Lock()
_compiled: tuple[RunFn, CallFn, object] | None = None


def _alloca(b: ir.IRBuilder, ty: ir.Type, name: str = "") -> ir.Value:
    a = b.alloca(ty, name=name)
    a.type = PTR  # llvmlite types allocas as typed pointers; the module uses opaque ones
    return a


def _counted_loop(b: ir.IRBuilder, fn: ir.Function, slot: ir.Value, n: ir.Value, name: str,
                  body: Callable[[ir.Value], None]) -> None:
    """``for i in [0, n): body(i)``, the counter in ``slot`` (an entry-block alloca; mem2reg makes it a phi)."""
    b.store(ir.Constant(I32, 0), slot)
    head, loop, done = (fn.append_basic_block(f"{name}.{s}") for s in ("head", "body", "done"))
    b.branch(head)
    b.position_at_end(head)
    i = b.load(slot, name=name, typ=I32)
    b.cbranch(b.icmp_signed("<", i, n), loop, done)
    b.position_at_end(loop)
    body(i)
    b.store(b.add(i, ir.Constant(I32, 1)), slot)
    b.branch(head)
    b.position_at_end(done)


def _barrier(module: ir.Module, x86: bool) -> ir.Function:
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR, I32]), "sextant_barrier")
    sync, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    count = sync
    gen_ptr = b.gep(sync, [ir.Constant(I32, 1)], source_etype=I32)
    gen = b.load_atomic(gen_ptr, "acquire", 4, typ=I32)
    old = b.atomic_rmw("add", count, ir.Constant(I32, 1), "acq_rel")
    last, wait = fn.append_basic_block("last"), fn.append_basic_block("wait")
    b.cbranch(b.icmp_signed("==", old, b.sub(n, ir.Constant(I32, 1))), last, wait)
    b.position_at_end(last)
    b.atomic_rmw("xchg", count, ir.Constant(I32, 0), "monotonic")  # (llvmlite: store_atomic needs typed pointers)
    b.atomic_rmw("add", gen_ptr, ir.Constant(I32, 1), "release")
    b.ret_void()

    b.position_at_end(wait)
    spins = _alloca(b, I32, "spins")
    b.store(ir.Constant(I32, 0), spins)
    head, spin, out = (fn.append_basic_block(s) for s in ("head", "spin", "out"))
    b.branch(head)
    b.position_at_end(head)
    now = b.load_atomic(gen_ptr, "acquire", 4, typ=I32)
    b.cbranch(b.icmp_signed("!=", now, gen), out, spin)
    b.position_at_end(spin)
    k = b.load(spins, typ=I32)
    b.store(b.add(k, ir.Constant(I32, 1)), spins)
    yield_ = ir.Function(module, ir.FunctionType(I32, []), "sched_yield")
    busy, idle = fn.append_basic_block("busy"), fn.append_basic_block("idle")
    b.cbranch(b.icmp_signed("<", k, ir.Constant(I32, SPINS_BEFORE_YIELD)), busy, idle)
    b.position_at_end(busy)
    if x86:  # tell the core it is a spin loop (saves power, yields to a hyperthread sibling)
        b.call(ir.Function(module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"), [])
    b.branch(head)
    b.position_at_end(idle)
    b.call(yield_, [])
    b.branch(head)
    b.position_at_end(out)
    b.ret_void()
    return fn


def emit_executor(triple: str, data_layout: str) -> ir.Module:
    """The LLVM module of ``sextant_run(plan, argidx, slots, fns, worker, nworkers, sync)``."""
    module = ir.Module("sextant_executor")
    module.triple, module.data_layout = triple, data_layout
    barrier = _barrier(module, triple.startswith(("x86_64", "i686")))
    kernel_ty = ir.FunctionType(ir.VoidType(), [PTR, I32, I32])
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR, PTR, PTR, PTR, I32, I32, PTR]), "sextant_run")
    plan, argidx, slots, fns, worker, nworkers, sync = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    args = _alloca(b, ir.ArrayType(PTR, MAX_ARGS), "args")
    launch_i, arg_i = _alloca(b, I32, "launch.i"), _alloca(b, I32, "arg.i")

    def at(base: ir.Value, i: ir.Value) -> ir.Value:
        return b.load(b.gep(base, [i], source_etype=I32), typ=I32)

    def launch(li: ir.Value) -> None:
        row = b.add(b.mul(li, ir.Constant(I32, FIELDS)), ir.Constant(I32, 1))
        field = [at(plan, b.add(row, ir.Constant(I32, f))) for f in range(FIELDS)]
        kfn, nargs, off, blocks, flags = field

        def arg(i: ir.Value) -> None:
            slot = at(argidx, b.add(off, i))
            ptr = b.load(b.gep(slots, [slot], source_etype=PTR), typ=PTR)
            b.store(ptr, b.gep(args, [ir.Constant(I32, 0), i], source_etype=ir.ArrayType(PTR, MAX_ARGS)))

        _counted_loop(b, fn, arg_i, nargs, "arg", arg)
        par = b.icmp_signed("!=", b.and_(flags, ir.Constant(I32, PARALLEL)), ir.Constant(I32, 0))
        wide = b.sext(blocks, I64)
        share_lo = b.trunc(b.sdiv(b.mul(wide, b.sext(worker, I64)), b.sext(nworkers, I64)), I32)
        share_hi = b.trunc(b.sdiv(b.mul(wide, b.sext(b.add(worker, ir.Constant(I32, 1)), I64)),
                                  b.sext(nworkers, I64)), I32)
        first = b.icmp_signed("==", worker, ir.Constant(I32, 0))
        lo = b.select(par, share_lo, ir.Constant(I32, 0))
        hi = b.select(par, share_hi, b.select(first, blocks, ir.Constant(I32, 0)))
        with b.if_then(b.icmp_signed("<", lo, hi)):
            target = b.load(b.gep(fns, [kfn], source_etype=PTR), typ=kernel_ty.as_pointer())
            b.call(target, [args, lo, hi])
        sync_after = b.and_(b.icmp_signed("!=", b.and_(flags, ir.Constant(I32, BARRIER)), ir.Constant(I32, 0)),
                            b.icmp_signed(">", nworkers, ir.Constant(I32, 1)))
        with b.if_then(sync_after):
            b.call(barrier, [sync, nworkers])

    _counted_loop(b, fn, launch_i, at(plan, ir.Constant(I32, 0)), "launch", launch)
    b.ret_void()

    packed = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR]), "sextant_call")
    b = ir.IRBuilder(packed.append_basic_block("entry"))
    field = [b.load(b.gep(packed.args[0], [ir.Constant(I32, f)], source_etype=I64), typ=I64)
             for f in range(CALL_FIELDS)]
    b.call(fn, [*(b.inttoptr(v, PTR) for v in field[:4]), b.trunc(field[4], I32), b.trunc(field[5], I32),
                b.inttoptr(field[6], PTR)])
    b.ret_void()
    return module


def executor() -> RunFn:
    """``sextant_run``, compiled on first use (once per process)."""
    return _compile()[0]


def packed_executor() -> CallFn:
    """``sextant_call``: ``sextant_run`` with its arguments packed in one array (``CALL_FIELDS``)."""
    return _compile()[1]


def _compile() -> tuple[RunFn, CallFn, object]:
    global _compiled
    with _lock:
        if _compiled is None:
            from sextant.codegen.llvm_cpu import _compile_lock, host_target_machine

            tm = host_target_machine()
            module = emit_executor(tm.triple, str(tm.target_data))
            with _compile_lock:
                llmod = llvm.parse_assembly(str(module))
                llmod.verify()
                pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=2))
                pb.getModulePassManager().run(llmod, pb)
                engine = llvm.create_mcjit_compiler(llmod, tm)
                engine.finalize_object()
                _compiled = (RunFn(engine.get_function_address("sextant_run")),
                             CallFn(engine.get_function_address("sextant_call")), (engine, llmod))
        return _compiled
