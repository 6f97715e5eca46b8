"""Ahead-of-time artifacts: ``CompiledModule.save(dir)`` and ``sextant.load(dir)``.

A saved directory holds everything needed to run the compiled program again without the
model's Python code, torch.export or the scheduler::

    manifest.json        format + version, target, arch, input/output specs, buffers,
                         launches, kernels, arena size, and a sha256 of every other file
    graph.sxt            the optimised graph IR, as text (its own round-tripping parser reads it)
    kernels.json         the kernel IR (sextant/kernel/serialize.py)
    kernels.ptx          GPU targets: the PTX of every kernel
    kernels.cubin        GPU targets, when ptxas was available: the assembled SASS
    weights.safetensors  the graph's parameters, by name

Why this shape:

* **No pickle anywhere.** Loading a pickle runs arbitrary code; an artifact is data. Weights go
  to safetensors (a header plus raw bytes), everything else is JSON or text. Tied weights
  (GPT-2's embedding and LM head) are stored once and named twice in the manifest.
* **The kernel IR is kept, not only PTX.** Without a GPU the loader compiles the same kernels
  through the CPU lowering (``cuda-sim``), so an artifact built for sm_90 runs — bit for bit as
  the original ``cuda-sim`` module did — on any machine, and tests need no GPU.
* **The manifest is the whole launch contract** (buffers with shape, dtype and arena offset;
  launches with kernel, buffer arguments, grid and block), so a loader in another language
  could run ``kernels.cubin`` from it alone. Buffers name their graph node by its SSA name in
  ``graph.sxt`` (``%12``), which is how the loader rebuilds a real :class:`Program`.
* **Each weight is stored once.** A buffer the scheduler prepacked (a Linear layer's
  ``permute(W)`` laid out row-major) is marked ``"weight": "derived"`` and rebuilt at load time
  from its parameter by the same data movement — bit for bit the bytes the kernels read —
  instead of doubling the file. Any other constant buffer would be stored as ``buffer.<index>``.
* **Everything is checked before anything runs**: a file's checksum, the format version, every
  name the manifest refers to, every weight's shape and dtype, each launch's buffers against
  its kernel's parameters, and the PTX architecture against the GPU. A mismatch raises
  :class:`~sextant.errors.ArtifactError` naming the file and the thing that differs.
* ``manifest.json`` is written last, so an interrupted save leaves a directory that ``load``
  rejects rather than one that half works.

Running a loaded GPU artifact: on a machine with a CUDA GPU through ``sextant.runtime.cuda``
(imported lazily: its ``load_runner(program, ptx, cubin, arch)`` loads the cubin on a GPU of
exactly that architecture, else has the driver JIT the PTX), otherwise through the cuda-sim
path. ``loaded.target`` says which; so does a log line. A loaded module can be saved again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from sextant.errors import ArtifactError
from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, InputLeaf, Node
from sextant.graph.parser import ParseError, parse_graph
from sextant.graph.printer import input_names, print_graph
from sextant.graph.reference import eval_node
from sextant.kernel.ir import Kernel
from sextant.kernel.serialize import KernelSerializeError, kernels_from_json, kernels_to_json
from sextant.kernel.verifier import KernelVerificationError, verify_kernel
from sextant.runtime.compiled import CompiledModule
from sextant.schedule.program import BufferInfo, CollectiveCall, ExternCall, Launch, Program
from sextant.schedule.target import TargetDesc

log = logging.getLogger("sextant.artifact")

FORMAT = "sextant-artifact"
VERSION = 1
MANIFEST = "manifest.json"
GRAPH_FILE = "graph.sxt"
KERNELS_FILE = "kernels.json"
PTX_FILE = "kernels.ptx"
CUBIN_FILE = "kernels.cubin"
WEIGHTS_FILE = "weights.safetensors"
_OUR_FILES = (MANIFEST, GRAPH_FILE, KERNELS_FILE, PTX_FILE, CUBIN_FILE, WEIGHTS_FILE)
SAVABLE_TARGETS = ("cpu", "cuda-sim", "cuda")
GPU_TARGETS = ("cuda-sim", "cuda")
_BUFFER_KINDS = ("input", "param", "temp", "output")
_MOVEMENT = ("reshape", "permute", "expand", "slice")
DERIVED = "derived"  # a buffer's "weight" when it is a re-laid-out parameter, rebuilt at load time
_LEAF_TYPES = {"none": type(None), "bool": bool, "int": int, "float": float, "str": str}


def _sextant_version() -> str:
    try:
        from importlib.metadata import version

        return version("sextant")
    except Exception:  # running from a source tree that was never installed
        return "unknown"


def _node_names(graph: Graph) -> dict[int, str]:
    """SSA name of each node as ``print_graph`` writes it (``%x`` for inputs, ``%0``.. for the rest)."""
    names = {id(n): "%" + name for n, name in zip(graph.inputs, input_names(graph))}
    counter = 0
    for n in graph.nodes:
        if n.op != "input":
            names[id(n)] = f"%{counter}"
            counter += 1
    return names


def _dumps(obj: Any, width: int = 160) -> str:
    """Indented JSON with short lists and flat objects on one line, so a person can read it.

    Only whitespace around line breaks is touched, and a JSON string never holds a raw line
    break, so string contents (even ones with brackets) cannot change; checked anyway."""
    def collapse(m: re.Match) -> str:
        inner = re.sub(r"\s*\n\s*", " ", re.sub(r"^\s*\n\s*|\s*\n\s*$", "", m[2]))
        one = m[1] + inner + m[3]
        return one if len(one) <= width else m[0]

    text = json.dumps(obj, indent=1, allow_nan=False)
    text = re.sub(r"(\[)([^\[\]{}]*)(\])", collapse, text)
    text = re.sub(r"(\{)([^{}]*)(\})", collapse, text) + "\n"
    if json.loads(text) != json.loads(json.dumps(obj)):
        raise AssertionError("compact JSON formatting changed the document")  # a bug here, not in the input
    return text


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _arch_number(arch: str) -> int:
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if not m:
        raise ArtifactError(f"unrecognised GPU architecture {arch!r} (expected e.g. 'sm_90')")
    return int(m[1])


# -- save -------------------------------------------------------------------------------------------
def save(compiled: CompiledModule, path: str | Path) -> Path:
    """Write ``compiled`` (targets cpu, cuda-sim, cuda) to the directory ``path``; returns it."""
    if compiled.target not in SAVABLE_TARGETS:
        raise ArtifactError(f"cannot save a module compiled for target {compiled.target!r}: artifacts are written "
                            f"for targets {', '.join(SAVABLE_TARGETS)} (they hold kernels; "
                            f"{compiled.target!r} has none)")
    program: Program | None = compiled.stages.get("program")
    if program is None:
        raise ArtifactError("this CompiledModule has no 'program' stage, so there are no kernels to save")
    gpu = compiled.target in GPU_TARGETS
    ptx_text, arch, cubin = None, None, None
    if gpu:
        ptx_text, arch, cubin = _gpu_code(compiled)
    # the schedule's graph: on the CPU it adds nodes (explicit conv padding, conv weight layouts)
    # that buffers refer to
    graph = program.graph
    names = _node_names(graph)
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"cannot save to {out}: it exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    for name in _OUR_FILES:  # a previous save's files must not survive into this one
        (out / name).unlink(missing_ok=True)

    files: dict[str, bytes] = {GRAPH_FILE: (print_graph(graph) + "\n").encode()}
    files[KERNELS_FILE] = _dumps(kernels_to_json(program.kernels.values())).encode()
    if ptx_text is not None:
        files[PTX_FILE] = ptx_text.encode()
    if cubin is not None:
        files[CUBIN_FILE] = cubin
    tensors, param_keys, buffer_keys = _weights(graph, program)
    files[WEIGHTS_FILE] = _safetensors_bytes(tensors)
    for name, data in files.items():
        (out / name).write_bytes(data)

    resources = _ptxas_resources(compiled)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "sextant_version": _sextant_version(),
        "target": compiled.target,
        "arch": arch,
        "schedule_target": dataclasses.asdict(program.target),
        "graph": {"name": graph.name, "file": GRAPH_FILE},
        "inputs": [{"name": names[id(n)], "shape": list(n.shape), "dtype": n.dtype.value} for n in graph.inputs],
        "in_spec": _spec_json(graph.in_spec, "input"),
        "out_spec": _spec_json(graph.out_spec, "output"),
        "leaves": [_leaf_json(leaf) for leaf in graph.leaves],
        "params": param_keys,
        "buffers": [_buffer_json(b, names, buffer_keys.get(b.index)) for b in program.buffers],
        "kernels": [_kernel_summary(k, resources.get(k.name)) for k in program.kernels.values()],
        "launches": [_launch_json(la, program) for la in program.launches],
        "outputs": [{"buffer": b, "shape": list(program.buffers[b].node.shape),
                     "dtype": program.buffers[b].node.dtype.value} for b in program.outputs],
        "arena_bytes": program.arena_bytes,
        "notes": list(program.notes),
        "rewrites": list(program.rewrites),
        "files": {name: {"sha256": _sha256(data), "bytes": len(data)} for name, data in files.items()},
    }
    (out / MANIFEST).write_text(_dumps(manifest))
    return out


def _gpu_code(compiled: CompiledModule) -> tuple[str, str, bytes | None]:
    ptx = compiled.stages.get("ptx")
    if ptx is None:
        raise ArtifactError(f"this {compiled.target!r} module has no 'ptx' stage to save")
    text = ptx if isinstance(ptx, str) else ptx.ptx
    arch = getattr(ptx, "arch", None) or _ptx_target(text)
    assembled = compiled.stages.get("ptxas")
    if assembled is not None and getattr(assembled, "arch", arch) == arch:
        return text, arch, assembled.cubin
    if isinstance(compiled.stages.get("cubin"), bytes):  # a module loaded from an artifact
        return text, arch, compiled.stages["cubin"]
    from sextant.codegen.ptxas import PtxasError, assemble

    try:
        return text, arch, assemble(text, arch).cubin
    except PtxasError as e:  # no ptxas here: PTX alone is still a complete artifact (the driver JITs it)
        log.info("saving without a cubin: %s", str(e).splitlines()[0])
        return text, arch, None


def _ptxas_resources(compiled: CompiledModule) -> dict[str, dict[str, Any]]:
    """ptxas's per-kernel report: from this compilation, or kept from the artifact it was loaded from."""
    assembled = compiled.stages.get("ptxas")
    if assembled is not None:
        return {name: dataclasses.asdict(r) for name, r in assembled.kernels.items()}
    loaded = compiled.stages.get("manifest") or {}
    return {k["name"]: k["ptxas"] for k in loaded.get("kernels", []) if "ptxas" in k}


