"""The six element types of sextant's graph IR and their torch equivalents."""

from __future__ import annotations

import enum

import torch

_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "bool": 1}


class DType(enum.Enum):
    """Element type of a tensor value. The value is the textual name used by the printer."""

    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    i32 = "i32"
    i64 = "i64"
    bool = "bool"

    # members are singletons: hash by identity in C instead of Enum's Python-level hash of the
    # name (kernel-IR expressions carry a dtype and are hashed constantly by the simplifier)
    __hash__ = object.__hash__

    def __init__(self, name: str) -> None:
        # plain attributes rather than properties: range analysis and the simplifier ask for
        # them millions of times while scheduling a model
        self.itemsize: int = _ITEMSIZE[name]
        self.is_float: bool = name in ("f32", "f16", "bf16")
        self.is_int: bool = name in ("i32", "i64")

    @property
    def torch(self) -> torch.dtype:
        return _TO_TORCH[self]

    @staticmethod
    def from_torch(dt: torch.dtype) -> DType:
        try:
            return _FROM_TORCH[dt]
        except KeyError:
            supported = ", ".join(str(d).removeprefix("torch.") for d in _FROM_TORCH)
            raise TypeError(f"dtype {dt} is not supported by sextant (supported: {supported})") from None

    def __repr__(self) -> str:
        return f"DType.{self.value}"


_TO_TORCH = {
    DType.f32: torch.float32,
    DType.f16: torch.float16,
    DType.bf16: torch.bfloat16,
    DType.i32: torch.int32,
    DType.i64: torch.int64,
    DType.bool: torch.bool,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
