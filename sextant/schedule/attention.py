"""The mapping of a fused ``attention`` group: which kernel computes it on which target.

The CPU runs a flash-attention loop nest shaped for its vector registers (``cpu_attention``);
the GPU the tensor-core flash kernel (``gpu_flash_attention``). The GPU only fuses what that
kernel can compute (f16/bf16, head sizes a multiple of 16, sm_80+): ``attention_refusal`` tells
the fusion so, and the dump records the reason for the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from sextant.kernel.ir import Kernel
from sextant.schedule.attention_match import Attention
from sextant.schedule.cpu_attention import cpu_attention_kernel
from sextant.schedule.gpu_flash_attention import flash_refusal, gpu_flash_attention_kernel
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc


def attention_refusal(target: TargetDesc) -> Callable[[Attention], str | None] | None:
    """The target's reason not to fuse an attention chain (None: it fuses every chain)."""
    return (lambda att: flash_refusal(att, target)) if target.is_gpu else None


def attention_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    if target.is_gpu:
        return gpu_flash_attention_kernel(group, stored, target, name)
    return cpu_attention_kernel(group, stored, target, name)
