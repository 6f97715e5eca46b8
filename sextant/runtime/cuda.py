"""target="cuda": running a scheduled :class:`Program`'s PTX kernels on an NVIDIA GPU.

Through NVIDIA's cuda-python driver bindings (``cuda.bindings.driver``), not a C extension: the
driver API is all a runtime of precompiled kernels needs (load a module, launch, graphs), and
cuda-python installs from PyPI without a compiler or a GPU. Decisions, and why:

* **torch owns memory and streams.** Constants are uploaded once (at construction) into torch
  CUDA tensors, the intermediate arena is one ``torch.empty`` per module, and outputs are new torch
  tensors each call. Inputs are used in place (their ``data_ptr`` goes straight into the kernel
  parameters: no copy, unless a view is non-contiguous or not 16-byte aligned, which the PTX's
  vector accesses require). Launches go to torch's current stream, in the device's primary
  context (the one torch uses), so they are ordered with the caller's torch work and torch's
  caching allocator's stream semantics hold for every tensor involved.
* **cubin if we have one, else PTX.** The caller passes ptxas's cubin when it was assembled for
  this device's architecture; otherwise the driver JIT-compiles the PTX at load time.
* **An explicit CUDA graph, not stream capture.** The launch sequence is built once, on the
  first call, as a graph of kernel nodes whose edges come from buffer hazards (see
  :mod:`sextant.runtime.cuda_graph`), so independent launches may overlap; replay is one
  ``cuGraphLaunch``. Building the graph ourselves keeps each node's handle, which is what lets a
  later call with different input/output tensors update just the nodes that take them
  (``cuGraphExecKernelNodeSetParams``), instead of copying inputs into static buffers (as
  ``torch.cuda.graphs`` does) or re-instantiating. It also avoids stream capture's refusal of
  the legacy default stream, which is torch's current stream unless the caller picks another.
* ``use_graph=False`` (or ``SEXTANT_CUDA_GRAPHS=0``) launches kernel by kernel with
  ``cuLaunchKernel``; ``SEXTANT_CUDA_SYNC=1`` additionally synchronises after every launch, so an
  asynchronous fault (an illegal address, say) is reported with the kernel that caused it.

Calls are serialised on the host (one lock: the arena, the parameter blocks and the graph are
per module). A call on a different stream than the previous one first makes its stream wait for
the previous one, because both use the same arena.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from sextant.errors import SextantError
from sextant.runtime.cuda_graph import PER_CALL_KINDS, LaunchSpec, ParamBlock, plan
from sextant.runtime.extern import run_extern
from sextant.runtime.tensor_maps import MapSlot, kernel_map_slots
from sextant.runtime.tensor_maps import encode as encode_map
from sextant.schedule.program import CollectiveCall, Launch, Program

ALIGN = 16  # bytes; every kernel parameter must be this aligned (the PTX uses 128-bit accesses)
SIM_HINT = "target='cuda-sim' runs the same GPU kernels on the CPU"


class CudaUnavailableError(SextantError, RuntimeError):
    """target='cuda' cannot run here: no GPU, or no cuda-python."""


class CudaError(SextantError, RuntimeError):
    """A CUDA driver call failed; the message names the CUresult and what was being done."""


def load_driver() -> ModuleType:
    """cuda-python's driver bindings (``cuda.bindings.driver``; ``cuda.cuda`` before cuda-python 12.6)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as e:
            raise CudaUnavailableError("target='cuda' needs NVIDIA's cuda-python driver bindings, which are not "
                                       "installed (pip install 'sextant[cuda]' or cuda-python); "
                                       f"{SIM_HINT}") from e
    return driver


def require_cuda(device: torch.device | str | None = None) -> torch.device:
    """The CUDA device to run on; raises :class:`CudaUnavailableError` (one line, naming what is
    missing) when torch sees no GPU or cuda-python is missing."""
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise CudaUnavailableError(f"target='cuda' needs an NVIDIA GPU, but torch.cuda.is_available() is False "
                                   f"(torch {torch.__version__}, {built}); {SIM_HINT}")
    load_driver()
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        raise CudaUnavailableError(f"target='cuda' runs on a CUDA device, not {dev}")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


