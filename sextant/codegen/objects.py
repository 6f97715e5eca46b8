"""LLVM IR → optimised machine-code objects for the host: cached on disk, compiled in parallel.

Most of the CPU target's compile time is LLVM's O3 pipeline and instruction selection, about
30–100 ms per kernel. Each kernel is its own LLVM module, so

* a kernel whose IR (and target, and LLVM version, and pass options) was compiled before is
  read back from an on-disk object cache instead — another model, another process or the
  next run of the same script reuses it. Keys are SHA-256 hashes of all of that; entries are
  written atomically, so concurrent compiles (pytest-xdist workers) share one cache safely.
  ``SEXTANT_CACHE_DIR`` moves it (default ``$XDG_CACHE_HOME/sextant`` or ``~/.cache/sextant``),
  ``SEXTANT_CACHE=0`` turns it off, ``SEXTANT_CACHE_MAX_MB`` (default 1024) bounds it (least
  recently used objects go first);
* the kernels that are not cached are spread over forked worker processes, one per core
  (LLVM's pass managers are single-threaded, and llvmlite serialises its global context behind
  a lock within a process). The parent compiles a share itself; a worker only runs LLVM and
  exits. Fewer than ``MIN_PARALLEL`` kernels, one core or no ``fork`` (non-Linux): in process.

The result is what MCJIT would produce itself: the objects are emitted by the very target
machine the JIT engine loads them with.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from sextant.codegen.errors import CodegenError

MIN_PARALLEL = 4  # uncached kernels below which forking workers costs more than it saves
FORMAT = 1  # bump when what an object means changes (the kernel ABI, the pass pipeline below)


@dataclass(frozen=True)
class PassOptions:
    """The LLVM pipeline a kernel goes through (part of every cache key)."""

    speed_level: int = 3
    slp_vectorization: bool = True  # off by default in LLVM's tuning options; clang turns it on at O2+
    # the schedules unroll what pays (register tiles and reduction lanes, as vector code): LLVM's
    # own unrolling of every other loop tripled the optimised IR and most of the compile time
    loop_unrolling: bool = False

    def run(self, module: llvm.ModuleRef, tm: llvm.TargetMachine) -> None:
        pto = llvm.create_pipeline_tuning_options(speed_level=self.speed_level)
        pto.slp_vectorization = self.slp_vectorization
        pto.loop_unrolling = self.loop_unrolling
        pb = llvm.create_pass_builder(tm, pto)
        pb.getModulePassManager().run(module, pb)


def cache_dir() -> Path | None:
    """Where objects are cached, or None when caching is off (``SEXTANT_CACHE=0``)."""
    if os.environ.get("SEXTANT_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if os.environ.get("SEXTANT_CACHE_DIR"):
        return Path(os.environ["SEXTANT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sextant"


def source_fingerprint(files: Sequence[Path]) -> str:
    """A hash of source files (names and contents): what cache keys include so that entries go stale
    as soon as the code that produced them changes."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(text: str, tm: llvm.TargetMachine, options: PassOptions) -> str:
    """The key of an object compiled from LLVM IR ``text`` (the toolchain, host CPU and options too)."""
    h = hashlib.sha256()
    for part in (f"sextant-objects-{FORMAT}", llvmlite.__version__, ".".join(map(str, llvm.llvm_version_info)),
                 tm.triple, llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten(), repr(options), text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def optimize(text: str, tm: llvm.TargetMachine, options: PassOptions) -> llvm.ModuleRef:
    """Parse, verify and optimise one module (a CodegenError, with the IR's start, if invalid)."""
    try:
        mod = llvm.parse_assembly(text)
        mod.verify()
    except RuntimeError as e:  # a code generator bug, not a user error: show the IR's first lines
        raise CodegenError(f"generated LLVM IR is invalid: {e}\n{text[:4000]}") from e
    options.run(mod, tm)
    return mod


MAX_WORKERS = 8  # forks of a process holding torch and a model: enough to matter, few enough to stay cheap


def compile_workers() -> int:
    """Processes a compile may use: ``SEXTANT_COMPILE_JOBS`` if set (1: compile in this process,
    never fork), else the CPUs this process may run on (a container's share, not the host's
    count), at most ``MAX_WORKERS``."""
    jobs = os.environ.get("SEXTANT_COMPILE_JOBS", "").strip()
    if jobs.isdigit() and int(jobs) >= 1:
        return int(jobs)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def _compile_one(text: str, tm: llvm.TargetMachine, options: PassOptions) -> bytes:
    return tm.emit_object(optimize(text, tm, options))


def _shares(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Indices split into ``n`` shares of about equal IR size (largest first, to the lightest share)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        s = load.index(min(load))
        shares[s].append(i)
        load[s] += sizes[i]
    return shares


def _compile_forked(make_text: Callable[[int], str], todo: list[int], sizes: list[int], tm: llvm.TargetMachine,
                    options: PassOptions, workers: int) -> dict[int, bytes]:
    """Objects for the modules ``todo``; a worker also generates its modules' IR (``make_text``)."""
    shares = [[todo[j] for j in share] for share in _shares(sizes, workers)]
    children: list[tuple[int, int, list[int]]] = []
    for share in shares[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: compile, send, exit without running the parent's atexit hooks
            os.close(r)
            try:
                payload = pickle.dumps(("ok", [_compile_one(make_text(i), tm, options) for i in share]))
            except BaseException as e:  # everything goes back to the parent
                payload = pickle.dumps(("error", e if isinstance(e, CodegenError) else f"{type(e).__name__}: {e}"))
            with os.fdopen(w, "wb") as f:
                f.write(payload)
            os._exit(0)
        os.close(w)
        children.append((pid, r, share))
    out: dict[int, bytes] = {}
    errors: list[CodegenError | str] = []
    try:
        for i in shares[0]:
            out[i] = _compile_one(make_text(i), tm, options)
    finally:
        for pid, r, share in children:
            with os.fdopen(r, "rb") as f:
                data = f.read()
            os.waitpid(pid, 0)
            status, result = pickle.loads(data) if data else ("error", "a compile worker died")
            if status != "ok":
                errors.append(result)
                continue
            out.update(zip(share, result))
    if errors:
        if isinstance(errors[0], CodegenError):
            raise errors[0]
        raise CodegenError(f"compiling kernels in a worker process failed: {errors[0]}")
    return out


def _store(path: Path, data: bytes) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:  # a read-only or full cache only costs the next compile its time
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


_pruned: set[Path] = set()


def prune(root: Path, max_bytes: int | None = None) -> None:
    """Drop the least recently used objects until the cache is under 80% of its limit
    (``SEXTANT_CACHE_MAX_MB``, default 1024); a hit refreshes an object's mtime."""
    if max_bytes is None:
        max_bytes = int(float(os.environ.get("SEXTANT_CACHE_MAX_MB", "1024")) * 2**20)
    entries = []
    for p in (root / "objects").glob("*/*.o"):
        with contextlib.suppress(OSError):
            st = p.stat()
            entries.append((st.st_mtime, st.st_size, p))
    total = sum(e[1] for e in entries)
    if total <= max_bytes:
        return
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        with contextlib.suppress(OSError):
            p.unlink()
        total -= size
        if total <= 0.8 * max_bytes:
            break


DEFAULT_OPTIONS = PassOptions()


def build_objects(keys: Sequence[str], make_text: Callable[[int], str], tm: llvm.TargetMachine,
                  options: PassOptions = DEFAULT_OPTIONS, *, workers: int | None = None,
                  size_hint: Callable[[int], int] | None = None) -> tuple[list[bytes], int]:
    """One object per key (same order) and how many came from the cache; module ``i``'s LLVM IR
    is only generated (``make_text(i)``) on a miss, in the worker that compiles it."""
    root = cache_dir()
    objs: list[bytes | None] = [None] * len(keys)
    if root is not None:
        for i, k in enumerate(keys):
            p = root / "objects" / k[:2] / f"{k}.o"
            with contextlib.suppress(OSError):
                objs[i] = p.read_bytes()
                os.utime(p)  # recently used: pruned last
    missing = [i for i, o in enumerate(objs) if o is None]
    n = min(workers if workers is not None else compile_workers(), len(missing))
    if n > 1 and len(missing) >= MIN_PARALLEL and hasattr(os, "fork") and sys.platform.startswith("linux"):
        sizes = [size_hint(i) if size_hint else 1 for i in missing]
        fresh = _compile_forked(make_text, missing, sizes, tm, options, n)
    else:
        fresh = {i: _compile_one(make_text(i), tm, options) for i in missing}
    for i in missing:
        objs[i] = fresh[i]
        if root is not None:
            _store(root / "objects" / keys[i][:2] / f"{keys[i]}.o", fresh[i])
    if root is not None and missing and root not in _pruned:  # once per process and cache
        _pruned.add(root)
        prune(root)
    return [o for o in objs if o is not None], len(keys) - len(missing)


def compile_objects(texts: Sequence[str], tm: llvm.TargetMachine, options: PassOptions = DEFAULT_OPTIONS, *,
                    workers: int | None = None) -> tuple[list[bytes], int]:
    """One object per LLVM IR text (same order), and how many came from the cache."""
    keys = [cache_key(t, tm, options) for t in texts]
    return build_objects(keys, lambda i: texts[i], tm, options, workers=workers, size_hint=lambda i: len(texts[i]))
