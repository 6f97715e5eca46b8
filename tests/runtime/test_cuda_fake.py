"""target="cuda" without a GPU: the CUDA runtime driven through a fake ``cuda.bindings.driver``.

The fake keeps the driver's semantics that matter to the runtime: kernel parameters are copied
when a launch is enqueued or a graph node is added/updated (so a forgotten update runs with stale
pointers), an instantiated graph keeps its own copy of each node, and a graph launch may run its
nodes in any order its edges allow (here a random one). Each "launch" runs the same kernels'
CPU build (the SIMT lowering cuda-sim uses) on the memory at the raw addresses it was given, so
whole runs are checked against eager PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
import random
from dataclasses import dataclass, field

import pytest
import torch

import sextant
from sextant.codegen.cpu_module import CpuModule
from sextant.codegen.llvm_cpu import compile_kernels
from sextant.codegen.llvm_nvptx import emit_ptx
from sextant.examples import EXAMPLES
from sextant.frontend.capture import capture
from sextant.graph.ir import Graph
from sextant.graph.passes import run_pipeline
from sextant.kernel.sizes import instantiate
from sextant.kernel.wgmma import kernel_tensor_maps
from sextant.runtime.compiled import CompiledModule
from sextant.runtime.cuda import CudaError, CudaRunner, CudaUnavailableError, SymbolicCudaRunner, require_cuda
from sextant.runtime.cuda_graph import ParamBlock, plan, topological_orders_ok
from sextant.runtime.tensor_maps import kernel_map_slots
from sextant.schedule.program import Program, schedule
from sextant.schedule.target import sm90_target

cuda_driver = pytest.importorskip("cuda.bindings.driver", reason="no cuda-python (pip install cuda-python)",
                                  exc_type=ImportError)
OK = cuda_driver.CUresult.CUDA_SUCCESS


@dataclass
class FakeNode:
    func: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    values: list[int]  # the parameter values, copied as the driver does
    deps: list[int] = field(default_factory=list)


class FakeDriver:
    """Records every call; runs launches and graph replays with the CPU build of the kernels."""

    CUresult = cuda_driver.CUresult
    CUDA_KERNEL_NODE_PARAMS = cuda_driver.CUDA_KERNEL_NODE_PARAMS
    CUstream = cuda_driver.CUstream
    CUfunction_attribute = cuda_driver.CUfunction_attribute
    CUtensorMapDataType = cuda_driver.CUtensorMapDataType
    cuuint64_t, cuuint32_t = cuda_driver.cuuint64_t, cuda_driver.cuuint32_t
    CUtensorMapInterleave = cuda_driver.CUtensorMapInterleave
    CUtensorMapSwizzle = cuda_driver.CUtensorMapSwizzle
    CUtensorMapL2promotion = cuda_driver.CUtensorMapL2promotion
    CUtensorMapFloatOOBfill = cuda_driver.CUtensorMapFloatOOBfill

    def __init__(self, program: Program, cpu: CpuModule, seed: int = 0, fail: dict[str, object] | None = None) -> None:
        self.program = program
        self.cpu = cpu
        self.names: dict[int, str] = {}
        self.calls: list[str] = []
        self.executed: list[tuple[str, list[int]]] = []  # (kernel, parameter values) in execution order
        self.images: list[bytes] = []
        self.rng = random.Random(seed)
        self.fail = fail or {}  # function name -> CUresult to return instead of running it
        self.ctx_stack: list[object] = [None]  # the calling thread's context stack (top: current)
        self.retained = 0  # primary-context references held through this driver
        self.shared_limits: dict[str, int] = {}  # kernel -> dynamic shared memory it was allowed
        self.maps_checked = 0  # tensor maps found matching their launch's buffers

    def _call(self, name: str) -> object | None:
        self.calls.append(name)
        return self.fail.get(name)

    def cuGetErrorName(self, err: object) -> tuple:
        return OK, err.name.encode()

    def cuInit(self, flags: int) -> tuple:
        return (self._call("cuInit") or OK,)

    def cuDeviceGet(self, ordinal: int) -> tuple:
        return self._call("cuDeviceGet") or OK, ordinal

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:
        self.retained += 1
        return self._call("cuDevicePrimaryCtxRetain") or OK, "primary-context"

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple:
        assert self.retained > 0, "primary context released more often than retained"
        self.retained -= 1
        return (self._call("cuDevicePrimaryCtxRelease") or OK,)

    def cuCtxSetCurrent(self, ctx: object) -> tuple:
        assert ctx == "primary-context"
        self.ctx_stack[-1] = ctx
        return (self._call("cuCtxSetCurrent") or OK,)

    def cuCtxPushCurrent(self, ctx: object) -> tuple:
        assert ctx == "primary-context"
        self.ctx_stack.append(ctx)
        return (self._call("cuCtxPushCurrent") or OK,)

    def cuCtxPopCurrent(self) -> tuple:
        assert len(self.ctx_stack) > 1, "cuCtxPopCurrent without a matching push"
        return self._call("cuCtxPopCurrent") or OK, self.ctx_stack.pop()

    def _current(self, name: str) -> None:
        assert self.ctx_stack[-1] == "primary-context", f"{name} called with no current context"

    def cuModuleLoadData(self, image: bytes) -> tuple:
        self._current("cuModuleLoadData")
        err = self._call("cuModuleLoadData")
        self.images.append(bytes(image))
        if isinstance(err, list):  # fail the first N loads
            return (err.pop(0), None) if err else (OK, "module")
        return err or OK, "module"

    def cuModuleGetFunction(self, module: object, name: bytes) -> tuple:
        assert isinstance(name, bytes)
        ptx = self.images[-1]
        if b".entry" in ptx and f".entry {name.decode()}(".encode() not in ptx:
            return (cuda_driver.CUresult.CUDA_ERROR_NOT_FOUND, None)
        handle = len(self.names) + 1
        self.names[handle] = name.decode()
        return self._call("cuModuleGetFunction") or OK, cuda_driver.CUfunction(handle)

    def cuLaunchKernel(self, f: object, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: object, params: int, extra: int) -> tuple:
        self._current("cuLaunchKernel")
        err = self._call("cuLaunchKernel")
        if err:
            return (err,)
        assert extra == 0 and isinstance(stream, cuda_driver.CUstream)
        assert isinstance(params, int)  # a raw void** (the bindings also take None or (values, types))
        name = self.names[int(f)]
        self._check_shared(name, shared)
        self._run(FakeNode(int(f), (gx, gy, gz), (bx, by, bz), self._read_params(name, params)))
        return (OK,)

    def cuGraphCreate(self, flags: int) -> tuple:
        self._current("cuGraphCreate")
        assert flags == 0
        return self._call("cuGraphCreate") or OK, []

    def cuGraphAddKernelNode(self, graph: list, deps: list, ndeps: int, p: object) -> tuple:
        assert ndeps == len(deps) and len(set(deps)) == len(deps)
        node = self._node(p)
        node.deps = list(deps)
        graph.append(node)
        return self._call("cuGraphAddKernelNode") or OK, len(graph) - 1

    def cuGraphInstantiate(self, graph: list, flags: int) -> tuple:  # cuda-python 12.x/13.x: (hGraph, flags)
        exec_ = [FakeNode(n.func, n.grid, n.block, list(n.values), list(n.deps)) for n in graph]
        return self._call("cuGraphInstantiate") or OK, exec_

    def cuGraphExecKernelNodeSetParams(self, exec_: list, node: int, p: object) -> tuple:
        new = self._node(p)
        new.deps = exec_[node].deps
        exec_[node] = new
        return (self._call("cuGraphExecKernelNodeSetParams") or OK,)

    def cuGraphLaunch(self, exec_: list, stream: object) -> tuple:
        self._current("cuGraphLaunch")
        assert isinstance(stream, cuda_driver.CUstream)
        err = self._call("cuGraphLaunch")
        if err:
            return (err,)
        done: set[int] = set()
        while len(done) < len(exec_):  # any order the edges allow
            ready = [i for i, n in enumerate(exec_) if i not in done and all(d in done for d in n.deps)]
            i = self.rng.choice(ready)
            self._run(exec_[i])
            done.add(i)
        return (OK,)

    def cuStreamSynchronize(self, stream: object) -> tuple:
        return (self._call("cuStreamSynchronize") or OK,)

    def cuGraphExecDestroy(self, h: object) -> tuple:
        return (OK,)

    def cuGraphDestroy(self, h: object) -> tuple:
        return (OK,)

    def cuModuleUnload(self, h: object) -> tuple:
        self._current("cuModuleUnload")
        self.calls.append("cuModuleUnload")
        return (OK,)

    def cuTensorMapEncodeTiled(self, dtype: object, rank: int, address: int, dims: list, strides: list, box: list,
                               elem_strides: list, interleave: object, swizzle: object, l2: object,
                               oob: object) -> tuple:
        """A tensor map whose 16 words are what it was built from (a real one is opaque), checked
        against the driver's documented requirements."""
        u64, u32 = cuda_driver.cuuint64_t, cuda_driver.cuuint32_t
        for xs, kind in ((dims, u64), (strides, u64), (box, u32), (elem_strides, u32)):
            assert all(isinstance(x, kind) for x in xs)  # the real bindings refuse plain ints
        dims, strides, box, elem_strides = ([int(x) for x in xs] for xs in (dims, strides, box, elem_strides))
        assert 2 <= rank <= 5 and len(dims) == len(box) == rank and len(strides) == rank - 1
        assert elem_strides == [1] * rank
        assert address % 16 == 0 and all(k % 16 == 0 for k in strides) and all(1 <= b <= 256 for b in box)
        assert oob == cuda_driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE  # zeros past the edges
        swz = {cuda_driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE: 0,
               cuda_driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B: 128}[swizzle]
        tmap = cuda_driver.CUtensorMap()
        words = [address, *dims, *strides, *box, swz]
        tmap.opaque = words + [0] * (16 - len(words))
        self.calls.append("cuTensorMapEncodeTiled")
        return OK, tmap

    def cuFuncSetAttribute(self, f: object, attr: object, value: int) -> tuple:
        assert attr == cuda_driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.shared_limits[self.names[int(f)]] = value
        return (self._call("cuFuncSetAttribute") or OK,)

    # -- helpers ---------------------------------------------------------------------------
    def _check_shared(self, name: str, shared: int) -> None:
        """A launch passes the kernel's dynamic shared memory, within what it was allowed (the
        driver's default: 48 KiB), and no more than the PTX's ``.extern .shared`` array needs."""
        from sextant.kernel.shared_memory import dynamic_shared_bytes

        assert shared == dynamic_shared_bytes(self.program.kernels[name]), (name, shared)
        assert shared <= self.shared_limits.get(name, 48 * 1024), (name, shared, self.shared_limits)
        if shared:
            assert f"{name}_dynamic_shared[]".encode() in self.images[-1]

    def _node(self, p: object) -> FakeNode:
        assert p.extra == 0 and int(p.kern) == 0 and int(p.ctx) == 0
        name = self.names[int(p.func)]
        self._check_shared(name, p.sharedMemBytes)
        return FakeNode(int(p.func), (p.gridDimX, p.gridDimY, p.gridDimZ), (p.blockDimX, p.blockDimY, p.blockDimZ),
                        self._read_params(name, p.kernelParams))

    def _read_params(self, name: str, address: int) -> list[int]:
        """Buffers' addresses, then the sizes (copied, as the driver does); the tensor maps after them
        are checked to describe the buffers they are bound to, at this launch's addresses."""
        kernel = self.program.kernels[name]
        n = len(kernel.params) + len(kernel.sizes)  # buffers' addresses, then the sizes
        maps = kernel_map_slots(kernel)
        slots = (ctypes.c_void_p * (n + len(maps))).from_address(address)
        values = [ctypes.c_void_p.from_address(slots[k]).value or 0 for k in range(n)]
        for slot in maps:
            words = list((ctypes.c_uint64 * 16).from_address(slots[n + slot.index]))
            spec, size = slot.spec, slot.dtype.itemsize
            (rows, cols), (br, bc), outer = spec.shape, spec.box, spec.outer_dims[::-1]
            expect = [values[slot.param], cols, rows, *(n for n, _ in outer), spec.stride * size,
                      *(k * size for _, k in outer), bc, br, *[1] * len(outer), spec.swizzle]
            assert words[:len(expect)] == expect, (name, slot, words[:len(expect)])
            self.maps_checked += 1
        return values

    def _run(self, node: FakeNode) -> None:
        name = self.names[node.func]
        kernel = self.program.kernels[name]
        # a kernel over symbolic sizes: its i32 size parameters follow the buffers; the launch's grid
        # is the kernel's grid at those sizes
        sizes = {z.name: int(v) & 0xFFFFFFFF for z, v in zip(kernel.sizes, node.values[len(kernel.params):])}
        shape = instantiate(kernel, sizes) if sizes else kernel
        assert node.grid == shape.grid and node.block == kernel.block, f"{name}: launched with the wrong shape"
        tensors = []
        for p, address in zip(shape.params, node.values):
            nbytes = p.size * p.dtype.itemsize
            assert address and address % 16 == 0, f"{name}: parameter {p.name} at {address:#x}"
            raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(address)
            tensors.append(torch.frombuffer(raw, dtype=torch.uint8)[:nbytes].view(p.dtype.torch))
        if sizes:
            self.cpu.launch(name, tensors, shape.num_blocks, sizes=sizes)
        else:
            self.cpu.launch(name, tensors)
        self.executed.append((name, list(node.values)))


