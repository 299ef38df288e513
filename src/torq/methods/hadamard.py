"""Block-Hadamard baseline (BRQ-style): an online Hadamard on each 32-element block.

Every decoder-linear input is multiplied, block by block, by a normalized Hadamard matrix
``H_g`` before quantization, and the inverse is fused into the weight (``W' = W Tᵀ``). With
``g`` equal to the MX block size the transform is block-aligned: it spreads each block's
energy over that block only. This is the "online 32-block Hadamard" reference point of the
TORQ issue.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from torq.errors import TorqError
from torq.methods.gptq import FixedTransformSolver, calibrated_apply, gptq_config
from torq.methods.registry import Method, MethodContext, register_method
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import BlockRotation, fuse_inverse_into_weight
from torq.surgery.apply import quantize_model
from torq.surgery.qlinear import QuantConfig


class _BlockHadamard(Method):
    group_size: ClassVar[int] = 32
    supports_gptq = True

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        g = self.group_size
        transform = BlockRotation(g, None, hadamard_matrix(g))
        if self.gptq_enabled:
            cfg = gptq_config(ctx)

            def transform_for(width: int) -> nn.Module:
                if width % g:
                    raise TorqError(f"input width {width} is not a multiple of {g}")
                return transform

            solver = FixedTransformSolver(transform_for, config, cfg)
            return {
                "group_size": g,
                "gptq": cfg.__dict__,
                **calibrated_apply(model, config, ctx, solver),
            }

        def factory(name: str, linear: nn.Linear) -> nn.Module:
            if linear.in_features % g:
                raise TorqError(
                    f"{name}: input width {linear.in_features} is not a multiple of {g}"
                )
            linear.weight.data = fuse_inverse_into_weight(linear.weight, transform)
            return transform

        return {"group_size": g, "replaced": quantize_model(model, config, factory)}


@register_method
class Hadamard32(_BlockHadamard):
    """Online block-diagonal Hadamard, group 32 (aligned with the MX blocks)."""

    name = "had32"
    description = "online Hadamard on each 32-element block, inverse fused into the weights"
    group_size = 32
