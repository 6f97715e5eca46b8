"""The GPU-independent half of the CUDA runtime: what to launch, in which order, with which pointers.

A :class:`LaunchPlan` is computed once from a scheduled :class:`Program` and the PTX module's
launch shapes. It holds everything the driver calls need but no driver state, so it can be
unit-tested on a machine without a GPU:

* one :class:`LaunchSpec` per launch: kernel, grid, block, the buffer behind each kernel
  parameter, and which buffers it reads and writes (from the kernel parameters' roles);
* the launch DAG (:func:`launch_dependencies`): launch *j* must precede launch *i* when they
  touch overlapping bytes and one of them writes (read-after-write, write-after-read,
  write-after-write). Temporaries share the arena by liveness, so overlap is decided on byte
  ranges, not buffer indices. In a CUDA graph, launches without a path between them may run
  concurrently; the edges are transitively reduced to keep the graph small;
* the rebinding plan (:attr:`LaunchPlan.bindings`): for each per-call buffer (graph inputs and
  outputs) the (launch, parameter slot) pairs that receive its address. Weights and the arena
  never move, so when a call brings new input or output tensors only these kernel nodes are
  updated (``cuGraphExecKernelNodeSetParams``), not the whole graph;
* :class:`ParamBlock`: a launch's ``void**`` kernel-parameter array in host memory. The driver
  copies the pointed-to values when a launch is enqueued or a graph node is set, so one block
  per launch is reused across calls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from sextant.errors import SextantError
from sextant.kernel.ir import Kernel
from sextant.schedule.program import Program

PER_CALL_KINDS = ("input", "output")  # buffers whose address can change from call to call
ARENA_REGION = -1  # region id of the shared intermediate arena


class PlanError(SextantError, ValueError):
    """The program's launches do not fit the kernels (a compiler bug, named precisely)."""


@dataclass(frozen=True)
class LaunchSpec:
    index: int  # position among the kernel launches (an extern call is not one)
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[int, ...]  # buffer index of each kernel parameter, in parameter order
    reads: frozenset[int]  # buffer indices
    writes: frozenset[int]
    launch: int = -1  # index into Program.launches


@dataclass(frozen=True)
class LaunchPlan:
    launches: tuple[LaunchSpec, ...]
    deps: tuple[tuple[int, ...], ...]  # per launch: the earlier launches it must wait for (reduced)
    bindings: dict[int, tuple[tuple[int, int], ...]]  # per-call buffer -> ((launch, slot), ...)

    def affected(self, changed: Sequence[int]) -> list[int]:
        """Launches whose parameters change when the buffers ``changed`` move, in launch order."""
        return sorted({li for b in changed for li, _ in self.bindings.get(b, ())})


def launch_specs(program: Program) -> list[LaunchSpec]:
    """One spec per kernel launch (extern calls are the runner's), checked against its kernel's
    parameters and grid."""
    specs = []
    for li, launch in enumerate(program.launches):
        if launch.extern is not None:
            continue
        kernel = program.kernels.get(launch.kernel)
        if kernel is None:
            raise PlanError(f"launch {li} names kernel {launch.kernel!r}, which the program does not have")
        _check_launch(li, launch.args, launch.blocks, kernel, program)
        reads = {a for a, p in zip(launch.args, kernel.params) if p.role in ("in", "inout")}
        writes = {a for a, p in zip(launch.args, kernel.params) if p.role in ("out", "inout")}
        specs.append(LaunchSpec(len(specs), kernel.name, kernel.grid, kernel.block, tuple(launch.args),
                                frozenset(reads), frozenset(writes), li))
    return specs


def _check_launch(li: int, args: Sequence[int], blocks: int, kernel: Kernel, program: Program) -> None:
    where = f"launch {li} ({kernel.name})"
    if len(args) != len(kernel.params):
        raise PlanError(f"{where} passes {len(args)} buffers, the kernel takes {len(kernel.params)}")
    if blocks != kernel.num_blocks:
        raise PlanError(f"{where} asks for {blocks} blocks; a GPU launch runs the kernel's whole grid "
                        f"{kernel.grid} ({kernel.num_blocks} blocks)")
    for a, p in zip(args, kernel.params):
        node = program.buffers[a].node
        if node.dtype != p.dtype or node.type.numel < p.size:
            raise PlanError(f"{where}: parameter {p.name} is {p.dtype.value}[{p.size}] but buffer {a} is {node.type}")