def _ptx_target(ptx: str) -> str:
    m = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    if not m:
        raise ArtifactError(f"{PTX_FILE} has no '.target sm_XX' line")
    return m[1]


def _spec_json(spec: Any, what: str) -> Any:
    if spec is None:
        return None
    try:
        return json.loads(pytree.treespec_dumps(spec))
    except Exception as e:
        raise ArtifactError(f"the module's {what} structure {spec} cannot be saved: torch's pytree serializer "
                            f"refused it ({e})") from e


def _leaf_json(leaf: InputLeaf) -> dict[str, Any]:
    if leaf.input_index is not None:
        return {"name": leaf.name, "input": leaf.input_index}
    kind = next((k for k, t in _LEAF_TYPES.items() if type(leaf.value) is t), None)
    if kind is None or (kind == "float" and leaf.value != leaf.value):
        raise ArtifactError(f"argument {leaf.name!r} was baked into the graph as {leaf.value!r}, a "
                            f"{type(leaf.value).__name__}; artifacts can hold None, bool, int, float and str")
    return {"name": leaf.name, "input": None, "type": kind, "value": leaf.value}


def _buffer_json(b: BufferInfo, names: dict[int, str], weight: str | None) -> dict[str, Any]:
    return {"index": b.index, "kind": b.kind, "node": names[id(b.node)], "shape": list(b.node.shape),
            "dtype": b.node.dtype.value, "nbytes": b.nbytes, "offset": b.offset if b.kind == "temp" else None,
            "weight": weight}


