"""Memory-access and tensor-core counters from cuda-sim: what a kernel's warps would ask of the
GPU's memory system, measured by running the kernel on the CPU.

A counting build of the SIMT CPU lowering (``compile_kernels(kernels, count_accesses=True)``)
records, for **block 0** of every launch, the element index of the first :data:`SAMPLES`
executions of every access site (a load or store of a global or shared buffer, an ``ldmatrix``
row, a ``cp.async`` chunk) by every thread, and counts the ``Mma`` instructions of all blocks.
Each record carries a *stamp*: how many loop iterations the thread had begun (uniform loops and
its own), so lanes that skip an access in some iterations (a guard) still line up by iteration.
After the launch the records are regrouped per warp — lanes ``32w … 32w+31`` at the same site
and stamp — which is what one warp-wide instruction sends to memory:

* **shared memory**: 32 banks of 4 bytes. A request costs one *wavefront* per distinct 4-byte word
  in its busiest bank (lanes reading the same word are a broadcast); every wavefront past the
  first is a **bank conflict**. 16-byte accesses (``ldmatrix`` rows, ``cp.async`` chunks) are
  served 8 lanes (128 bytes) at a time, each such phase counted alike.
* **global memory**: 32-byte sectors. A request touches the distinct sectors its lanes' bytes
  fall in; the *ideal* is its distinct bytes / 32, rounded up. Consecutive accesses of one
  statement list to one buffer in which every lane stays within one aligned 16-byte block (the
  lanes of an unrolled, vectorised loop) count as one wide request, as LLVM's load/store
  vectoriser emits them.
* **tensor cores**: ``Mma`` instructions (each ``2·M·N·K`` FLOPs), over all blocks.

The sampling keeps the cost bounded and is exact for what it sees; block 0 and the first
iterations are representative of the steady state of the mappings here (edge blocks differ only
in their guards). The counters need no GPU and are deterministic, so tests pin them.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from llvmlite import ir

from sextant.codegen.cpu_module import CpuModule
from sextant.codegen.scalar_math import I32, I64
from sextant.kernel.ir import Kernel

if TYPE_CHECKING:
    from sextant.codegen.llvm_cpu import _KernelLowering

SAMPLES = 16  # executions of each access site recorded per thread
WARP, BANKS, SECTOR = 32, 32, 32


@dataclass(frozen=True)
class Site:
    """One access site of a kernel, as lowered."""

    buffer: str
    space: str  # "global" | "shared"
    store: bool
    bytes: int  # per lane: the element size, or 16 for ldmatrix rows and cp.async chunks
    group: tuple  # global accesses of one statement list to one buffer count as one request
    lanes: int = WARP  # lanes whose address is used (ldmatrix .x1/.x2: 8/16)
    elem_bytes: int = 4  # the buffer's element size (indices are in elements)


@dataclass
class KernelCounters:
    """Totals over the sampled requests of a kernel (all its launches); see the module doc."""

    shared_requests: int = 0
    shared_wavefronts: int = 0
    global_load_requests: int = 0
    global_load_sectors: int = 0
    global_load_ideal: int = 0
    global_store_requests: int = 0
    global_store_sectors: int = 0
    global_store_ideal: int = 0
    mma_instructions: int = 0
    mma_flops: int = 0
    launches: int = 0

    @property
    def bank_conflicts(self) -> int:
        """Wavefronts past the first of each shared request (0: conflict-free)."""
        return self.shared_wavefronts - self.shared_requests

    @property
    def load_efficiency(self) -> float:
        """Ideal / touched sectors of the global loads (1.0: perfectly coalesced)."""
        return self.global_load_ideal / self.global_load_sectors if self.global_load_sectors else 1.0

    @property
    def store_efficiency(self) -> float:
        return self.global_store_ideal / self.global_store_sectors if self.global_store_sectors else 1.0

    def add(self, other: KernelCounters) -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def summary(self) -> str:
        parts = [f"shared {self.shared_requests} req, {self.bank_conflicts} bank conflicts",
                 f"global loads {self.global_load_requests} req, {self.load_efficiency:.0%} coalesced",
                 f"global stores {self.global_store_requests} req, {self.store_efficiency:.0%} coalesced"]
        if self.mma_instructions:
            parts.append(f"{self.mma_instructions} MMA ({self.mma_flops / 1e6:.3g} MFLOP on tensor cores)")
        return "; ".join(parts)


# -- code generation ------------------------------------------------------------------------------
class AccessCounter:
    """Emits the recording into one kernel's lowering (``llvm_cpu._KernelLowering``)."""

    def __init__(self, low: _KernelLowering) -> None:
        self.low = low
        self.sites: list[Site] = []
        self.paused = False  # the emulation's own reads (ldmatrix's rows, cp.async's elements)
        self.lists: list[int] = [0]  # the statement list being lowered (for grouping)
        name = low.kernel.name
        self.mma_symbol = f"sextant.count.{name}.mma"
        g = ir.GlobalVariable(low.module, I64, self.mma_symbol)
        g.initializer = ir.Constant(I64, 0)
        self.mma = g
        T = low.kernel.threads_per_block
        self.steps = ir.GlobalVariable(low.module, ir.ArrayType(I32, T), f"sextant.count.{name}.steps")
        self.steps.initializer = ir.Constant(ir.ArrayType(I32, T), None)
        self.ustep = ir.GlobalVariable(low.module, I32, f"sextant.count.{name}.ustep")
        self.ustep.initializer = ir.Constant(I32, 0)
        self.loop_body = False  # the next statement list lowered is a loop body

    def iteration(self, uniform: bool) -> None:
        """A loop iteration begins: a uniform loop's (all threads) or this thread's own."""
        b, low = self.low.b, self.low
        if uniform:
            b.store(b.add(b.load(self.ustep, typ=I32), low._i32(1)), self.ustep)
            return
        slot = b.gep(self.steps, [low._i32(0), low.ltid], inbounds=True)
        b.store(b.add(b.load(slot, typ=I32), low._i32(1)), slot)

    def _site_arrays(self, i: int) -> tuple[ir.GlobalVariable, ir.GlobalVariable, ir.GlobalVariable]:
        T = self.low.kernel.threads_per_block
        name = self.low.kernel.name
        rec_ty, n_ty = ir.ArrayType(I32, SAMPLES * T), ir.ArrayType(I32, T)
        rec = ir.GlobalVariable(self.low.module, rec_ty, f"sextant.count.{name}.{i}.rec")
        rec.initializer = ir.Constant(rec_ty, [-1] * (SAMPLES * T))
        stamp = ir.GlobalVariable(self.low.module, rec_ty, f"sextant.count.{name}.{i}.stamp")
        stamp.initializer = ir.Constant(rec_ty, None)
        n = ir.GlobalVariable(self.low.module, n_ty, f"sextant.count.{name}.{i}.n")
        n.initializer = ir.Constant(n_ty, None)
        return rec, stamp, n

    def record(self, buffer: str, index: ir.Value, store: bool, nbytes: int | None = None,
               lanes: int = WARP) -> None:
        """Record ``buffer[index]`` for this thread (block 0, first ``SAMPLES`` executions)."""
        low = self.low
        if self.paused or buffer not in low.buffers or buffer in low.plan.exchanges:
            return
        buf = low.buffers[buffer][0]
        if buf.space not in ("global", "shared"):
            return
        b = low.b
        site = len(self.sites)
        self.sites.append(Site(buffer, buf.space, store, nbytes or buf.dtype.itemsize,
                               (buffer, store, self.lists[-1]), lanes, buf.dtype.itemsize))
        rec, stamps, count = self._site_arrays(site)
        idx = b.trunc(index, I32) if index.type.width > 32 else index
        with b.if_then(b.icmp_signed("==", low.block_linear, low._i32(0))):
            slot = b.gep(count, [low._i32(0), low.ltid], inbounds=True)
            n = b.load(slot, typ=I32)
            with b.if_then(b.icmp_signed("<", n, low._i32(SAMPLES))):
                at = b.add(b.mul(n, low._i32(low.kernel.threads_per_block)), low.ltid)
                b.store(idx, b.gep(rec, [low._i32(0), at], inbounds=True))
                own = b.load(b.gep(self.steps, [low._i32(0), low.ltid], inbounds=True), typ=I32)
                stamp = b.add(b.mul(b.load(self.ustep, typ=I32), low._i32(1 << 16)), own)
                b.store(stamp, b.gep(stamps, [low._i32(0), at], inbounds=True))
                b.store(b.add(n, low._i32(1)), slot)

    def mma_issued(self) -> None:
        """One ``Mma`` by this thread's warp (counted by its lane 0)."""
        b, low = self.low.b, self.low
        with b.if_then(b.icmp_signed("==", b.and_(low.ltid, low._i32(WARP - 1)), low._i32(0))):
            b.store(b.add(b.load(self.mma, typ=I64), ir.Constant(I64, 1)), self.mma)


