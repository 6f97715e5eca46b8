"""The mapping of a fused ``attention`` group: which kernel computes it on which target.

The CPU runs a flash-attention loop nest shaped for its vector registers (``cpu_attention``).
The GPU runs a decode step — a few query rows against many keys — as split-key partials and
their combine (``gpu_flash_decoding``, f16/bf16/f32 on CUDA cores), and everything else on the
tensor-core flash kernel (``gpu_flash_attention``) — on sm_90a the Hopper one
(``gpu_wgmma_attention``: wgmma fed by TMA) where its operands allow. The GPU only fuses what
one of them can compute: ``attention_refusal`` tells the fusion so, and the dump records the
reason for the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from sextant.kernel.ir import Kernel
from sextant.schedule.attention_match import Attention
from sextant.schedule.cpu_attention import cpu_attention_kernel
from sextant.schedule.gpu_flash_attention import flash_refusal, gpu_flash_attention_kernel
from sextant.schedule.gpu_flash_decoding import decode_plan, gpu_flash_decoding
from sextant.schedule.gpu_wgmma_attention import gpu_wgmma_attention_kernel, wgmma_attention_refusal
from sextant.schedule.kernels import KernelChain
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc


def attention_refusal(target: TargetDesc) -> Callable[[Attention], str | None] | None:
    """The target's reason not to fuse an attention chain (None: it fuses every chain)."""
    if not target.is_gpu:
        return None
    return lambda att: None if decode_plan(att, target) is not None else flash_refusal(att, target)


def attention_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel | KernelChain:
    if target.is_gpu:
        assert group.attention is not None
        if decode_plan(group.attention, target) is not None:
            return gpu_flash_decoding(group, stored, target, name)
        if wgmma_attention_refusal(group.attention, target) is None:
            kernel = gpu_wgmma_attention_kernel(group, stored, target, name)
            if kernel is not None:  # (None: an operand TMA cannot describe)
                return kernel
        return gpu_flash_attention_kernel(group, stored, target, name)
    return cpu_attention_kernel(group, stored, target, name)
