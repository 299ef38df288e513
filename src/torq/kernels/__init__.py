"""Real MXFP4 inference: packed weights and Triton W4A4 kernels (CPU: the reference path)."""

from torq.kernels.config import DECODE_CONFIG, PREFILL_CONFIG, KernelConfig
from torq.kernels.dispatch import mxfp4_linear, reference_linear
from torq.kernels.experts import PackedMXFP4Experts, grouped_gemv_i8
from torq.kernels.launch import quantize_activation
from torq.kernels.linear import PackedMXFP4Linear
from torq.kernels.weight import MXFP4Weight

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