# -- running and counting ----------------------------------------------------------------------
@dataclass
class CountInfo:
    kernel: Kernel
    sites: list[Site]
    mma_flops: int  # FLOPs of one Mma of this kernel (0: none)
    addresses: dict[str, int] = field(default_factory=dict)  # symbol -> address


class CountingCpuModule(CpuModule):
    """A :class:`CpuModule` whose kernels record their accesses: launches run inline, one at a
    time, and add to :attr:`counters` (per kernel name)."""

    def __init__(self, kernels: Sequence[Kernel], addresses: dict[str, int], infos: dict[str, CountInfo],
                 **kw: object) -> None:
        super().__init__(kernels, addresses, **kw)  # type: ignore[arg-type]
        self.infos = infos
        self.counters: dict[str, KernelCounters] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "Counting" + super().__repr__()

    def prepare(self, name: str, buffers: Sequence[torch.Tensor], grid_blocks: int | None = None, *,
                parallel: bool | None = None) -> Callable[[], None]:
        run = super().prepare(name, buffers, grid_blocks, parallel=False)
        info = self.infos[name]

        def run_counted() -> None:
            with self._lock:
                _reset(info)
                run()
                self.counters.setdefault(name, KernelCounters()).add(_collect(info))

        return run_counted


def _array(info: CountInfo, symbol: str, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int32 * count).from_address(
        info.addresses[f"sextant.count.{info.kernel.name}.{symbol}"]))


