"""The compile cache: a second process compiling the same model loads it instead (no torch.export,
no scheduling, no LLVM).

An entry is a saved artifact (``sextant/runtime/artifact.py``: kernel IR, PTX/cubin, manifest with a
checksum of every file, weights) under ``<cache dir>/compiled/<key>/``, where the cache dir is the
object cache's (``SEXTANT_CACHE_DIR``, default ``~/.cache/sextant``). ``SEXTANT_CACHE=0`` turns every
cache off, ``SEXTANT_COMPILE_CACHE=0`` only this one, ``sextant.compile(..., cache=False)`` one call.

The key must be known *before* capture (capture is what the cache saves), so it fingerprints what
decides the captured graph: the source files of every module class in the model, each module's
plain attributes (hyperparameters, a transformers config), the training flags, every parameter
and buffer (names, shapes, dtypes and bytes), the inputs' structure, shapes, dtypes and
non-tensor values, the target, arch and pipeline, the GPU targets' measured tile choices
(``runtime/tuning_store.py``), and the versions of torch and of sextant's own
source. A model whose ``forward`` calls code in other files that changes between runs is not seen
by the key — turn the cache off while editing such code. A module the key cannot fingerprint (no
source file) is simply not cached.

Entries are written to a temporary directory and renamed into place, so concurrent writers never
leave a half-written entry; a corrupted entry fails the artifact's checksums on load, is deleted
and rebuilt, never run.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from sextant.errors import ArtifactError

log = logging.getLogger("sextant.cache")
CACHED_TARGETS = ("cpu", "cuda-sim", "cuda")
FORMAT = 1


def cache_root() -> Path | None:
    """``<cache dir>/compiled``, or None when the compile cache is off."""
    from sextant.codegen.objects import cache_dir

    if os.environ.get("SEXTANT_COMPILE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    root = cache_dir()
    return None if root is None else root / "compiled"


@cache
def _sextant_fingerprint() -> str:
    """A hash of sextant's own source: any change to the compiler invalidates every entry."""
    from sextant.codegen.objects import source_fingerprint

    return source_fingerprint(list(Path(__file__).resolve().parents[1].rglob("*.py")))


@cache
def _file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _plain(v: Any) -> Any:
    """A module attribute as key material: numbers, strings, configs; None for what is not plain."""
    if isinstance(v, (bool, int, float, str, type(None))):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str, type(None))) for x in v):
        return tuple(v)
    if isinstance(v, dict) and all(isinstance(k, (bool, int, float, str)) for k in v):
        items = [(k, _plain(x)) for k, x in v.items()]  # e.g. the Dynamo wrapper's baked float constants
        return repr(sorted(items, key=repr)) if all(x is not None or v[k] is None for k, x in items) else None
    if hasattr(v, "to_dict"):  # a transformers/diffusers config
        return repr(sorted(v.to_dict().items()))
    return None


