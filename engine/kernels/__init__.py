"""Batch-invariant Triton kernels for the int8 GPU path, each with a torch reference fallback.

Every public function takes `backend="auto" | "triton" | "torch"`: "auto" runs the kernel on
CUDA tensors and the torch reference elsewhere; "triton" on CPU runs the kernel body in
Triton's interpreter (needs `TRITON_INTERPRET=1` before triton's first import; tests do that).
Configs are fixed (never chosen by timing), so results never depend on batch composition.
"""

from engine.kernels.gate_up import interleave_gate_up, split_gate_up
from engine.kernels.int8_gemm import (
    GemmConfig,
    config_for,
    int8_gemm,
    int8_gemm_reference,
    int8_gemm_swiglu,
    int8_gemm_swiglu_quantize,
    int8_gemm_swiglu_reference,
    int8_matmul_exact,
    scale_int32,
    swiglu_config_for,
    swiglu_fused,
)
from engine.kernels.quant import (
    quantize_rows,
    quantize_rows_reference,
    rms_norm_fp32,
    rms_norm_quantize,
    rms_norm_quantize_reference,
)

__all__ = [
    "GemmConfig",
    "config_for",
    "int8_gemm",
    "int8_gemm_reference",
    "int8_gemm_swiglu",
    "int8_gemm_swiglu_quantize",
    "int8_gemm_swiglu_reference",
    "int8_matmul_exact",
    "interleave_gate_up",
    "scale_int32",
    "split_gate_up",
    "swiglu_config_for",
    "swiglu_fused",
    "quantize_rows",
    "quantize_rows_reference",
    "rms_norm_fp32",
    "rms_norm_quantize",
    "rms_norm_quantize_reference",
]
