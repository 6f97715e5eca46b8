"""Facts about GPU generations that the scheduler, the PTX code generator and the reports need.

Below all of them in the pipeline, so none imports another for them (``codegen/llvm_nvptx.py``
used to import ``schedule/target.py`` for the shared-memory limit, and ``schedule/gemm_cost.py``
the report's datasheet table)."""

from __future__ import annotations

from dataclasses import dataclass

from sextant.graph.dtypes import DType

TERA = 1e12

# Shared memory one block may use (CUDA's cudaDevAttrMaxSharedMemoryPerBlockOptin): 48 KiB
# static, the rest dynamic (codegen/llvm_nvptx.py switches a kernel over past 48 KiB).
_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def max_shared_bytes(sm: int) -> int:
    """The shared memory one block of compute capability ``sm`` (e.g. 90) may use, opted in."""
    return _SHARED.get(sm, 48 * 1024)


@dataclass(frozen=True)
class GpuSpec:
    """Peak rates of one GPU model (dense, boost clock), as NVIDIA publishes them."""

    name: str
    sms: int
    fp32_flops: float  # FLOP/s on CUDA cores (an FMA counts as 2)
    fp16_flops: float  # FLOP/s, non-tensor half precision
    bf16_flops: float  # FLOP/s, non-tensor bfloat16
    tensor_bf16_flops: float  # FLOP/s on tensor cores, dense (f16 and bf16 alike on these parts)
    bandwidth: float  # bytes/s of device memory
    memory_bytes: int
    source: str  # where the numbers come from

    def peak_flops(self, dtype: DType, tensor_core: bool = False) -> float:
        """The compute peak that applies to a kernel computing in ``dtype`` (integers: the fp32 rate),
        on tensor cores when ``tensor_core`` (f16/bf16 only)."""
        if tensor_core and dtype in (DType.f16, DType.bf16):
            return self.tensor_bf16_flops
        return {DType.f16: self.fp16_flops, DType.bf16: self.bf16_flops}.get(dtype, self.fp32_flops)

    def ridge(self, dtype: DType = DType.f32) -> float:
        """Arithmetic intensity (FLOP/byte) where the memory roof meets the compute roof."""
        return self.peak_flops(dtype) / self.bandwidth


# Datasheet numbers. A100: "NVIDIA A100 Tensor Core GPU" datasheet (A100 80GB SXM: FP32 19.5 TFLOPS,
# BF16 tensor 312 TFLOPS dense, 2,039 GB/s) and the "NVIDIA A100 Tensor Core GPU Architecture" whitepaper
# (108 SMs; non-tensor FP16 78 TFLOPS, BF16 39 TFLOPS). H100: "NVIDIA H100 Tensor Core GPU" datasheet
# (H100 SXM: FP32 67 TFLOPS, BF16 tensor 1,979 TFLOPS with sparsity = 989 dense, 3.35 TB/s, 80 GB) and
# the "NVIDIA H100 Tensor Core GPU Architecture" whitepaper (132 SMs; non-tensor FP16 and BF16 133.8
# TFLOPS, FP32 66.9). H200: "NVIDIA H200 Tensor Core GPU" datasheet (H200 SXM: FP32 67 TFLOPS, BF16
# tensor 1,979 sparse, 141 GB HBM3e at 4.8 TB/s); it is the same GH100 chip as H100 SXM (132 SMs), so
# its non-tensor half rates are H100 SXM's.
GPUS: dict[str, GpuSpec] = {
    "A100": GpuSpec("A100 SXM4 80GB", 108, 19.5 * TERA, 78 * TERA, 39 * TERA, 312 * TERA, 2039e9, 80 * 10**9,
                    "NVIDIA A100 datasheet and A100 architecture whitepaper"),
    "H100": GpuSpec("H100 SXM5 80GB", 132, 66.9 * TERA, 133.8 * TERA, 133.8 * TERA, 989.4 * TERA, 3.35e12,
                    80 * 10**9, "NVIDIA H100 datasheet and H100 architecture whitepaper"),
    "H200": GpuSpec("H200 SXM 141GB", 132, 66.9 * TERA, 133.8 * TERA, 133.8 * TERA, 989.4 * TERA, 4.8e12,
                    141 * 10**9, "NVIDIA H200 datasheet (compute rates of the same GH100 as H100 SXM)"),
}