def device_arch(device: torch.device) -> str:
    """``sm_XY`` from the device's compute capability (sm_90 on H100/H200)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def load_runner(program: Program, ptx: str, cubin: bytes | None, arch: str,
                device: torch.device | str | None = None) -> CudaRunner:
    """A runner for kernels compiled earlier (a saved artifact, or ``sextant.compile``): loads the
    cubin when it was assembled for exactly this GPU's architecture, else has the driver compile
    the PTX (PTX for an older architecture runs on a newer GPU; a cubin does not, across majors)."""
    dev = require_cuda(device)
    here = device_arch(dev)
    usable = cubin if cubin and arch == here else None
    if usable is None and not ptx:
        raise CudaError(f"no PTX to load, and the cubin is for {arch}, not this GPU's {here}; recompile with "
                        f"sextant.compile(..., target='cuda')")
    if program.symbols:
        return SymbolicCudaRunner(program, ptx=ptx or None, cubin=usable, arch=arch, device=dev)  # type: ignore[return-value]
    return CudaRunner(program, ptx=ptx or None, cubin=usable, arch=arch, device=dev)


class SymbolicCudaRunner:
    """A program over symbolic sizes on the GPU: one loaded module and one copy of the weights; per
    binding of the sizes (solved from the inputs' shapes) a :class:`CudaRunner` over the program's
    bound view (``Program.bound``: grids, arena plan, size parameters), kept in a small LRU cache —
    each has its own arena and CUDA graph. The first binding's runner owns the module."""

    def __init__(self, program: Program, *, keep: int = 8, **kwargs: Any) -> None:
        self.program = program
        self._kwargs = kwargs
        self._keep = keep
        self._owner: CudaRunner | None = None
        self._runners: dict[tuple, CudaRunner] = {}
        self._lock = threading.Lock()

    def runner(self, inputs: Sequence[torch.Tensor]) -> CudaRunner:
        layout = self.program.layout_for(inputs)
        with self._lock:
            r = self._runners.get(layout.binding)
            if r is None:
                r = CudaRunner(self.program.bound(layout), share=self._owner, sizes=dict(layout.binding),
                               **self._kwargs)
                self._owner = self._owner or r
                self._runners[layout.binding] = r
                while len(self._runners) > self._keep:
                    old = self._runners.pop(next(iter(self._runners)))
                    if old is not self._owner:
                        old.close()
            return r

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.runner(inputs)(inputs)

    def profile(self, inputs: Sequence[torch.Tensor], repeats: int = 20) -> list[float]:
        return self.runner(inputs).profile(inputs, repeats)

    def close(self) -> None:
        for r in list(self._runners.values()):
            if r is not self._owner:
                r.close()
        self._runners.clear()
        if self._owner is not None:
            self._owner.close()

    def __repr__(self) -> str:
        return f"SymbolicCudaRunner({len(self.program.kernels)} kernels, {len(self._runners)} bindings loaded)"


class Driver:
    """Calls into the driver bindings, turning a non-success ``CUresult`` into :class:`CudaError`."""

    def __init__(self, module: ModuleType) -> None:
        self.m = module
        self._success = module.CUresult.CUDA_SUCCESS

    def __call__(self, fn: str, *args: Any, what: str = "") -> Any:
        result = getattr(self.m, fn)(*args)
        err, rest = result[0], result[1:]
        if err != self._success:
            doing = f" while {what}" if what else ""
            raise CudaError(f"{fn} failed with {self.error_name(err)}{doing}")
        return rest[0] if len(rest) == 1 else rest

    def error_name(self, err: Any) -> str:
        try:
            status, name = self.m.cuGetErrorName(err)
            if status == self._success and name:
                return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # the name is a courtesy; never mask the original failure
            pass
        return getattr(err, "name", None) or str(err)


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")


class CudaRunner:
    """Runs ``program``'s kernels on a GPU: ``runner(inputs) -> outputs``, torch CUDA tensors in and out.

    ``ptx`` and/or ``cubin`` hold the program's kernels (the cubin, when given, must be for this
    device's ``arch``; else the PTX is JIT-compiled by the driver). ``driver`` replaces
    ``cuda.bindings.driver`` (tests pass a fake); ``device`` defaults to torch's current CUDA device.
    """

    def __init__(self, program: Program, *, ptx: str | None = None, cubin: bytes | None = None,
                 arch: str | None = None, device: torch.device | str | None = None,
                 use_graph: bool | None = None, sync_each_launch: bool | None = None,
                 driver: ModuleType | None = None, share: CudaRunner | None = None,
                 sizes: Mapping[str, int] | None = None) -> None:
        if ptx is None and cubin is None and share is None:
            raise ValueError("CudaRunner needs the program's PTX or a cubin")
        self.program = program
        self.plan = plan(program)
        self._sizes = dict(sizes or {})  # values of the kernels' size parameters (a bound symbolic program)
        self.arch = arch
        self.device = torch.device(device) if device is not None else require_cuda()
        if self.device.type == "cuda":
            torch.cuda.init()  # torch's runtime first: it retains and uses the same primary context
            if self.device.index is None:  # "cuda" means torch's current device; inputs are compared by index
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.use_graph = _env_flag("SEXTANT_CUDA_GRAPHS", True) if use_graph is None else use_graph
        # extern calls run on the host between kernels, on torch's stream: the kernels between two
        # calls are one CUDA graph each
        self.externs = sum(la.extern is not None for la in program.launches)
        self.sync_each_launch = (_env_flag("SEXTANT_CUDA_SYNC", False) if sync_each_launch is None
                                 else sync_each_launch)
        self._lock = threading.Lock()
        self._owner = share is None  # a runner sharing another's module, context and weights frees none
        if share is not None:
            self._drv, self._context, self._module = share._drv, share._context, share._module
            self._cu_device, self._retained = share._cu_device, False
            self._functions, self._shared, self.constants = share._functions, share._shared, share.constants
            self.image, self.cubin_error = share.image, share.cubin_error
        else:
            self._drv = Driver(driver if driver is not None else load_driver())
            self.image = "cubin" if cubin is not None else "ptx"  # what was loaded
            self.cubin_error = None
            with self._on_device():  # the caller's current device and context are left as they were
                self._context = self._primary_context()
                self._module = self._load(ptx, cubin)
                self._functions = {name: self._drv("cuModuleGetFunction", self._module, name.encode(),
                                                   what=f"looking up kernel {name} in the loaded module")
                                   for name in program.kernels}
                self._shared = self._opt_into_dynamic_shared()
            # device memory: weights once, one arena for the intermediates
            self.constants = {i: t.detach().contiguous().to(self.device) for i, t in program.constants.items()}
        self.arena = torch.empty(max(program.arena_bytes, 1), dtype=torch.uint8, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # uploads done before any stream uses them
        self._fixed = self._fixed_addresses()
        self._extern_temps = self._arena_views({b for la in program.launches if la.extern is not None
                                                for b in la.args if program.buffers[b].kind == "temp"})
        # buffers' addresses, then the kernel's sizes (an i32 parameter reads the low 4 bytes of its
        # 8-byte slot: little-endian, as every CUDA host is)
        self._blocks = [ParamBlock([self._fixed.get(b, 0) for b in s.args] +
                                   [self._sizes[z.name] for z in program.kernels[s.kernel].sizes],
                                   len(kernel_map_slots(program.kernels[s.kernel])))
                        for s in self.plan.launches]
        # TMA tensor maps: per buffer, the (launch, map) slots encoding its address; fixed ones now
        self._maps: dict[int, list[tuple[int, MapSlot]]] = {}
        for li, s in enumerate(self.plan.launches):
            for slot in kernel_map_slots(program.kernels[s.kernel]):
                self._maps.setdefault(s.args[slot.param], []).append((li, slot))
        for b, address in self._fixed.items():
            self._encode_maps(b, address)
        self._bound: dict[int, int] = {}  # per-call buffer -> address its parameter blocks hold now
        self._graph: list[Any] | None = None  # per segment (a run of kernels, or None for an extern call)
        self._exec: list[Any] | None = None
        self._segments: list[Any] = []  # per segment: its kernel launches' indices, or the extern Launch
        self._segment_of: list[int] = []  # per kernel launch, its segment
        self._exec_bound: dict[int, int] = {}  # per-call buffer -> address the instantiated graph's nodes hold
        self._nodes: list[Any] = []
        self._last_stream: torch.cuda.Stream | None = None
        self.stats = {"calls": 0, "graph_builds": 0, "node_updates": 0, "kernel_launches": 0}

    def bound_address(self, buffer: int) -> int | None:
        """The device address the kernels were last given for a graph input or output buffer."""
        return self._bound.get(buffer)

    # -- setup ----------------------------------------------------------------------------------
    def _primary_context(self) -> Any:
        d = self._drv
        d("cuInit", 0, what="initialising the CUDA driver")
        self._cu_device = d("cuDeviceGet", self.device.index or 0, what=f"opening device {self.device}")
        ctx = d("cuDevicePrimaryCtxRetain", self._cu_device, what=f"retaining the primary context of {self.device}")
        self._retained = True
        d("cuCtxSetCurrent", ctx, what="making the primary context current")
        return ctx

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """torch's device guard for this runner's GPU: torch's current device (and the thread's
        current context with it) is restored afterwards, so a call does not switch the caller's device."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _load(self, ptx: str | None, cubin: bytes | None) -> Any:
        if cubin is not None:
            try:
                return self._drv("cuModuleLoadData", cubin, what=f"loading the cubin for {self.arch}")
            except CudaError as e:
                if ptx is None:
                    raise
                self.cubin_error = str(e)  # e.g. a ptxas newer than the driver: let the driver compile the PTX
                self.image = "ptx"
        assert ptx is not None
        return self._drv("cuModuleLoadData", ptx.encode() + b"\0",
                         what=f"loading PTX for {self.arch} (JIT-compiled by the driver; run ptxas on "
                              "compiled.stages['ptx'].ptx for its diagnostics)")

    def _fixed_addresses(self) -> dict[int, int]:
        """Device addresses of the buffers that never move: weights and arena temporaries."""
        base = self.arena.data_ptr()
        out = {i: t.data_ptr() for i, t in self.constants.items()}
        for b in self.program.buffers:
            if b.kind == "temp":
                out[b.index] = base + b.offset
        for i, a in out.items():
            if a % ALIGN:
                raise CudaError(f"buffer {i} ({self.program.buffers[i].kind}) is at {a:#x}, not {ALIGN}-byte aligned")
        return out

    def _arena_views(self, buffers: set[int]) -> dict[int, torch.Tensor]:
        """Tensors over the arena for the temporaries ``buffers`` (what an extern call reads and writes)."""
        out = {}
        for b in sorted(buffers):
            info = self.program.buffers[b]
            raw = self.arena[info.offset:info.offset + info.nbytes]
            out[b] = raw.view(info.node.dtype.torch).view(info.node.shape)
        return out

    # -- a call ---------------------------------------------------------------------------------
    def _tensors(self, inputs: Sequence[torch.Tensor]) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
        """Every buffer's tensor for one call (inputs, fresh outputs, weights, and the arena temporaries
        extern calls read and write) and the per-call addresses."""
        p = self.program
        tensors: dict[int, torch.Tensor] = {**self.constants, **self._extern_temps}
        for b, x in zip(p.buffers, inputs):  # inputs come first, in graph order
            tensors[b.index] = self._as_input(b.index, x)
        for b in p.buffers:
            if b.kind == "output":
                tensors[b.index] = torch.empty(b.node.shape, dtype=b.node.dtype.torch, device=self.device)
        return tensors, {b.index: tensors[b.index].data_ptr() for b in p.buffers if b.kind in PER_CALL_KINDS}

    @contextlib.contextmanager
    def _call(self, inputs: Sequence[torch.Tensor]) -> Iterator[tuple[int, dict[int, torch.Tensor], dict[int, int]]]:
        """One call's setting: the lock held, the device and primary context current (the calling
        thread may never have used this GPU, or have another context current); yields torch's
        stream, every buffer's tensor and the per-call addresses."""
        if getattr(self, "_module", None) is None:
            raise CudaError(f"{self!r} was closed")
        with self._lock, self._on_device():
            self._drv("cuCtxSetCurrent", self._context, what="making the primary context current")
            stream = self._stream()
            yield (stream, *self._tensors(inputs))

    def profile(self, inputs: Sequence[torch.Tensor], repeats: int = 20) -> list[float]:
        """Seconds per launch, in plan order: after one whole forward has filled every buffer, each
        launch is issued ``repeats`` times back to back between two CUDA events (so a launch costs
        what it costs on the GPU, without the host's launch overhead between kernels)."""
        with self._call(inputs) as (stream, tensors, addresses):
            self._run_launches(addresses, stream, tensors)
            handle, out = self._stream_handle(stream), []
            pending: dict[int, Any] = {}  # collectives in flight
            for step in self._steps():
                start, end = _Timer(self.device), _Timer(self.device)
                start.record()
                collective = not isinstance(step, LaunchSpec) and isinstance(step.extern, CollectiveCall)
                for _ in range(1 if collective else repeats):  # every rank issues one transfer
                    if isinstance(step, LaunchSpec):
                        self._drv("cuLaunchKernel", self._functions[step.kernel], *step.grid, *step.block,
                                  self._shared[step.kernel], handle, self._blocks[step.index].address, 0,
                                  what=_describe(step))
                    else:
                        run_extern(self.program, step, tensors, self.device, pending)
                end.record()
                out.append(start.seconds_to(end) / (1 if collective else repeats))
            del tensors
        return out

    def _steps(self) -> list[LaunchSpec | Launch]:
        """The program's launches in order: a kernel's spec, or the launch of an extern call."""
        specs = iter(self.plan.launches)
        return [la if la.extern is not None else next(specs) for la in self.program.launches]

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        p = self.program
        with self._call(inputs) as (stream, tensors, addresses):
            if self.use_graph and self.plan.launches:
                self._run_graph(addresses, stream, tensors)
            else:
                self._run_launches(addresses, stream, tensors)
            self.stats["calls"] += 1
        # an output that is an input or a weight is returned as a copy, as the module would
        return [tensors[i].clone() if copy else tensors[i] for i, copy in zip(p.outputs, p.output_copies)]

    def _stream(self) -> int:
        """torch's current stream (a raw ``cudaStream_t``), ordered after the previous call's stream."""
        if self.device.type != "cuda":  # a fake driver in tests: the launches run synchronously
            return 0
        s = torch.cuda.current_stream(self.device)
        if self._last_stream is not None and self._last_stream.cuda_stream != s.cuda_stream:
            s.wait_stream(self._last_stream)  # the arena is shared with the previous call's launches
        self._last_stream = s
        return s.cuda_stream

    def _as_input(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.device:
            raise CudaError(f"input {index} is on {x.device}; this module runs on {self.device}")
        if not x.is_contiguous():
            x = x.contiguous()
        if x.data_ptr() % ALIGN:  # a view at an odd offset: the kernels' vector loads need alignment
            x = x.clone()
        return x

    def _rebind(self, addresses: dict[int, int]) -> list[int]:
        """Write the new per-call addresses into the parameter blocks (and the tensor maps over those
        buffers); the launches that changed."""
        changed = [b for b, a in addresses.items() if self._bound.get(b) != a]
        for b in changed:
            for li, slot in self.plan.bindings.get(b, ()):
                self._blocks[li].set(slot, addresses[b])
            self._encode_maps(b, addresses[b])
            self._bound[b] = addresses[b]
        return self.plan.affected(changed)

    def _encode_maps(self, buffer: int, address: int) -> None:
        """The tensor maps reading ``buffer``, encoded at ``address``, into their launches' blocks."""
        for li, slot in self._maps.get(buffer, ()):
            self._blocks[li].set_blob(slot.index, encode_map(self._drv, slot, address))

    def _run_launches(self, addresses: dict[int, int], stream: int, tensors: dict[int, torch.Tensor]) -> None:
        self._rebind(addresses)
        d, handle = self._drv, self._stream_handle(stream)
        pending: dict[int, Any] = {}  # collectives in flight (NCCL's stream, waited for on this one)
        for s in self._steps():
            if not isinstance(s, LaunchSpec):  # an extern call: torch's op, on torch's (this) stream
                run_extern(self.program, s, tensors, self.device, pending)
                continue
            block = self._blocks[s.index]
            d("cuLaunchKernel", self._functions[s.kernel], *s.grid, *s.block, self._shared[s.kernel], handle,
              block.address, 0,
              what=_describe(s))
            self.stats["kernel_launches"] += 1
            if self.sync_each_launch:
                d("cuStreamSynchronize", handle, what=f"running {_describe(s)}")

    def _run_graph(self, addresses: dict[int, int], stream: int, tensors: dict[int, torch.Tensor]) -> None:
        """Replay the CUDA graph — one per run of kernels between extern calls, each call made on the
        same stream between two graph launches (stream order is the dependency across a call)."""
        self._rebind(addresses)
        d = self._drv
        if self._exec is None:
            self._build_graph()
        else:
            # compared with what the instantiated graph holds, not with the parameter blocks: calls
            # made with use_graph=False in between rebind the blocks but not the graph's nodes
            changed = [b for b, a in addresses.items() if self._exec_bound.get(b) != a]
            try:
                for li in self.plan.affected(changed):
                    s = self.plan.launches[li]
                    d("cuGraphExecKernelNodeSetParams", self._exec[self._segment_of[li]], self._nodes[li],
                      self._node_params(s), what=f"updating the graph node of {_describe(s)} with this call's tensors")
                    self.stats["node_updates"] += 1
            except CudaError:
                self._destroy_graph()  # some nodes may hold stale addresses: rebuild on the next call
                raise
        self._exec_bound = dict(addresses)
        handle = self._stream_handle(stream)
        pending: dict[int, Any] = {}  # collectives in flight
        for step, exec_ in zip(self._segments, self._exec):
            if exec_ is None:  # an extern call between two graphs
                run_extern(self.program, step, tensors, self.device, pending)
                continue
            d("cuGraphLaunch", exec_, handle, what=f"launching the CUDA graph of {len(step)} kernels")
            if self.sync_each_launch:
                d("cuStreamSynchronize", handle, what=f"running the CUDA graph of {len(step)} kernels")

    def _build_graph(self) -> None:
        """One graph per run of kernel launches between extern calls (one graph when there are none);
        edges from the launch plan's hazards within a run."""
        d = self._drv
        self._destroy_graph()
        segments: list[Any] = []
        for step in self._steps():
            if isinstance(step, LaunchSpec):
                if not segments or not isinstance(segments[-1], list):
                    segments.append([])
                segments[-1].append(step.index)
            else:
                segments.append(step)
        self._segments, self._graph, self._exec = segments, [], []
        self._nodes, self._segment_of = [None] * len(self.plan.launches), [0] * len(self.plan.launches)
        for k, seg in enumerate(segments):
            if not isinstance(seg, list):
                self._graph.append(None)
                self._exec.append(None)
                continue
            graph = d("cuGraphCreate", 0, what="creating a CUDA graph")
            self._graph.append(graph)
            for li in seg:
                s = self.plan.launches[li]
                parents = [self._nodes[j] for j in self.plan.deps[li] if self._segment_of[j] == k]
                self._nodes[li] = d("cuGraphAddKernelNode", graph, parents, len(parents), self._node_params(s),
                                    what=f"adding {_describe(s)} to the CUDA graph")
                self._segment_of[li] = k
            # cuda-python 12.x and 13.x: cuGraphInstantiate(hGraph, flags) (CUDA 12 made it the
            # flags form; 12.x bindings also name it cuGraphInstantiateWithFlags, 13.x no longer do)
            self._exec.append(d("cuGraphInstantiate", graph, 0, what="instantiating the CUDA graph"))
        self.stats["graph_builds"] += 1

    def _destroy_graph(self) -> None:
        for fn, attr in (("cuGraphExecDestroy", "_exec"), ("cuGraphDestroy", "_graph")):
            handles = getattr(self, attr, None)
            if handles is not None:
                setattr(self, attr, None)
                for handle in handles:
                    if handle is not None:
                        with contextlib.suppress(Exception):
                            getattr(self._drv.m, fn)(handle)
        self._nodes = []
        self._exec_bound = {}

    def _node_params(self, s: LaunchSpec) -> Any:
        p = self._drv.m.CUDA_KERNEL_NODE_PARAMS()
        p.func = self._functions[s.kernel]
        p.gridDimX, p.gridDimY, p.gridDimZ = s.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = s.block
        p.sharedMemBytes = self._shared[s.kernel]  # dynamic shared memory (0: all static, in the PTX)
        p.kernelParams = self._blocks[s.index].address
        return p

    def _opt_into_dynamic_shared(self) -> dict[str, int]:
        """Each kernel's dynamic shared memory; a kernel past the 48 KiB default is allowed its
        size first (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), else its launches fail."""
        from sextant.kernel.shared_memory import dynamic_shared_bytes

        sizes = {name: dynamic_shared_bytes(k) for name, k in self.program.kernels.items()}
        attr = self._drv.m.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        for name, size in sizes.items():
            if size:
                self._drv("cuFuncSetAttribute", self._functions[name], attr, size,
                          what=f"allowing kernel {name} {size} bytes of dynamic shared memory")
        return sizes

    def _stream_handle(self, stream: int) -> Any:
        return self._drv.m.CUstream(stream)

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for this runner's last launches, destroy the graph, unload the module and release
        the primary context (also done when the runner is garbage-collected, possibly on another
        thread: the context is pushed for the teardown and popped after, leaving the thread's as it was)."""
        d = getattr(self, "_drv", None)
        if d is None:
            return
        m = d.m
        ctx = getattr(self, "_context", None)
        # at interpreter exit the driver may already be gone: teardown never raises
        pushed = False
        if ctx is not None:
            with contextlib.suppress(Exception):
                pushed = m.cuCtxPushCurrent(ctx)[0] == d._success
        last = getattr(self, "_last_stream", None)
        if last is not None:  # kernels still running must not outlive their module (nor the arena)
            with contextlib.suppress(Exception):
                m.cuStreamSynchronize(self._stream_handle(last.cuda_stream))
        self._last_stream = None
        self._destroy_graph()
        module = getattr(self, "_module", None)
        if module is not None:
            self._module = None
            if getattr(self, "_owner", True):
                with contextlib.suppress(Exception):
                    m.cuModuleUnload(module)
        if pushed:
            with contextlib.suppress(Exception):
                m.cuCtxPopCurrent()
        if getattr(self, "_retained", False):
            self._retained = False
            with contextlib.suppress(Exception):
                m.cuDevicePrimaryCtxRelease(self._cu_device)
        self._context = None

    def __del__(self) -> None:
        try:  # noqa: SIM105  (not contextlib.suppress: at interpreter exit module globals may be None)
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        mode = "CUDA graph" if self.use_graph else "kernel by kernel"
        return (f"CudaRunner({len(self.plan.launches)} launches of {len(self.program.kernels)} kernels, "
                f"{self.image} for {self.arch}, {mode}, on {self.device})")


class _Timer:
    """A CUDA event on torch's current stream; on a fake device (tests), the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self.t = 0.0

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def seconds_to(self, end: _Timer) -> float:
        if self.event is None or end.event is None:
            return end.t - self.t
        end.event.synchronize()
        return self.event.elapsed_time(end.event) / 1e3


def _describe(s: LaunchSpec) -> str:
    return f"kernel {s.kernel} (launch {s.launch}, grid {s.grid}, block {s.block})"
