"""Run ONNX's node test cases through sextant: ``python -m sextant.tools.onnx_conformance``.

Every directory of ``onnx/backend/test/data/node`` (shipped with the ``onnx`` package: a
``model.onnx`` and ``test_data_set_*/{input,output}_*.pb``) is imported by sextant's ONNX
frontend, run through each target (default: the reference executor and the cpu target) and
compared with the expected outputs — with onnx's own tolerances (rtol 1e-3, atol 1e-7) for f32,
looser ones for f16/bf16 (their rounding step), exact for integers and bools. Each test runs in a
forked worker, so a crash or a hang costs one test, not the run.

By default the *float* node tests are tried — those whose outputs are all f32/f16/bf16 tensors;
``--all`` tries every test. The run prints a table by op and ends with
``onnx: <passed>/<tried> node tests (<percent>%)``; ``--markdown docs/onnx.md`` rewrites the
generated part of that chapter.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import select
import signal
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FLOAT_TYPES = (1, 10, 16)  # TensorProto FLOAT, FLOAT16, BFLOAT16
TOLERANCES = {1: (1e-3, 1e-7), 10: (1e-3, 1e-3), 16: (1e-2, 1e-2)}  # (rtol, atol) by output type
TIMEOUT_S = 120.0
BEGIN, END = "<!-- onnx-conformance:begin -->", "<!-- onnx-conformance:end -->"
# Statuses, best first.
PASS, MISMATCH, UNSUPPORTED, ERROR, CRASH, TIMEOUT = "pass", "mismatch", "unsupported", "error", "crash", "timeout"

# Why whole op families are out of scope (the generated chapter lists these next to the counts).
WHY = {
    "SequenceConstruct": "sequence values: the graph IR has tensors only",
    "OptionalGetElement": "optional/sequence values: the graph IR has tensors only",
    "Identity": "optional/sequence values: the graph IR has tensors only",
    "Bernoulli": "random numbers: outputs cannot be compared to a fixed expectation",
    "RandomUniformLike": "random numbers: outputs cannot be compared to a fixed expectation",
    "Dropout": "training mode draws random numbers; inference-mode Dropout is supported",
    "BatchNormalization": "training mode (updates running statistics); inference mode is supported",
    "Adagrad": "training ops (ai.onnx.preview.training domain)",
    "Adam": "training ops (ai.onnx.preview.training domain)",
    "Momentum": "training ops (ai.onnx.preview.training domain)",
    "FlexAttention": "preview domain (ai.onnx.preview), with a score-modifier subgraph; Attention is supported",
    "TfIdfVectorizer": "n-gram counting over token sequences; not translated",
    "TreeEnsemble": "ML-domain op (ai.onnx.ml)",
    "ArrayFeatureExtractor": "ML-domain op (ai.onnx.ml)",
    "Binarizer": "ML-domain op (ai.onnx.ml)",
    "DequantizeLinear": "quantized types (int8/uint8/float8/int4): not among sextant's dtypes",
    "QuantizeLinear": "quantized types (int8/uint8/float8/int4): not among sextant's dtypes",
    "DFT": "complex-valued signal ops: no complex dtype",
    "STFT": "complex-valued signal ops: no complex dtype",
    "Det": "needs a matrix factorisation (LU); not translated",
    "RoiAlign": "sampling at data-dependent box coordinates; not translated yet",
    "MelWeightMatrix": "a constant generator; not translated yet",
    "BitCast": "bit reinterpretation: the graph IR has no bitcast primitive",
}


def node_test_dir() -> Path:
    import onnx.backend.test

    return Path(onnx.backend.test.__file__).parent / "data" / "node"


@dataclass
class CaseResult:
    name: str
    op: str
    is_float: bool
    status: str  # overall: the worst of the targets'
    targets: dict[str, str] = field(default_factory=dict)  # target → status
    detail: str = ""  # the first failure's explanation
    seconds: float = 0.0
    specialised: list[str] = field(default_factory=list)  # inputs compiled as constants (shape-deciding)


def _main_op(model: Any, name: str) -> str:
    """The op a test is about: its only node's, or for an ``_expanded`` test the function it expands."""
    if "_expanded" in name:
        twin = node_test_dir() / name.split("_expanded")[0] / "model.onnx"
        if twin.exists():
            import onnx

            return _main_op(onnx.load(str(twin)), twin.parent.name) + " (expanded)"
    ops = [n.op_type for n in model.graph.node]
    helpers = {"Constant", "Identity", "Cast", "CastLike", "Shape", "Reshape", "Unsqueeze", "Squeeze", "Concat"}
    main = next((o for o in reversed(ops) if o not in helpers), ops[-1] if ops else "?")
    return main + " (expanded)" if "_expanded" in name else main