@functools.cache
def _compiled(name: str) -> tuple[torch.nn.Module, tuple, Graph, Program, str, CpuModule]:
    """An example's GPU program, its PTX and the CPU build of its kernels (compiled once per module)."""
    model, args = EXAMPLES[name]()
    graph = run_pipeline(capture(model, args))
    program = schedule(graph, sm90_target())
    kernels = list(program.kernels.values())
    return model, args, graph, program, emit_ptx(kernels, arch="sm_90").ptx, compile_kernels(kernels)


def _build(name: str, fail: dict[str, object] | None = None, **kwargs: object
           ) -> tuple[torch.nn.Module, tuple, CompiledModule, CudaRunner, FakeDriver]:
    model, args, graph, program, ptx, cpu = _compiled(name)
    fake = FakeDriver(program, cpu, fail=fail)
    runner = CudaRunner(program, ptx=ptx, arch="sm_90", device="cpu", driver=fake, **kwargs)
    return model, args, CompiledModule(graph, "cuda", runner, device="cpu"), runner, fake


@pytest.mark.parametrize("use_graph", [True, False])
@pytest.mark.parametrize("name", ["mlp", "transformer-block"])
def test_fake_gpu_run_matches_eager_across_calls(name: str, use_graph: bool) -> None:
    model, args, compiled, runner, fake = _build(name, use_graph=use_graph)
    assert fake.images and fake.images[0].endswith(b"\0") and b".entry" in fake.images[0]  # NUL-terminated PTX
    kept = []
    for _ in range(3):  # fresh tensors each call: the graph's input/output nodes must be updated
        fresh = tuple(torch.randn_like(a) for a in args)
        with torch.no_grad():
            expected = model(*fresh)
        got = compiled(*fresh)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5)
        kept.append((fresh, got))
    n = len(runner.plan.launches)
    if use_graph:
        assert runner.stats["graph_builds"] == 1 and fake.calls.count("cuGraphLaunch") == 3
        assert fake.calls.count("cuLaunchKernel") == 0 and fake.calls.count("cuGraphAddKernelNode") == n
    else:
        assert fake.calls.count("cuLaunchKernel") == 3 * n and "cuGraphCreate" not in fake.calls


