"""Where NVIDIA's command-line tools are found: one search for ptxas, nvdisasm and cuobjdump.

None of them needs a GPU. They come with a CUDA toolkit (``PATH``, ``$CUDA_HOME/bin``,
``$CUDA_PATH/bin``, ``/usr/local/cuda/bin``) or from PyPI wheels (``nvidia-cuda-nvcc`` ships
ptxas, ``nvidia-cuda-nvdisasm`` nvdisasm), which install under the ``nvidia`` namespace package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

TOOLKIT_DIRS = ("/usr/local/cuda/bin",)
# bin folders inside the nvidia namespace package: CUDA 13 wheels, then the older per-package layout
WHEEL_DIRS = ("cu13/bin", "cu12/bin", "cuda_nvcc/bin", "cuda_nvdisasm/bin", "cuda_cuobjdump/bin")


def find_cuda_tool(name: str, wheel_dirs: Sequence[str] = WHEEL_DIRS) -> Path | None:
    """The executable ``name`` from PATH, the CUDA toolkit or an nvidia-* wheel; None if absent."""
    found = shutil.which(name)
    if found:
        return Path(found)
    dirs = [os.path.join(os.environ[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    candidates = [Path(d) / name for d in (*dirs, *TOOLKIT_DIRS)]
    candidates += [Path(r) / w / name for r in roots for w in wheel_dirs]
    return next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)