def is_float_test(model: Any) -> bool:
    outs = model.graph.output
    return all(o.type.WhichOneof("value") == "tensor_type" and o.type.tensor_type.elem_type in FLOAT_TYPES
               for o in outs)


def _read_tensors(folder: Path, prefix: str, value_infos: Sequence[Any]) -> list[np.ndarray]:
    import onnx
    from onnx import numpy_helper

    out = []
    for i, vi in enumerate(value_infos):
        path = folder / f"{prefix}_{i}.pb"
        if not path.exists():
            break
        if vi.type.WhichOneof("value") != "tensor_type":
            raise _Skip(f"{prefix} {vi.name!r} is a {vi.type.WhichOneof('value')}, not a tensor")
        proto = onnx.TensorProto()
        proto.ParseFromString(path.read_bytes())
        out.append((proto.data_type, numpy_helper.to_array(proto)))
    return out


class _Skip(Exception):
    pass


def _compare(got: Any, want: tuple[int, np.ndarray]) -> str | None:
    """None when ``got`` matches, else why not."""
    elem, ref = want
    got = np.asarray(got)
    if got.shape != ref.shape:
        return f"shape {list(got.shape)} != expected {list(ref.shape)}"
    if elem == 16:  # bfloat16 expectations come as ml_dtypes arrays; sextant returns float32 for them
        ref = ref.astype(np.float32)
    elif got.dtype != ref.dtype:
        return f"dtype {got.dtype} != expected {ref.dtype}"
    if ref.dtype.kind in "fc":
        rtol, atol = TOLERANCES.get(elem, (1e-3, 1e-7))
        ok = np.isclose(got.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)
        if not ok.all():
            err = np.abs(got.astype(np.float64) - ref.astype(np.float64))
            return f"{int((~ok).sum())}/{ok.size} elements differ, max abs error {np.nanmax(err):.3g}"
        return None
    if not np.array_equal(got, ref):
        return f"{int((got != ref).sum())}/{ref.size} elements differ"
    return None


