"""Real MXFP4 inference: packed weights and Triton W4A4 kernels (CPU: the reference path)."""

from torq.kernels.experts import PackedMXFP4Experts, grouped_gemv_i8
from torq.kernels.linear import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    KernelConfig,
    MXFP4Weight,
    PackedMXFP4Linear,
    mxfp4_linear,
    quantize_activation,
    reference_linear,
)

__all__ = [
    "DECODE_CONFIG",
    "PREFILL_CONFIG",
    "KernelConfig",
    "MXFP4Weight",
    "PackedMXFP4Experts",
    "PackedMXFP4Linear",
    "grouped_gemv_i8",
    "mxfp4_linear",
    "quantize_activation",
    "reference_linear",
]
