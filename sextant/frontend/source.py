"""Map an FX node back to the user's source line, from torch.export's recorded stack trace."""

from __future__ import annotations

import os
import re

import torch
import torch.fx

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)\n(?P<code>[^\n]*)')


def user_frame(node: torch.fx.Node) -> tuple[str, int, str] | None:
    """(file, line, code) of the innermost frame outside torch itself, or None if unknown."""
    trace = node.meta.get("stack_trace") or ""
    frames = [(m["file"], int(m["line"]), m["code"].strip()) for m in _FRAME.finditer(trace)]
    for f in reversed(frames):
        if not f[0].startswith(_TORCH_DIR):
            return f
    return frames[-1] if frames else None


def short_loc(node: torch.fx.Node) -> str | None:
    """"file.py:LINE" for the IR's loc(...) annotations."""
    f = user_frame(node)
    return f"{os.path.basename(f[0])}:{f[1]}" if f else None


def module_path(node: torch.fx.Node) -> str:
    """The nn.Module the op came from, e.g. "blocks.0.attn (Attention)"."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    cls_name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
    path = re.sub(r"L\['self'\]\.?", "", str(path)) or "<root>"
    return f"{path} ({cls_name})"