def run_case(folder: Path, targets: Sequence[str]) -> CaseResult:
    """Import ``folder``'s model once, compile it for each target, and check every data set."""
    import onnx

    import sextant
    from sextant.errors import UnsupportedOpError
    from sextant.frontend.onnx import OnnxImportError, import_onnx
    from sextant.frontend.onnx.importer import graph_inputs
    from sextant.runtime.onnx_module import OnnxCompiledModule

    t0 = time.perf_counter()
    model = onnx.load(str(folder / "model.onnx"))
    res = CaseResult(folder.name, _main_op(model, folder.name), is_float_test(model), PASS)
    try:
        inputs = graph_inputs(model)
        sets = []
        for ds in sorted(folder.glob("test_data_set_*")):
            sets.append((_read_tensors(ds, "input", inputs), _read_tensors(ds, "output", model.graph.output)))
        if not sets:
            raise _Skip("no test data")
        fed = [vi.name for vi in inputs[:len(sets[0][0])]]
        shapes = {n: a.shape for n, (_, a) in zip(fed, sets[0][0])}
        # shape-deciding inputs (axes, scales, K) are specialised on each data set's values, as a
        # static-shape compiler must (the compiled module then only accepts those values); a node
        # names one such input at a time, so this repeats while the import asks for more
        while True:
            try:
                fixed = set(res.specialised)
                graphs = [import_onnx(model, shapes, constant_inputs={n: a for n, (_, a) in zip(fed, ins)
                                                                      if n in fixed}) for ins, _ in sets]
                break
            except UnsupportedOpError as e:
                if not set(e.needs_values) - fixed:
                    raise
                res.specialised = sorted(fixed | set(e.needs_values))
    except (UnsupportedOpError, OnnxImportError, _Skip) as e:
        res.status, res.detail = UNSUPPORTED, _short(e)
        res.targets = dict.fromkeys(targets, UNSUPPORTED)
        return res
    except Exception as e:
        res.status, res.detail = ERROR, f"import: {type(e).__name__}: {_short(e)}"
        res.targets = dict.fromkeys(targets, ERROR)
        return res
    for target in targets:
        try:
            problem = None
            compiled: dict[int, OnnxCompiledModule] = {}
            for graph, (ins, outs) in zip(graphs, sets):
                if id(graph) not in compiled:
                    compiled[id(graph)] = OnnxCompiledModule(sextant.compile_graph(graph, target=target))
                got = compiled[id(graph)].run({n: a for n, (_, a) in zip(fed, ins)})
                if len(got) != len(outs):
                    problem = f"{len(got)} outputs, expected {len(outs)}"
                for k, (g, w) in enumerate(zip(got, outs)):
                    why = _compare(g, w)
                    if why:
                        problem = problem or f"output {k}: {why}"
            status = MISMATCH if problem else PASS
            detail = problem or ""
        except UnsupportedOpError as e:
            status, detail = UNSUPPORTED, _short(e)
        except Exception as e:
            status, detail = ERROR, f"{type(e).__name__}: {_short(e)}"
            if os.environ.get("SEXTANT_ONNX_TRACEBACK"):
                traceback.print_exc()
        res.targets[target] = status
        if status != PASS and res.status == PASS:
            res.status, res.detail = status, f"{target}: {detail}"
    res.seconds = time.perf_counter() - t0
    return res