def test_graph_updates_only_nodes_taking_new_tensors() -> None:
    model, args, compiled, runner, _ = _build("transformer-block")
    x = torch.randn_like(args[0])
    first = compiled(x)
    assert runner.stats["node_updates"] == 0
    second = compiled(x)  # same input; a new output tensor (the first is still alive)
    out_buffers = [b.index for b in runner.program.buffers if b.kind == "output"]
    in_buffers = [b.index for b in runner.program.buffers if b.kind == "input"]
    touched_out = runner.plan.affected(out_buffers)
    assert runner.stats["node_updates"] == len(touched_out) < len(runner.plan.launches)
    y = torch.randn_like(x)
    third = compiled(y)
    assert runner.stats["node_updates"] == len(touched_out) + len(runner.plan.affected(out_buffers + in_buffers))
    with torch.no_grad():
        torch.testing.assert_close(first, second)
        torch.testing.assert_close(third, model(y), rtol=1e-4, atol=2e-5)


def test_inputs_are_used_in_place_and_misaligned_views_copied() -> None:
    model, args, compiled, runner, fake = _build("mlp", use_graph=False)
    x = torch.randn_like(args[0])
    compiled(x)
    first_kernel_args = fake.executed[0][1]
    assert x.data_ptr() in first_kernel_args  # zero copy: the kernel read the caller's memory
    big = torch.randn(x.numel() + 1)
    view = big[1:].view(x.shape)  # contiguous but 4 bytes off alignment
    assert view.data_ptr() % 16
    with torch.no_grad():
        torch.testing.assert_close(compiled(view), model(view), rtol=1e-4, atol=2e-5)
    assert view.data_ptr() not in fake.executed[-len(runner.plan.launches)][1]