def _kernel_summary(k: Kernel, res: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": k.name, "grid": list(k.grid), "block": list(k.block),
                           "params": [{"name": p.name, "dtype": p.dtype.value, "size": p.size, "role": p.role}
                                      for p in k.params],
                           "shared_bytes": sum(s.size * s.dtype.itemsize for s in k.shared)}
    if res is not None:
        out["ptxas"] = res
    return out


def _weights(graph: Graph, program: Program) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[int, str]]:
    """safetensors entries plus the manifest's maps param name → key and constant buffer → key.

    A tensor seen before (the same view of the same storage: tied weights) reuses its key;
    a different view of shared storage is copied, since safetensors stores each tensor whole."""
    tensors: dict[str, torch.Tensor] = {}
    by_view: dict[tuple, str] = {}
    storages: set[int] = set()

    def add(key: str, t: torch.Tensor) -> str:
        t = t.detach().cpu()
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in by_view:
            return by_view[view]
        ptr = view[0]
        t = t.contiguous().clone() if ptr in storages or not t.is_contiguous() else t
        storages.add(ptr)
        by_view[view] = key
        tensors[key] = t
        return key

    used = {n.attr("name") for n in graph.nodes if n.op == "param"}
    param_keys = {name: add(f"param.{name}", graph.params[name]) for name in sorted(used)}
    buffer_keys: dict[int, str] = {}
    for bi, t in sorted(program.constants.items()):
        node = program.buffers[bi].node
        if node.op == "param" and graph.params.get(node.attr("name")) is t:
            buffer_keys[bi] = param_keys[node.attr("name")]
        elif _is_movement_of_param(node) and torch.equal(_derive(node, graph), t):
            buffer_keys[bi] = DERIVED
        else:
            buffer_keys[bi] = add(f"buffer.{bi}", t)
    return tensors, param_keys, buffer_keys