def _short(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and "unsupported" in lines[0]:
        reasons = [ln.strip() for ln in lines if ln.strip().startswith("reason:")]
        return lines[0].split(": ", 1)[-1] + (f" ({reasons[0]})" if reasons else "")
    return (lines[0] if lines else type(e).__name__)[:300]


# -- running in forked workers -----------------------------------------------------------------
TESTS_PER_WORKER = 100  # a worker is replaced after this many tests (JIT engines and caches accumulate)


def _one(folder: Path, targets: Sequence[str]) -> bytes:
    try:
        res = run_case(folder, targets)
    except BaseException as e:  # anything becomes this test's error
        res = CaseResult(folder.name, "?", False, ERROR, {}, f"{type(e).__name__}: {e}")
    return json.dumps(asdict(res)).encode() + b"\n"


def _worker(targets: Sequence[str], rfd: int, wfd: int) -> None:
    """Read test folders (one per line), write one JSON result line each, until told to stop."""
    import torch

    # one thread per worker (the workers are the parallelism), and no OpenMP: libgomp's thread pool
    # does not survive fork, so a parallel torch op in a child of a process that used it hangs
    torch.set_num_threads(1)
    # ... and no nested forks: a worker that already ran models has thread pools, and a compile
    # that forks again from it (codegen.objects) hung in LLVM under pytest-xdist
    os.environ["SEXTANT_COMPILE_JOBS"] = "1"
    with os.fdopen(rfd, "rb") as inp, os.fdopen(wfd, "wb", buffering=0) as out:
        for line in inp:
            if not line.strip():
                break
            out.write(_one(Path(line.decode().rstrip("\n")), targets))
    os._exit(0)


@dataclass
class _Worker:
    pid: int
    to_child: int
    from_child: int
    folder: Path | None = None
    started: float = 0.0
    done: int = 0
    buf: bytearray = field(default_factory=bytearray)


def _spawn(targets: Sequence[str]) -> _Worker:
    r1, w1 = os.pipe()  # parent → child: folders
    r2, w2 = os.pipe()  # child → parent: results
    # Objects alive at the fork must never be collected in the child: an onnxruntime session left
    # in a garbage cycle by earlier work in this process (other tests, under pytest-xdist) had its
    # destructor run by the child's GC, which waits forever on a thread pool the child does not
    # have (seen: a worker stuck in pthread_cond_destroy, every case then a timeout). Collect here,
    # where destruction works, and freeze the rest for the child (the gc module's fork recipe).
    gc.collect()
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        os.close(w1)
        os.close(r2)
        _worker(targets, r1, w2)
    gc.unfreeze()
    os.close(r1)
    os.close(w2)
    return _Worker(pid, w1, r2)


def _retire(w: _Worker, kill: bool = False) -> int:
    if kill:
        os.kill(w.pid, signal.SIGKILL)
    else:
        with contextlib.suppress(OSError):
            os.write(w.to_child, b"\n")
    for fd in (w.to_child, w.from_child):
        with contextlib.suppress(OSError):
            os.close(fd)
    return os.waitpid(w.pid, 0)[1]


def run_all(folders: Sequence[Path], targets: Sequence[str], jobs: int, timeout: float = TIMEOUT_S,
            progress: Any = None) -> list[CaseResult]:
    """Run every case in ``jobs`` forked workers; a crash or a hang costs its test (recorded) and a new worker."""
    from sextant.codegen.llvm_cpu import _init_llvm

    _init_llvm()  # once, in the parent: every worker inherits an initialised LLVM
    import torch._dynamo  # noqa: F401 - imported lazily by some meta kernels; seconds per worker otherwise
    pending = list(folders)
    results: list[CaseResult] = []
    workers: list[_Worker] = []

    def record(r: CaseResult) -> None:
        results.append(r)
        if progress:
            progress(r, len(results), len(folders))

    while pending or any(w.folder for w in workers):
        for w in list(workers):  # hand out work; replace workers that are worn out
            if w.folder is None and (w.done >= TESTS_PER_WORKER or not pending):
                _retire(w)
                workers.remove(w)
        while pending and len(workers) < jobs:
            workers.append(_spawn(targets))
        for w in workers:
            if w.folder is None and pending:
                w.folder, w.started = pending.pop(0), time.monotonic()
                os.write(w.to_child, str(w.folder).encode() + b"\n")
        busy = {w.from_child: w for w in workers if w.folder}
        ready, _, _ = select.select(list(busy), [], [], 1.0)
        for fd in ready:
            w = busy[fd]
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the worker died mid-test
                status = _retire(w, kill=True)
                workers.remove(w)
                sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                record(CaseResult(w.folder.name, "?", False, CRASH, {},
                                  f"the worker died ({signal.Signals(sig).name if sig else f'exit {status}'})"))
                continue
            w.buf.extend(chunk)
            if w.buf.endswith(b"\n"):
                record(CaseResult(**json.loads(w.buf)))
                w.buf.clear()
                w.folder, w.done = None, w.done + 1
        now = time.monotonic()
        for w in list(workers):
            if w.folder and now - w.started > timeout:
                _retire(w, kill=True)
                workers.remove(w)
                record(CaseResult(w.folder.name, "?", False, TIMEOUT, {}, f"over {timeout:.0f} s"))
    for w in workers:
        _retire(w)
    return sorted(results, key=lambda r: r.name)


# -- reporting ------------------------------------------------------------------------------------
def summary_line(results: Sequence[CaseResult]) -> str:
    passed = sum(r.status == PASS for r in results)
    pct = 100.0 * passed / len(results) if results else 0.0
    return f"onnx: {passed}/{len(results)} node tests ({pct:.1f}%)"


def by_op(results: Sequence[CaseResult]) -> dict[str, list[CaseResult]]:
    out: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        out[r.op.removesuffix(" (expanded)")].append(r)
    return dict(sorted(out.items()))


def _reason(rs: Sequence[CaseResult]) -> str:
    bad = [r for r in rs if r.status != PASS]
    if not bad:
        return ""
    op = bad[0].op.removesuffix(" (expanded)")
    if op in WHY:
        return WHY[op]
    kinds = Counter(r.status for r in bad)
    first = bad[0]
    return f"{', '.join(f'{n} {k}' for k, n in kinds.most_common())}: {first.name}: {first.detail}"[:200]


def text_table(results: Sequence[CaseResult]) -> str:
    rows = [f"{'op':28} {'tried':>5} {'passed':>6}  first failure"]
    for op, rs in by_op(results).items():
        rows.append(f"{op:28} {len(rs):5d} {sum(r.status == PASS for r in rs):6d}  {_reason(rs)}")
    return "\n".join(rows)


def markdown(results: Sequence[CaseResult], targets: Sequence[str], selection: str, seconds: float) -> str:
    import onnx

    import sextant.frontend.onnx as fe
    from sextant.tools.bench import _machine

    tried_ops = by_op(results)
    lines = [
        f"Generated by `python -m sextant.tools.onnx_conformance --markdown docs/onnx.md` "
        f"(onnx {onnx.__version__}, {selection}, targets: {', '.join(targets)}; "
        f"{_machine().split(', Python')[0]}; {seconds:.0f} s).",
        "",
        "```",
        summary_line(results),
        "```",
        "",
        f"Statuses: {', '.join(f'{k} {n}' for k, n in Counter(r.status for r in results).most_common())}. "
        f"sextant translates {len(fe.ONNX_OPS)} ONNX op types. "
        f"{sum(bool(r.specialised) and r.status == PASS for r in results)} of the passing tests feed shape-deciding "
        "values (axes, scales, K, ...) as graph inputs; they were compiled specialised on those values "
        "(`constant_inputs`), as a static-shape compiler must.",
        "",
        "| op | tried | passed | what fails, and why |",
        "| --- | ---: | ---: | --- |",
    ]
    for op, rs in tried_ops.items():
        why = _reason(rs).replace("|", "\\|")
        lines.append(f"| {op} | {len(rs)} | {sum(r.status == PASS for r in rs)} | {why} |")
    return "\n".join(lines)


def write_markdown(path: Path, body: str) -> None:
    text = path.read_text() if path.exists() else f"# ONNX conformance\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1] if END in rest else ""
    path.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sextant.tools.onnx_conformance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="reference,cpu", help="comma-separated (default reference,cpu)")
    ap.add_argument("--all", action="store_true", help="every node test, not only the float ones")
    ap.add_argument("-k", "--filter", help="only tests whose name matches this regular expression")
    ap.add_argument("-j", "--jobs", type=int, default=len(os.sched_getaffinity(0)), help="tests at once")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per test (default 120)")
    ap.add_argument("--markdown", type=Path, help="rewrite the generated block of this file (docs/onnx.md)")
    ap.add_argument("--json", type=Path, help="write every test's result to this file")
    ap.add_argument("--failures", action="store_true", help="print each failing test with its reason")
    ns = ap.parse_args(argv)
    import onnx

    targets = [t for t in ns.targets.split(",") if t]
    folders = sorted(p for p in node_test_dir().iterdir() if (p / "model.onnx").exists())
    if ns.filter:
        folders = [p for p in folders if re.search(ns.filter, p.name)]
    if not ns.all:
        folders = [p for p in folders if is_float_test(onnx.load(str(p / "model.onnx"), load_external_data=False))]
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()

    def progress(r: CaseResult, done: int, total: int) -> None:
        if tty:
            print(f"\r[{done}/{total}] {r.name[:60]:60}", end="", file=sys.stderr, flush=True)

    results = run_all(folders, targets, max(1, ns.jobs), ns.timeout, progress)
    seconds = time.perf_counter() - t0
    if tty:
        print(file=sys.stderr)
    print(text_table(results))
    if ns.failures:
        for r in results:
            if r.status != PASS:
                print(f"{r.name}: {r.status}: {r.detail}")
    if ns.json:
        ns.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if ns.markdown:
        selection = "all node tests" if ns.all else "float node tests"
        if ns.filter:
            selection += f" matching {ns.filter!r}"
        write_markdown(ns.markdown, markdown(results, targets, selection, seconds))
    print(summary_line(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