def _arrays(info: CountInfo, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    T = info.kernel.threads_per_block
    return _array(info, f"{i}.rec", SAMPLES * T), _array(info, f"{i}.stamp", SAMPLES * T), _array(info, f"{i}.n", T)


def _reset(info: CountInfo) -> None:
    for i in range(len(info.sites)):
        rec, stamp, n = _arrays(info, i)
        rec[:] = -1
        stamp[:] = 0
        n[:] = 0
    _array(info, "steps", info.kernel.threads_per_block)[:] = 0
    _array(info, "ustep", 1)[:] = 0
    ctypes.c_int64.from_address(info.addresses[f"sextant.count.{info.kernel.name}.mma"]).value = 0


def _by_stamp(rec: np.ndarray, stamps: np.ndarray, T: int) -> list[dict[int, np.ndarray]]:
    """Per warp: stamp → the 32 lanes' indices at that stamp (-1: the lane did not access)."""
    warps: list[dict[int, np.ndarray]] = [{} for _ in range(max(1, T // WARP))]
    for n, t in zip(*np.nonzero(rec.reshape(SAMPLES, T) >= 0)):
        w, lane = divmod(int(t), WARP)
        at = n * T + t
        lanes = warps[w].setdefault(int(stamps[at]), np.full(WARP, -1, dtype=np.int64))
        lanes[lane] = rec[at]
    return warps


def _wavefronts(words: np.ndarray) -> int:
    """Wavefronts of one shared request: distinct words in its busiest bank."""
    if not words.size:
        return 0
    return int(np.bincount(np.unique(words) % BANKS, minlength=BANKS).max())


def _collect(info: CountInfo) -> KernelCounters:
    out = KernelCounters(launches=1)
    T = info.kernel.threads_per_block
    warps = max(1, T // WARP)
    groups: dict[tuple, list[tuple[list[dict[int, np.ndarray]], Site]]] = {}
    for i, site in enumerate(info.sites):
        rec, stamps, _ = _arrays(info, i)
        per_warp = _by_stamp(rec, stamps, T)
        if site.space == "shared":
            for w in range(warps):
                for lanes in per_warp[w].values():
                    lanes = lanes[:site.lanes]
                    active = lanes[lanes >= 0]
                    if not active.size:
                        continue
                    if site.bytes <= 4:
                        out.shared_requests += 1
                        out.shared_wavefronts += _wavefronts(active * site.elem_bytes // 4)
                        continue
                    for p in range(0, site.lanes, 8):  # 16-byte accesses: 8 lanes a wavefront
                        phase = lanes[p:p + 8]
                        phase = phase[phase >= 0]
                        if phase.size:
                            start = phase * site.elem_bytes // 4
                            words = (start[:, None] + np.arange(site.bytes // 4)[None, :]).ravel()
                            out.shared_requests += 1
                            out.shared_wavefronts += _wavefronts(words)
        else:
            groups.setdefault(site.group, []).append((per_warp, site))
    none = np.full(WARP, -1, dtype=np.int64)
    for members in groups.values():
        store = members[0][1].store
        for w in range(warps):
            for stamp in sorted({s for per_warp, _ in members for s in per_warp[w]}):
                accesses = [(per_warp[w].get(stamp, none), site) for per_warp, site in members]
                for cluster in _vector_accesses(accesses):
                    touched = np.unique(np.concatenate(cluster))
                    sectors, ideal = np.unique(touched // SECTOR).size, -(-touched.size // SECTOR)
                    if store:
                        out.global_store_requests += 1
                        out.global_store_sectors += sectors
                        out.global_store_ideal += ideal
                    else:
                        out.global_load_requests += 1
                        out.global_load_sectors += sectors
                        out.global_load_ideal += ideal
    out.mma_instructions = ctypes.c_int64.from_address(info.addresses[f"sextant.count.{info.kernel.name}.mma"]).value
    out.mma_flops = out.mma_instructions * info.mma_flops
    return out


def _vector_accesses(sites: list[tuple[np.ndarray, Site]]) -> list[list[np.ndarray]]:
    """One warp's accesses of one statement list to one buffer, grouped into the instructions a
    vectorising code generator makes of them: consecutive sites in which every lane stays in the
    aligned 16-byte block it started in (the 4 lanes of an unrolled f32x4 loop, an element pair
    of an MMA accumulator) are one wide access. Each group is a list of byte-address arrays."""
    out: list[list[np.ndarray]] = []
    first: np.ndarray | None = None
    for lanes, site in sites:
        mask = lanes >= 0
        if not mask.any():
            continue
        start = lanes.astype(np.int64) * site.elem_bytes
        span = (start[mask][:, None] + np.arange(site.bytes)[None, :]).ravel()
        block = np.where(mask, start // 16, -1)
        if first is not None and np.array_equal(block, first) and site.bytes < 16:
            out[-1].append(span)
        else:
            out.append([span])
            first = block
    return out