def _is_movement_of_param(n: Node) -> bool:
    while n.op in _MOVEMENT:
        n = n.inputs[0]
    return n.op == "param"


def _derive(n: Node, graph: Graph) -> torch.Tensor:
    """A prepacked weight rebuilt from its parameter: pure data movement, so bit for bit the same.
    The chain of movement ops is applied bottom up in a loop (no recursion per op)."""
    chain = []
    while n.op != "param":
        chain.append(n)
        n = n.inputs[0]
    value = graph.params[n.attr("name")]
    with torch.no_grad():
        for m in reversed(chain):
            value = eval_node(m, [value], graph).contiguous()
    return value


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    st = _safetensors()
    return st.save(tensors, metadata={"format": FORMAT})


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:
        raise ArtifactError("saving and loading artifacts needs the `safetensors` package "
                            "(pip install safetensors)") from e
    return safetensors.torch


# -- load -------------------------------------------------------------------------------------------
def load(path: str | Path, *, target: str | None = None) -> CompiledModule:
    """Load a directory written by :meth:`CompiledModule.save` and return a module that runs it.

    ``target=None`` picks the best available: a GPU artifact runs on the GPU (``"cuda"``) when
    one is present and ``sextant.runtime.cuda`` can load it, else through ``"cuda-sim"``; a CPU
    artifact runs on ``"cpu"``. Raises :class:`ArtifactError` if anything does not match.
    """
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"cannot load {root}: no such directory" if not root.exists()
                            else f"cannot load {root}: not a directory")
    manifest = _read_manifest(root)
    files = _verified_files(root, manifest)
    saved_target = manifest.get("target")
    if saved_target not in SAVABLE_TARGETS:
        raise ArtifactError(f"{MANIFEST}: unknown target {saved_target!r}")
    run_target = _choose_target(saved_target, target)

    program = _program(manifest, files)
    ptx = files[PTX_FILE].decode() if PTX_FILE in files else None
    if saved_target in GPU_TARGETS:
        if ptx is None:
            raise ArtifactError(f"{root}: a {saved_target!r} artifact must contain {PTX_FILE}")
        _check_ptx(ptx, manifest.get("arch"), program.kernels)
    stages: dict[str, Any] = {"artifact": root, "manifest": manifest, "program": program, "ptx": ptx,
                              "cubin": files.get(CUBIN_FILE)}

    if run_target in ("cuda", None):
        executor, why_not = _cuda_executor(program, ptx or "", files.get(CUBIN_FILE), manifest["arch"],
                                           required=run_target == "cuda")
        if executor is not None:
            log.info("loaded %s: running on the GPU (target 'cuda')", root)
            return CompiledModule(program.graph, "cuda", executor, stages=stages, device="cuda")
        log.info("loaded %s: not on a GPU (%s)", root, why_not)
        run_target = "cuda-sim"
    from sextant.codegen.llvm_cpu import compile_kernels
    from sextant.runtime.program_runner import ProgramRunner

    module = compile_kernels(list(program.kernels.values()))
    stages["cpu_module"] = module
    if run_target == "cuda-sim":
        log.info("loaded %s: running the GPU kernels on the CPU (target 'cuda-sim')", root)
        return CompiledModule(program.graph, run_target, ProgramRunner(program, module.launch), stages=stages)
    log.info("loaded %s: running on the CPU (target 'cpu')", root)
    from sextant.codegen.race_check import CheckedCpuModule
    from sextant.runtime.native_runner import NativeRunner

    # as sextant.compile runs it: the native executor, or launch by launch for the race-checked build
    runner = ProgramRunner(program, module.launch) if isinstance(module, CheckedCpuModule) else \
        NativeRunner(program, module)
    return CompiledModule(program.graph, run_target, runner, stages=stages)


