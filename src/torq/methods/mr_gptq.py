"""MR-GPTQ (Egiazarian et al., 2025, "Bridging the Gap Between Promise and Performance for
Microscaling FP4 Quantization"; FP-Quant): the strongest published MXFP4 recipe, as a
baseline row. A Hadamard on each block of the weight format (the "micro-rotation": 32
elements in MXFP4, 16 in NVFP4), its inverse fused into the weights, then GPTQ weights with
static activation order (columns by decreasing Hessian diagonal, every block's scale fitted
from the original weights first) and MSE-chosen scales (each block's scale of the three
around the format's rule, powers of two in MX and neighbouring E4M3 values in NVFP4, with
the least ``Σ |w − q|^2.4``: :class:`~torq.surgery.gptq.GPTQConfig`). Activations: the
run's format and scale rule, as for every method. Written from the paper's and FP-Quant's
description; not torq's channel balancing.
"""

from __future__ import annotations

from torq.methods.hadamard import BlockHadamard, block_hadamard, hadamard_group
from torq.methods.registry import Method, MethodContext, register
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import QuantConfig


class FormatBlockHadamard(BlockHadamard):
    """The online Hadamard on each block of the weight format (32 where there is none)."""

    def __init__(self) -> None:
        super().__init__(32)

    @staticmethod
    def _block(qconfig: QuantConfig) -> int:
        return qconfig.weight.block_size if qconfig.weight is not None else 32

    def fixed(self, width: int, qconfig: QuantConfig, ctx: MethodContext) -> BlockRotation:
        transform = block_hadamard(width, hadamard_group(width, self._block(qconfig)))
        self.groups[width] = transform.block_size
        return transform

    def compressed_tensors(self, qconfig: QuantConfig, ctx: MethodContext) -> str | None:
        if self._block(qconfig) == 32:
            return None
        return "compressed-tensors holds the 32-block Hadamard only (had32)"


MR_GPTQ = register(
    Method(
        "mr-gptq",
        "MR-GPTQ: online Hadamard on each block of the format (32; NVFP4: 16), GPTQ weights "
        "with static act-order and MSE-chosen block scales",
        FormatBlockHadamard(),
        weights="gptq",
        gptq_settings=(("act_order", True), ("scale_search", "mse")),
    )
)