def test_launch_dag_respects_every_hazard() -> None:
    _, _, _, runner, _ = _build("transformer-block")
    program, p = runner.program, runner.plan
    reach = [0] * len(p.launches)  # bitset of ancestors through the reduced edges
    for i, deps in enumerate(p.deps):
        for j in deps:
            reach[i] |= reach[j] | 1 << j
    from sextant.runtime.cuda_graph import _overlap

    for i, a in enumerate(p.launches):
        for j in range(i):
            b = p.launches[j]
            hazard = _overlap(program, b.writes, a.reads | a.writes) or _overlap(program, b.reads, a.writes)
            if hazard:
                assert reach[i] >> j & 1, f"launch {i} may run before launch {j}"
    assert topological_orders_ok(list(range(len(p.launches))), p.deps)
    assert not topological_orders_ok(list(reversed(range(len(p.launches)))), p.deps)
    assert all(len(set(d)) == len(d) for d in p.deps)


def test_plan_rejects_a_mismatched_launch() -> None:
    import dataclasses

    _, _, _, runner, _ = _build("mlp")
    program = runner.program
    bad = dataclasses.replace(program.launches[0], args=program.launches[0].args[:-1])
    broken = dataclasses.replace(program, launches=[bad, *program.launches[1:]])
    with pytest.raises(ValueError, match=r"launch 0 .* passes"):
        plan(broken)