def _read_manifest(root: Path) -> dict[str, Any]:
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{root} is not a sextant artifact: it has no {MANIFEST} "
                            f"(write one with CompiledModule.save)")
    try:
        manifest = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{mpath} is not valid JSON ({e}); the artifact is corrupted") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{root} is not a sextant artifact: {MANIFEST} does not declare format {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise ArtifactError(f"{root} is artifact format version {manifest.get('version')!r} (written by sextant "
                            f"{manifest.get('sextant_version', '?')}); this sextant reads version {VERSION}: "
                            f"recompile the model and save it again")
    return manifest


def _verified_files(root: Path, manifest: dict[str, Any]) -> dict[str, bytes]:
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise ArtifactError(f"{MANIFEST}: missing the 'files' table of checksums")
    for required in (GRAPH_FILE, KERNELS_FILE, WEIGHTS_FILE):
        if required not in listed:
            raise ArtifactError(f"{MANIFEST} does not list {required}, which every artifact has")
    files: dict[str, bytes] = {}
    for name, info in listed.items():
        if name not in _OUR_FILES or name == MANIFEST:
            raise ArtifactError(f"{MANIFEST} lists an unexpected file {name!r}")
        fpath = root / name
        if not fpath.is_file():
            raise ArtifactError(f"{root}: {name} is missing (the manifest lists it)")
        data = fpath.read_bytes()
        if not isinstance(info, dict) or _sha256(data) != info.get("sha256"):
            raise ArtifactError(f"{root}: checksum mismatch for {name}: the file was modified or corrupted "
                                f"after it was saved")
        files[name] = data
    return files


def _choose_target(saved: str, requested: str | None) -> str | None:
    """The target to run on; None means "cuda if it can be had, else cuda-sim"."""
    allowed = ("cuda", "cuda-sim") if saved in GPU_TARGETS else ("cpu",)
    if requested is not None and requested not in allowed:
        raise ArtifactError(f"this artifact was compiled for {saved!r} and can run on target(s) "
                            f"{', '.join(allowed)}, not {requested!r}")
    if requested is None:
        return None if saved in GPU_TARGETS else "cpu"
    return requested


def _check_ptx(ptx: str, arch: Any, kernels: dict[str, Kernel]) -> None:
    if not isinstance(arch, str):
        raise ArtifactError(f"{MANIFEST}: a GPU artifact must name its 'arch' (e.g. 'sm_90')")
    ptx_arch = _ptx_target(ptx)
    if ptx_arch != arch:
        raise ArtifactError(f"{PTX_FILE} targets {ptx_arch} but {MANIFEST} says {arch}")
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    missing = sorted(set(kernels) - entries)
    if missing:
        raise ArtifactError(f"{PTX_FILE} has no entry for kernel(s) {', '.join(missing)}")


# -- rebuilding the program -------------------------------------------------------------------------
def _program(manifest: dict[str, Any], files: dict[str, bytes]) -> Program:
    try:
        return _build_program(manifest, files)
    except ArtifactError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:  # a malformed manifest entry
        raise ArtifactError(f"{MANIFEST} is malformed: {type(e).__name__}: {e}") from e


