"""MR-GPTQ (Egiazarian et al., 2025, "Bridging the Gap Between Promise and Performance for
Microscaling FP4 Quantization"; FP-Quant): the strongest published MXFP4 recipe, as a
baseline row. A Hadamard on each 32-element block (the MX block: "micro-rotated"), its
inverse fused into the weights, then GPTQ weights with static activation order (columns by
decreasing Hessian diagonal, every block's scale fitted from the original weights first) and
MSE-chosen scales (each block's power-of-two scale of the three around the format's rule
with the least ``Σ |w − q|^2.4``: :class:`~torq.surgery.gptq.GPTQConfig`). Activations: the
run's format and scale rule, as for every method. Written from the paper's and FP-Quant's
description; not torq's channel balancing.
"""

from __future__ import annotations

from torq.methods.hadamard import BlockHadamard
from torq.methods.registry import Method, register

MR_GPTQ = register(
    Method(
        "mr-gptq",
        "MR-GPTQ: online 32-block Hadamard, GPTQ weights with static act-order and "
        "MSE-chosen block scales",
        BlockHadamard(32),
        weights="gptq",
        gptq_settings=(("act_order", True), ("scale_search", "mse")),
    )
)