def test_graph_after_launch_by_launch_calls_updates_its_own_nodes() -> None:
    """Calls with use_graph=False rebind the parameter blocks, not the instantiated graph: going
    back to the graph must still update the nodes that hold the previous graph call's tensors."""
    model, args, compiled, runner, _ = _build("mlp")
    x, y = torch.randn_like(args[0]), torch.randn_like(args[0])
    compiled(x)
    runner.use_graph = False
    compiled(y)
    runner.use_graph = True
    with torch.no_grad():
        torch.testing.assert_close(compiled(y), model(y), rtol=1e-4, atol=2e-5)


def test_close_releases_the_context_and_leaves_the_thread_as_it_was() -> None:
    _, args, compiled, runner, fake = _build("mlp")
    compiled(torch.randn_like(args[0]))
    fake.ctx_stack = [None]  # as on another thread (a finaliser, say): no context current
    runner.close()
    assert fake.ctx_stack == [None] and fake.retained == 0
    assert fake.calls[-2:] == ["cuCtxPopCurrent", "cuDevicePrimaryCtxRelease"] and "cuModuleUnload" in fake.calls
    runner.close()  # idempotent
    assert fake.retained == 0
    with pytest.raises(CudaError, match="closed"):
        runner([torch.randn_like(args[0])])


def test_driver_errors_name_the_cuda_error_and_the_kernel() -> None:
    oor = cuda_driver.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    _, args, _, runner, _ = _build("mlp", fail={"cuLaunchKernel": oor}, use_graph=False)
    first = runner.program.launches[0].kernel
    with pytest.raises(CudaError, match=rf"cuLaunchKernel failed with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES .*{first}"):
        runner([torch.randn_like(args[0])])


def test_cubin_rejected_by_the_driver_falls_back_to_ptx() -> None:
    program, cpu = _compiled("mlp")[3], _compiled("mlp")[5]
    fake = FakeDriver(program, cpu, fail={"cuModuleLoadData": [cuda_driver.CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU]})
    runner = CudaRunner(program, ptx="// the ptx", cubin=b"\x7fELF", arch="sm_90", device="cpu", driver=fake)
    assert runner.image == "ptx" and "CUDA_ERROR_NO_BINARY_FOR_GPU" in (runner.cubin_error or "")
    assert fake.images == [b"\x7fELF", b"// the ptx\0"]