def _build_program(manifest: dict[str, Any], files: dict[str, bytes]) -> Program:
    tensors = _load_weights(files[WEIGHTS_FILE])
    params_map: dict[str, str] = manifest["params"]
    buffers_json: list[dict[str, Any]] = manifest["buffers"]
    stored = {b["weight"] for b in buffers_json if b.get("weight") not in (None, DERIVED)}
    referenced = set(params_map.values()) | stored
    missing = sorted(referenced - set(tensors))
    if missing:
        raise ArtifactError(f"{WEIGHTS_FILE} lacks tensor(s) {', '.join(missing[:5])} that {MANIFEST} refers to")
    extra = sorted(set(tensors) - referenced)
    if extra:
        raise ArtifactError(f"{WEIGHTS_FILE} holds tensor(s) {', '.join(extra[:5])} that {MANIFEST} does not "
                            f"mention: the weights belong to a different artifact")
    params = {name: tensors[key] for name, key in params_map.items()}

    try:
        graph = parse_graph(files[GRAPH_FILE].decode(), params)
    except (ParseError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{GRAPH_FILE} is not valid graph IR: {e}") from None
    for n in graph.nodes:
        if n.op == "param":
            name = n.attr("name")
            if name not in params:
                raise ArtifactError(f"{GRAPH_FILE} uses parameter {name!r}, which {MANIFEST} does not list")
            _check_tensor(params[name], n.shape, n.dtype, f"weight {name!r} ({params_map[name]})")
    if graph.name != manifest["graph"]["name"]:
        raise ArtifactError(f"{GRAPH_FILE} holds graph @{graph.name}, but {MANIFEST} is for "
                            f"@{manifest['graph']['name']}")
    graph = dataclasses.replace(
        graph,
        in_spec=_spec_from_json(manifest["in_spec"]),
        out_spec=_spec_from_json(manifest["out_spec"]),
        leaves=tuple(_leaf_from_json(x, len(graph.inputs)) for x in manifest["leaves"]),
    )
    _check_inputs(manifest["inputs"], graph)

    try:
        kernel_list = kernels_from_json(json.loads(files[KERNELS_FILE]))
    except (KernelSerializeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{KERNELS_FILE}: {e}") from None
    kernels = {k.name: k for k in kernel_list}
    target = TargetDesc(**manifest["schedule_target"])
    for k in kernel_list:  # the kernels run unchecked on the CPU or the GPU: an edited one must not
        try:
            verify_kernel(k, shared_limit=target.shared_bytes)
        except KernelVerificationError as e:
            raise ArtifactError(f"{KERNELS_FILE} does not hold valid kernel IR: {e}") from None

    by_id = {id(n): n for n in graph.nodes}
    nodes = {name: by_id[node_id] for node_id, name in _node_names(graph).items()}
    arena = int(manifest["arena_bytes"])
    buffers: list[BufferInfo] = []
    constants: dict[int, torch.Tensor] = {}
    for i, bj in enumerate(buffers_json):
        buffers.append(_buffer_from_json(i, bj, nodes, arena))
        node = buffers[-1].node
        if bj["kind"] == "param" and bj.get("weight") == DERIVED:
            if not _is_movement_of_param(node):
                raise ArtifactError(f"{MANIFEST}: buffer {i} is marked {DERIVED!r}, but {bj['node']} is not a "
                                    f"re-laid-out parameter")
            constants[i] = _derive(node, graph)
        elif bj["kind"] == "param" and bj.get("weight"):  # params no launch reads have no weight
            constants[i] = tensors[bj["weight"]]
            _check_tensor(constants[i], node.shape, node.dtype, f"weight {bj['weight']!r} of buffer {i}")
    if graph.inputs and [b.node for b in buffers[:len(graph.inputs)]] != list(graph.inputs):
        raise ArtifactError(f"{MANIFEST}: the first buffers must be the graph inputs, in order")

    launches = [_launch_from_json(li, lj, kernels, buffers) for li, lj in enumerate(manifest["launches"])]
    outputs = [int(o["buffer"]) for o in manifest["outputs"]]
    used = {a for la in launches for a in la.args} | set(outputs)
    unweighted = sorted(b.index for b in buffers if b.kind == "param" and b.index in used and b.index not in constants)
    if unweighted:
        raise ArtifactError(f"{MANIFEST}: param buffer(s) {unweighted} are read by the program but name no weight")
    if len(outputs) != len(graph.outputs):
        raise ArtifactError(f"{MANIFEST} lists {len(outputs)} outputs, {GRAPH_FILE} returns {len(graph.outputs)}")
    for k, (b, node) in enumerate(zip(outputs, graph.outputs)):
        if not 0 <= b < len(buffers) or buffers[b].node is not node:
            raise ArtifactError(f"{MANIFEST}: output {k} is buffer {b}, which does not hold the graph's output {k}")
    return Program(graph, target, [], kernels, launches, buffers, outputs, arena, constants,
                   list(manifest.get("notes", [])), rewrites=list(manifest.get("rewrites", [])))


def _load_weights(data: bytes) -> dict[str, torch.Tensor]:
    st = _safetensors()
    try:
        return dict(st.load(data))
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ArtifactError(f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from None


def _check_tensor(t: torch.Tensor, shape: tuple[int, ...], dtype: DType, what: str) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype.torch:
        got, want = (str(d).removeprefix("torch.") for d in (t.dtype, dtype.torch))
        raise ArtifactError(f"{what} in {WEIGHTS_FILE} is {got}{list(t.shape)} but "
                            f"the program expects {want}{list(shape)}")


def _spec_from_json(obj: Any) -> Any:
    if obj is None:
        return None
    try:
        return pytree.treespec_loads(json.dumps(obj))
    except Exception as e:
        raise ArtifactError(f"{MANIFEST}: cannot rebuild an input/output structure: {e}") from None


def _leaf_from_json(x: dict[str, Any], n_inputs: int) -> InputLeaf:
    if x["input"] is not None:
        if not 0 <= int(x["input"]) < n_inputs:
            raise ArtifactError(f"{MANIFEST}: argument {x['name']!r} refers to input {x['input']}, but the graph "
                                f"has {n_inputs}")
        return InputLeaf(x["name"], int(x["input"]))
    kind = _LEAF_TYPES.get(x["type"])
    if kind is None:
        raise ArtifactError(f"{MANIFEST}: argument {x['name']!r} has unknown baked type {x['type']!r}")
    value = x["value"]
    if kind is float and isinstance(value, int):
        value = float(value)
    if type(value) is not kind:
        raise ArtifactError(f"{MANIFEST}: argument {x['name']!r} should be a {x['type']}, got {value!r}")
    return InputLeaf(x["name"], None, value)


def _check_inputs(inputs: list[dict[str, Any]], graph: Graph) -> None:
    if len(inputs) != len(graph.inputs):
        raise ArtifactError(f"{MANIFEST} lists {len(inputs)} inputs, {GRAPH_FILE} has {len(graph.inputs)}")
    for spec, node in zip(inputs, graph.inputs):
        if tuple(spec["shape"]) != node.shape or spec["dtype"] != node.dtype.value:
            raise ArtifactError(f"{MANIFEST}: input {spec['name']} is {spec['dtype']}{spec['shape']} but "
                                f"{GRAPH_FILE} declares {node.type}")


def _buffer_from_json(i: int, bj: dict[str, Any], nodes: dict[str, Node], arena: int) -> BufferInfo:
    if bj["index"] != i:
        raise ArtifactError(f"{MANIFEST}: buffer entry {i} has index {bj['index']}")
    if bj["kind"] not in _BUFFER_KINDS:
        raise ArtifactError(f"{MANIFEST}: buffer {i} has unknown kind {bj['kind']!r}")
    node = nodes.get(bj["node"])
    if node is None:
        raise ArtifactError(f"{MANIFEST}: buffer {i} refers to node {bj['node']}, which {GRAPH_FILE} does not define")
    if tuple(bj["shape"]) != node.shape or bj["dtype"] != node.dtype.value:
        raise ArtifactError(f"{MANIFEST}: buffer {i} is {bj['dtype']}{bj['shape']} but {GRAPH_FILE} gives "
                            f"{bj['node']} the type {node.type}")
    offset = -1
    if bj["kind"] == "temp":
        offset = int(bj["offset"])
        if offset < 0 or offset + node.type.nbytes > arena:
            raise ArtifactError(f"{MANIFEST}: temporary buffer {i} ({node.type.nbytes} bytes at offset {offset}) "
                                f"lies outside the {arena}-byte arena")
    return BufferInfo(i, bj["kind"], node, offset)


def _launch_json(la: Launch, program: Any) -> dict[str, Any]:
    """A launch in the manifest; an extern call names its op and arguments instead of a grid."""
    if isinstance(la.extern, CollectiveCall):
        c = la.extern
        return {"kernel": la.kernel, "group": la.group, "args": list(la.args), "blocks": la.blocks,
                "collective": {"kind": c.kind, "stage": c.stage, "attrs": dict(c.attrs), "loc": c.loc}}
    if la.extern is not None:
        c = la.extern
        return {"kernel": la.kernel, "group": la.group, "args": list(la.args), "blocks": la.blocks,
                "extern": {"fn": c.fn, "args": c.args, "kwargs": c.kwargs, "results": list(c.results), "loc": c.loc}}
    k = program.kernels[la.kernel]
    return {"kernel": la.kernel, "group": la.group, "args": list(la.args), "blocks": la.blocks,
            "grid": list(k.grid), "block": list(k.block)}


def _launch_from_json(li: int, lj: dict[str, Any], kernels: dict[str, Kernel], buffers: list[BufferInfo]) -> Launch:
    name = lj["kernel"]
    if (cj := lj.get("collective")) is not None:
        args = tuple(int(a) for a in lj["args"])
        if len(args) != 2 or any(not 0 <= a < len(buffers) for a in args) or cj.get("stage") not in ("start", "wait"):
            raise ArtifactError(f"{MANIFEST}: collective launch {li} ({cj.get('kind')}) is malformed")
        attrs = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(cj["attrs"].items()))
        call = CollectiveCall(str(cj["kind"]), cj["stage"], attrs, cj.get("loc"))
        return Launch(name, int(lj["group"]), args, 1, call)
    if (ej := lj.get("extern")) is not None:
        args = tuple(int(a) for a in lj["args"])
        if any(not 0 <= a < len(buffers) for a in args) or len(ej["results"]) > len(args):
            raise ArtifactError(f"{MANIFEST}: extern launch {li} ({ej.get('fn')}) names buffers that do not exist")
        call = ExternCall(str(ej["fn"]), str(ej["args"]), str(ej["kwargs"]), tuple(int(r) for r in ej["results"]),
                          ej.get("loc"))
        return Launch(name, int(lj["group"]), args, 1, call)
    k = kernels.get(name)
    if k is None:
        raise ArtifactError(f"{MANIFEST}: launch {li} refers to kernel {name!r}, which {KERNELS_FILE} does not "
                            f"define (it has {', '.join(kernels) or 'none'})")
    args = tuple(int(a) for a in lj["args"])
    if len(args) != len(k.params):
        raise ArtifactError(f"{MANIFEST}: launch {li} passes {len(args)} buffers to kernel {name}, which takes "
                            f"{len(k.params)}")
    for a, p in zip(args, k.params):
        if not 0 <= a < len(buffers):
            raise ArtifactError(f"{MANIFEST}: launch {li} ({name}) passes buffer {a}, which does not exist")
        node = buffers[a].node
        numel = node.type.nbytes // node.dtype.itemsize
        if node.dtype != p.dtype or numel != p.size:
            raise ArtifactError(f"{MANIFEST}: launch {li} passes buffer {a} ({node.type}) as parameter {p.name} "
                                f"of kernel {name}, which expects {p.size} x {p.dtype.value}")
    if tuple(lj["grid"]) != k.grid or tuple(lj["block"]) != k.block or int(lj["blocks"]) != k.num_blocks:
        raise ArtifactError(f"{MANIFEST}: launch {li} of {name} has grid {lj['grid']} block {lj['block']}, but "
                            f"the kernel was generated for grid {list(k.grid)} block {list(k.block)}")
    return Launch(name, int(lj["group"]), args, int(lj["blocks"]))


# -- the GPU -----------------------------------------------------------------------------------------
def _device_arch() -> str | None:
    """``sm_XY`` of the current CUDA device, or None when torch sees no GPU."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _cuda_executor(program: Program, ptx: str, cubin: bytes | None, arch: str,
                   *, required: bool) -> tuple[Any, str]:
    """An executor running ``program`` on the GPU, or (None, why not). ``required`` turns "why not"
    into an error (the caller asked for target 'cuda')."""
    device = _device_arch()
    why = ""
    if device is None:
        why = "torch sees no CUDA GPU"
    elif _arch_number(arch) > _arch_number(device):
        raise ArtifactError(f"the artifact's PTX is for {arch}, newer than this GPU ({device}); recompile with "
                            f"sextant.compile(..., arch={device!r})")
    else:
        try:
            from sextant.runtime import cuda as cuda_runtime  # written alongside; may be absent
        except ModuleNotFoundError as e:
            if e.name != "sextant.runtime.cuda":
                raise
            cuda_runtime = None
        if cuda_runtime is None or not hasattr(cuda_runtime, "load_runner"):
            why = "this sextant has no CUDA runtime that can load artifacts (sextant.runtime.cuda.load_runner)"
        else:
            try:
                return cuda_runtime.load_runner(program, ptx, cubin, arch), ""
            except getattr(cuda_runtime, "CudaUnavailableError", ()) as e:  # e.g. a GPU but no cuda-python
                why = str(e)
    if required:
        raise ArtifactError(f"cannot run on target 'cuda': {why}; load with target='cuda-sim' to run the same "
                            f"kernels on the CPU")
    return None, why
