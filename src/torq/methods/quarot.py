"""QuaRot (Ashkboos et al., 2024) as its paper defines it, on torq's fusion machinery.

Offline: RMSNorm weights folded into the following linears, embeddings untied, the residual
stream rotated by a randomized Hadamard ``Q = H diag(s)/√d`` fused into the embedding,
every linear that reads or writes the stream, and lm_head; each attention head's value /
output space rotated by a Hadamard of the head dimension (v_proj / o_proj). Online: a
full-width Hadamard before down_proj, its inverse fused into down_proj. Then RTN (or,
as ``quarot+gptq``, GPTQ) weights and RTN activations. The KV cache is not quantized here,
as everywhere in torq.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torq.calibration.data import CalibrationConfig
from torq.methods.gptq import (
    FixedTransformSolver,
    calibrated_apply,
    gptq_calibration,
    gptq_config,
)
from torq.methods.hadamard import hadamard_rotation
from torq.methods.registry import Method, MethodContext, register_method
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import fuse_inverse_into_weight
from torq.surgery.apply import quantize_model
from torq.surgery.fusion import (
    check_supported,
    fold_rmsnorms,
    random_hadamard,
    rotate_heads,
    rotate_residual,
    untie_embeddings,
)
from torq.surgery.qlinear import QuantConfig


def apply_quarot_rotations(model: nn.Module, seed: int = 0) -> dict[str, Any]:
    """The offline part of QuaRot, in place; the model computes the same function."""
    check_supported(model)
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tied = untie_embeddings(model)
    fold_rmsnorms(model)
    rotate_residual(model, random_hadamard(cfg.hidden_size, seed))
    rotate_heads(model, hadamard_matrix(hd))
    return {"untied_embeddings": tied, "residual_width": cfg.hidden_size, "head_dim": hd}


@register_method
class QuaRot(Method):
    """QuaRot: residual and head rotations fused offline, online Hadamard before down_proj."""

    name = "quarot"
    description = (
        "QuaRot: fused random-Hadamard residual + head rotations, online Hadamard at down_proj"
    )
    supports_gptq = True

    def calibration(self, ctx: MethodContext) -> CalibrationConfig | None:
        return gptq_calibration(self, ctx)

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        seed = int(ctx.options.get("seed", 0))
        record = apply_quarot_rotations(model, seed)
        inter = model.config.intermediate_size
        down = hadamard_rotation(inter)

        def transform_for(width: int) -> nn.Module | None:
            return down if width == inter else None

        if self.gptq_enabled:
            cfg = gptq_config(ctx)
            solver = FixedTransformSolver(transform_for, config, cfg)
            return {**record, "gptq": cfg.__dict__, **calibrated_apply(model, config, ctx, solver)}

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            t = transform_for(linear.in_features) if name.endswith("down_proj") else None
            if t is not None:
                linear.weight.data = fuse_inverse_into_weight(linear.weight, t)
            return t

        return {**record, "replaced": quantize_model(model, config, factory)}
