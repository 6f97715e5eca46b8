"""The mapping of a fused ``attention`` group: which kernel computes it on which target.

The CPU runs a flash-attention loop nest shaped for its vector registers (``cpu_attention``).
The GPU runs the tensor-core flash kernel (``gpu_flash_attention``) when both products can use
``mma.sync`` (f16/bf16 operands, head sizes a multiple of 16, sm_80+), and otherwise (f32, other
head sizes, older GPUs) the one-row-per-thread online-softmax kernel (``attention_rows``).
"""

from __future__ import annotations

from sextant.kernel.ir import Kernel
from sextant.schedule.attention_rows import rows_attention_kernel
from sextant.schedule.cpu_attention import cpu_attention_kernel
from sextant.schedule.partition import Group
from sextant.schedule.target import TargetDesc


def attention_kernel(group: Group, stored: set[int], target: TargetDesc, name: str) -> Kernel:
    if target.is_gpu:
        from sextant.schedule.gpu_flash_attention import flash_refusal, gpu_flash_attention_kernel

        why = flash_refusal(group, target)
        if why is None:
            return gpu_flash_attention_kernel(group, stored, target, name)
        kernel = rows_attention_kernel(group, stored, target, name)
        kernel.meta["tensor_cores"] = f"no: {why}"
        return kernel
    return cpu_attention_kernel(group, stored, target, name)