def key(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None, target: str, arch: str | None,
        pipeline: str | Sequence[str]) -> str | None:
    """The cache key of compiling ``module(*args, **kwargs)``; None when it cannot be fingerprinted."""
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")

    def tensor(t: torch.Tensor) -> None:
        t = t.detach()
        put(tuple(t.shape), t.dtype, t.device.type)
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    put(f"sextant-compiled-{FORMAT}", _sextant_fingerprint(), torch.__version__, target, arch,
        pipeline if isinstance(pipeline, str) else ",".join(pipeline),
        f"tf32={torch.backends.cuda.matmul.allow_tf32}")  # changes the GPU targets' f32 matmuls
    if target != "cpu":
        from sextant.runtime.tuning_store import fingerprint

        put("tiles", fingerprint(arch))  # measured tile choices (tools/tune.py) change the GPU kernels
    for name, m in module.named_modules():
        cls = type(m)
        try:
            src = inspect.getsourcefile(cls)
        except TypeError:
            src = None
        if src is None or not os.path.isfile(src):
            return None
        put(name, cls.__module__, cls.__qualname__, _file_hash(src), m.training)
        if isinstance(m, torch.fx.GraphModule):
            put(m.code)  # generated classes: their code is the graph, not the file they name
        if "forward" in vars(m):
            return None  # a forward patched onto the instance: not in any source file
        for attr, v in sorted(vars(m).items()):
            if isinstance(v, torch.Tensor):  # plain tensor attributes become export constants
                put(attr)
                tensor(v)
            elif not attr.startswith("_") and (plain := _plain(v)) is not None:
                put(attr, repr(plain))
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        put(name)
        tensor(t)
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    put(spec)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            put("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type)
        else:
            put("value", type(leaf).__name__, repr(leaf))
    return h.hexdigest()


def _dim_spec(v: Any) -> Any:
    """``dynamic_shapes`` as key material: each ``Dim`` by its name and range."""
    if isinstance(v, Mapping):
        return tuple((str(k), _dim_spec(x)) for k, x in v.items())
    if isinstance(v, (tuple, list)):
        return tuple(_dim_spec(x) for x in v)
    if hasattr(v, "__name__") and hasattr(v, "min"):
        return ("Dim", v.__name__, v.min, v.max)
    return repr(v)


def dynamic_key(k: str, dynamic_shapes: Any) -> str:
    """The key of compiling with ``dynamic_shapes``: the static key ``k`` and the declared dims."""
    return hashlib.sha256(f"{k}\0dynamic\0{_dim_spec(dynamic_shapes)!r}".encode()).hexdigest()


def binding_key(k: str, binding: Sequence[tuple[str, int]]) -> str:
    """The entry of one binding of the sizes (``batch=3, seq=7``) of the module keyed ``k``."""
    return hashlib.sha256(f"{k}\0binding\0{tuple(binding)!r}".encode()).hexdigest()


def lookup(k: str) -> Any:
    """The cached module for key ``k``, or None (a corrupted entry is deleted, and None returned)."""
    root = cache_root()
    if root is None or not (root / k).is_dir():
        return None
    from sextant.runtime.artifact import load

    try:
        compiled = load(root / k)
    except ArtifactError as e:
        log.warning("sextant: compile cache entry %s is corrupted (%s); rebuilding it", k[:12], e)
        shutil.rmtree(root / k, ignore_errors=True)
        return None
    os.utime(root / k)  # recently used
    compiled.stages["cache"] = {"key": k, "hit": True, "path": root / k}
    return compiled


def store(k: str, compiled: Any) -> None:
    """Save ``compiled`` as the entry for ``k`` (atomically: a temporary directory renamed into place)."""
    root = cache_root()
    if root is None or compiled.target not in CACHED_TARGETS:
        return
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{k[:12]}-", dir=root))
    try:
        compiled.save(tmp)
        os.rename(tmp, root / k)  # atomic; fails if another process stored the same key first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # the other writer's entry is as good as ours
    except Exception as e:  # a module the artifact format cannot hold is simply not cached
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("sextant: not caching this module: %s: %s", type(e).__name__, e)
        return
    compiled.stages["cache"] = {"key": k, "hit": False, "path": root / k}
    _prune(root)


def _prune(root: Path) -> None:
    """Least recently used entries go once the cache exceeds ``SEXTANT_COMPILE_CACHE_MAX_MB`` (default 2048)."""
    limit = int(float(os.environ.get("SEXTANT_COMPILE_CACHE_MAX_MB", "2048")) * 2**20)
    entries = []
    for d in root.iterdir():
        if d.is_dir() and not d.name.startswith("."):
            entries.append((d.stat().st_mtime, sum(f.stat().st_size for f in d.iterdir()), d))
    total = sum(size for _, size, _ in entries)
    for _, size, d in sorted(entries):
        if total <= limit:
            break
        shutil.rmtree(d, ignore_errors=True)
        total -= size