def test_param_block_is_a_void_pointer_array() -> None:
    block = ParamBlock([0x1000, 0x2000])
    slots = (ctypes.c_void_p * 2).from_address(block.address)
    assert [ctypes.c_void_p.from_address(s).value for s in slots] == [0x1000, 0x2000]
    block.set(1, 0x3000)
    assert ctypes.c_void_p.from_address(slots[1]).value == 0x3000 and block.get(1) == 0x3000
    assert ParamBlock([]).address == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_target_without_gpu_says_what_is_missing() -> None:
    with pytest.raises(CudaUnavailableError, match=r"torch.cuda.is_available\(\) is False.*cuda-sim"):
        require_cuda()
    with pytest.raises(CudaUnavailableError, match="cuda-sim"):
        sextant.compile(torch.nn.ReLU(), (torch.randn(3),), target="cuda")


@pytest.mark.parametrize("use_graph", [True, False])
def test_kernels_past_48_kib_get_dynamic_shared_memory(use_graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor-core GEMM with four 19 KiB stages: its shared buffers become slices of one dynamic
    array; the runner allows the kernel that size (cuFuncSetAttribute) and launches with it."""
    import sextant.schedule.gpu_mma as gpu_mma
    from sextant.kernel.shared_memory import dynamic_shared_bytes

    tile = gpu_mma.TcTile(128, 128, 32, 2, 4, registers=128, stages=4)
    monkeypatch.setattr(gpu_mma, "choose_tile", lambda m, n, batch, target, *a, **k: tile)
    torch.manual_seed(0)
    model, x = torch.nn.Linear(96, 136).half(), torch.randn(2, 140, 96).half()
    program = schedule(run_pipeline(capture(model, (x,))), sm90_target())
    kernels = list(program.kernels.values())
    big = [k.name for k in kernels if dynamic_shared_bytes(k)]
    assert big and all(dynamic_shared_bytes(program.kernels[n]) > 48 * 1024 for n in big)
    fake = FakeDriver(program, compile_kernels(kernels))
    runner = CudaRunner(program, ptx=emit_ptx(kernels, arch="sm_90").ptx, arch="sm_90", device="cpu", driver=fake,
                        use_graph=use_graph)
    assert set(fake.shared_limits) == set(big)
    compiled = CompiledModule(run_pipeline(capture(model, (x,))), "cuda", runner, device="cpu")
    for _ in range(2):
        fresh = torch.randn_like(x)
        expected = fresh.float() @ model.weight.float().T + model.bias.float()  # f32 reference
        torch.testing.assert_close(compiled(fresh).float(), expected, rtol=2e-2, atol=2e-2)


def test_profile_times_each_launch_and_leaves_calls_correct() -> None:
    """``CudaRunner.profile``: one forward, then each launch ``repeats`` times back to back; one time
    per launch, and the module still computes the right answer afterwards (buffers rebound)."""
    model, args, compiled, runner, fake = _build("transformer-block", use_graph=False)
    n = len(runner.plan.launches)
    times = runner.profile(list(args), repeats=3)
    assert len(times) == n and all(t >= 0 for t in times)
    assert fake.calls.count("cuLaunchKernel") == n + 3 * n
    x = torch.randn_like(args[0])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("use_graph", [True, False])
def test_symbolic_sizes_one_module_every_binding(use_graph: bool) -> None:
    """A program over symbolic sizes on target="cuda": the module is loaded and the weights uploaded
    once; each binding gets its runner (grids, arena plan and the i32 size parameters after the
    buffers' addresses, a CUDA graph of its own), and every size matches eager."""
    from torch.export import Dim

    model, (example,) = EXAMPLES["transformer-block"]()
    dims = {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=64)}
    graph = run_pipeline(capture(model, (example,), dynamic_shapes={"x": dims}))
    program = schedule(graph, sm90_target())
    assert program.symbols and any(k.sizes for k in program.kernels.values())
    kernels = list(program.kernels.values())
    fake = FakeDriver(program, compile_kernels(kernels))
    runner = SymbolicCudaRunner(program, ptx=emit_ptx(kernels, arch="sm_90").ptx, arch="sm_90", device="cpu",
                                driver=fake, use_graph=use_graph)
    compiled = CompiledModule(graph, "cuda", runner, device="cpu")
    with torch.no_grad():
        for batch, seq in [(1, 1), (3, 17), (4, 64), (3, 17)]:
            x = torch.randn(batch, seq, example.shape[-1])
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert fake.calls.count("cuModuleLoadData") == 1
    owner = runner._owner
    assert len(runner._runners) == 3 and all(r.constants is owner.constants for r in runner._runners.values())
    some = next(k for k in program.kernels.values() if k.sizes)
    last = [values for name, values in fake.executed if name == some.name][-1]
    assert last[len(some.params):] == [{"batch": 3, "seq": 17}[z.name] for z in some.sizes]
    runner.close()
    assert fake.retained == 0


class _Router(torch.nn.Module):
    """A Linear, then cummax and cummin (extern calls on the host, between kernels), then kernels again."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).softmax(-1)
        peak = torch.cummax(logits, dim=-1).values  # no lowering: extern calls
        low = torch.cummin(logits.t(), dim=-1)
        return peak.sum(-1) * 3 + low.values[:, 0].sum() + low.indices.float().mean()


@pytest.mark.parametrize("use_graph", [True, False])
def test_extern_calls_run_between_kernels_on_the_gpu_path(use_graph: bool) -> None:
    """target="cuda" with extern calls: each call on torch's stream with the arena's temporaries as
    tensors, between kernel launches — or, with graphs, between the CUDA graphs of the kernel runs
    around it (one graph per run, built once, its nodes updated per call)."""
    model = _Router().eval()
    x = torch.randn(12, 16)
    program = schedule(run_pipeline(capture(model, (x,))), sm90_target())
    order = ["extern" if la.extern is not None else "kernel" for la in program.launches]
    assert order.count("extern") == 2
    runs = sum(1 for i, k in enumerate(order) if k == "kernel" and (i == 0 or order[i - 1] == "extern"))
    kernels = list(program.kernels.values())
    fake = FakeDriver(program, compile_kernels(kernels))
    runner = CudaRunner(program, ptx=emit_ptx(kernels, arch="sm_90").ptx, arch="sm_90", device="cpu", driver=fake,
                        use_graph=use_graph)
    assert runner.externs == 2
    compiled = CompiledModule(program.graph, "cuda", runner, device="cpu")
    for _ in range(3):
        x = torch.randn(12, 16)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    kernel_launches = order.count("kernel")
    if use_graph:
        assert runner.stats["graph_builds"] == 1 and fake.calls.count("cuGraphCreate") == runs
        assert fake.calls.count("cuGraphLaunch") == 3 * runs and fake.calls.count("cuLaunchKernel") == 0
    else:
        assert "cuGraphCreate" not in fake.calls and fake.calls.count("cuLaunchKernel") == 3 * kernel_launches
    assert len(runner.profile([x], repeats=2)) == len(program.launches)


class _ParallelHalves(torch.nn.Module):
    """Two matmuls, each ending in an all_reduce; the second's kernels can run while the first is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        y = funcol.all_reduce(self.a(x).relu(), "sum", dist.group.WORLD)
        z = funcol.all_reduce(self.b(x).tanh(), "sum", dist.group.WORLD)
        return y * z


@pytest.mark.parametrize("use_graph", [True, False])
def test_collectives_run_between_kernels_on_the_gpu_path(use_graph: bool, tmp_path) -> None:
    """target="cuda" with collectives (a world of one, gloo over the fake driver's host tensors): the
    starts and waits are host calls between the kernel runs, with or without CUDA graphs, and the
    profile issues each transfer once."""
    import torch.distributed as dist

    from sextant.schedule.program import CollectiveCall

    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _ParallelHalves().eval()
        x = torch.randn(12, 16)
        program = schedule(run_pipeline(capture(model, (x,))), sm90_target())
        stages = [la.extern.stage for la in program.launches if isinstance(la.extern, CollectiveCall)]
        assert stages == ["start", "start", "wait", "wait"]  # the second matmul overlaps the first transfer
        kernels = list(program.kernels.values())
        fake = FakeDriver(program, compile_kernels(kernels))
        runner = CudaRunner(program, ptx=emit_ptx(kernels, arch="sm_90").ptx, arch="sm_90", device="cpu",
                            driver=fake, use_graph=use_graph)
        compiled = CompiledModule(program.graph, "cuda", runner, device="cpu")
        for _ in range(3):
            x = torch.randn(12, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert len(runner.profile([x], repeats=2)) == len(program.launches)
        runner.close()
    finally:
        dist.destroy_process_group()


class _KVCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)
        self.register_buffer("k", torch.zeros(1, 2, 16, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k[:, :, pos] = self.proj(x).view(1, -1, 2, 8).transpose(1, 2)
        return self.k.sum(2)


@pytest.mark.parametrize("use_graph", [True, False])
def test_buffer_updates_write_in_place_through_cuda_graphs(use_graph: bool) -> None:
    """target="cuda" with a KV-cache-style buffer: the CUDA graph's scatter writes the new rows into
    the module's buffer itself (its address rebound per call like any input): no write-back copy."""
    torch.manual_seed(0)
    model, eager = _KVCache().eval(), _KVCache().eval()
    eager.load_state_dict(model.state_dict())
    graph = run_pipeline(capture(model, (torch.randn(1, 1, 8), torch.tensor([0]))))
    program = schedule(graph, sm90_target())
    kernels = list(program.kernels.values())
    runner = CudaRunner(program, ptx=emit_ptx(kernels, arch="sm_90").ptx, arch="sm_90", device="cpu",
                        driver=FakeDriver(program, compile_kernels(kernels)), use_graph=use_graph)
    compiled = CompiledModule(graph, "cuda", runner, device="cpu")
    compiled.bind_state([model.k])
    for step in range(4):
        x, pos = torch.randn(1, 1, 8), torch.tensor([step * 3])
        torch.testing.assert_close(compiled(x, pos), eager(x, pos))
        torch.testing.assert_close(model.k, eager.k)
    assert compiled.full_write_backs == 0


@pytest.mark.parametrize("use_graph", [True, False])
def test_tma_kernels_get_tensor_maps_of_each_calls_buffers(use_graph: bool) -> None:
    """An sm_90a program's wgmma GEMMs take tensor maps: encoded for the weights once, re-encoded when
    a call brings new input tensors (and the graph node updated with them); results match eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).half()
    x = torch.randn(96, 64).half()
    graph = run_pipeline(capture(model, (x,)))
    from sextant.schedule.target import gpu_target

    program = schedule(graph, gpu_target("sm_90a"))
    kernels = list(program.kernels.values())
    assert sum(k.meta.get("mapping") == "wgmma-tma" for k in kernels) == 2
    fake = FakeDriver(program, compile_kernels(kernels))
    runner = CudaRunner(program, ptx=emit_ptx(kernels, arch="sm_90a").ptx, arch="sm_90a", device="cpu",
                        driver=fake, use_graph=use_graph)
    compiled = CompiledModule(graph, "cuda", runner, device="cpu")
    for _ in range(3):
        fresh = torch.randn(96, 64).half()
        with torch.no_grad():
            expected = model.float()(fresh.float())
        torch.testing.assert_close(compiled(fresh).float(), expected, atol=3e-2, rtol=3e-2)
    assert fake.maps_checked >= 2 * 2 * (1 if use_graph else 3)  # two maps per GEMM, each launch or node
    assert fake.calls.count("cuTensorMapEncodeTiled") >= 4 + 2  # the weights' once, the inputs' per new tensor


def test_tma_attention_maps_have_outer_dims() -> None:
    """The sm_90a attention reads Q/K/V slices of one projection through 4-D tensor maps (batch
    and head outer, the slice's offset as a head shift): the fake driver checks each map's words
    against the kernel's spec at the launch's addresses, and the result matches eager."""
    torch.manual_seed(0)

    class Qkv(torch.nn.Module):
        def forward(self, qkv: torch.Tensor) -> torch.Tensor:
            b, n, _ = qkv.shape
            q, k, v = (t.view(b, n, 2, 64).transpose(1, 2) for t in qkv.split(128, dim=2))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    x = torch.randn(2, 80, 384).half()
    graph = run_pipeline(capture(Qkv(), (x,)))
    from sextant.schedule.target import gpu_target

    program = schedule(graph, gpu_target("sm_90a"))
    kernels = list(program.kernels.values())
    (att,) = [k for k in kernels if k.meta.get("mapping") == "flash-attention-wgmma-tma"]
    assert {len(m.outer_dims) for m in kernel_tensor_maps(att.body)} == {2}
    fake = FakeDriver(program, compile_kernels(kernels))
    runner = CudaRunner(program, ptx=emit_ptx(kernels, arch="sm_90a").ptx, arch="sm_90a", device="cpu", driver=fake)
    compiled = CompiledModule(graph, "cuda", runner, device="cpu")
    fresh = torch.randn(2, 80, 384).half()
    torch.testing.assert_close(compiled(fresh).float(), Qkv()(fresh.float()), atol=2e-2, rtol=2e-2)
    assert fake.maps_checked >= 3