def _region(program: Program, b: int) -> tuple[int, int, int]:
    """(allocation, first byte, end byte) of buffer ``b``: temporaries live in the shared arena."""
    info = program.buffers[b]
    if info.kind == "temp":
        return ARENA_REGION, info.offset, info.offset + info.nbytes
    return b, 0, info.nbytes


def _overlap(program: Program, xs: frozenset[int], ys: frozenset[int]) -> bool:
    for x in xs:
        rx = _region(program, x)
        for y in ys:
            ry = _region(program, y)
            if rx[0] == ry[0] and rx[1] < ry[2] and ry[1] < rx[2]:
                return True
    return False


def launch_dependencies(program: Program, specs: Sequence[LaunchSpec]) -> list[tuple[int, ...]]:
    """Per launch, the earlier launches it must follow (RAW, WAR, WAW on overlapping bytes),
    transitively reduced: an edge already implied by a path through another dependency is dropped."""
    ancestors: list[int] = []  # bitset of all launches each launch (transitively) waits for
    deps: list[tuple[int, ...]] = []
    for i, s in enumerate(specs):
        direct = [j for j in range(i) if _overlap(program, specs[j].writes, s.reads | s.writes)
                  or _overlap(program, specs[j].reads, s.writes)]
        implied = 0
        for j in direct:
            implied |= ancestors[j]
        reduced = tuple(j for j in direct if not implied >> j & 1)
        mask = implied
        for j in reduced:
            mask |= 1 << j
        ancestors.append(mask)
        deps.append(reduced)
    return deps


def rebinding(program: Program, specs: Sequence[LaunchSpec]) -> dict[int, tuple[tuple[int, int], ...]]:
    """For each graph input and output buffer, the (launch, parameter slot) pairs that take its address."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in specs:
        for slot, b in enumerate(s.args):
            if program.buffers[b].kind in PER_CALL_KINDS:
                out.setdefault(b, []).append((s.index, slot))
    return {b: tuple(v) for b, v in out.items()}


def plan(program: Program) -> LaunchPlan:
    specs = launch_specs(program)
    return LaunchPlan(tuple(specs), tuple(launch_dependencies(program, specs)), rebinding(program, specs))


def topological_orders_ok(order: Sequence[int], deps: Sequence[Sequence[int]]) -> bool:
    """Whether ``order`` (a permutation of launch indices) respects ``deps``."""
    pos = {li: k for k, li in enumerate(order)}
    return len(pos) == len(deps) and all(pos[j] < pos[i] for i, ds in enumerate(deps) for j in ds)


class ParamBlock:
    """A launch's kernel parameters as the driver wants them: ``void**``, one pointer per parameter
    pointing at that parameter's value (here a device address) — then, for a kernel with TMA loads,
    ``blobs`` pointers at 128-byte tensor maps (``runtime.tensor_maps``), passed by value."""

    def __init__(self, addresses: Sequence[int], blobs: int = 0) -> None:
        n = max(1, len(addresses))
        self.values = (ctypes.c_void_p * n)(*addresses)
        base = ctypes.addressof(self.values)
        step = ctypes.sizeof(ctypes.c_void_p)
        self.blobs = [(ctypes.c_uint64 * 16)() for _ in range(blobs)]
        slots = [base + k * step for k in range(len(addresses))] + [ctypes.addressof(b) for b in self.blobs]
        self.pointers = (ctypes.c_void_p * max(1, len(slots)))(*slots)
        self.count = len(slots)

    def set_blob(self, index: int, data: bytes) -> None:
        ctypes.memmove(self.blobs[index], data, min(len(data), ctypes.sizeof(self.blobs[index])))

    @property
    def address(self) -> int:
        """The ``void**`` to pass as ``kernelParams`` (0, i.e. NULL, for a kernel without parameters)."""
        return ctypes.addressof(self.pointers) if self.count else 0

    def set(self, slot: int, address: int) -> None:
        self.values[slot] = address

    def get(self, slot: int) -> int:
        return self.values[slot] or 0
