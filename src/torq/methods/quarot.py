"""QuaRot (Ashkboos et al., 2024) as its paper defines it, on torq's fusion machinery.

Offline: RMSNorm weights folded into the following linears, embeddings untied, the residual
stream rotated by a randomized Hadamard ``Q = diag(s) H/√d`` fused into the embedding,
every linear that reads or writes the stream, and lm_head; each attention head's value /
output space rotated by a Hadamard of the head dimension (v_proj / o_proj). Online: a
full-width Hadamard before down_proj, its inverse fused into down_proj. Then RTN (or,
as ``quarot+gptq``, GPTQ) weights and RTN activations. The KV cache is not quantized here,
as everywhere in torq. The signs ``s`` come from the run's ``--seed``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torq.errors import TorqError
from torq.methods.hadamard import block_hadamard
from torq.methods.registry import Method, MethodContext, RunKey, TransformBuilder, register
from torq.rotations.hadamard import hadamard_matrix
from torq.surgery.fusion import ResidualRotation, check_supported, random_hadamard
from torq.surgery.qlinear import QuantConfig


def quarot_rotation(config: Any, seed: int = 0) -> ResidualRotation:
    """QuaRot's offline rotations for a model of ``config``: the residual stream by
    ``Q = diag(s) H/√d`` (signs from ``seed``), each head's value/output space by ``H``."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ResidualRotation(random_hadamard(config.hidden_size, seed), hadamard_matrix(hd))


def apply_quarot_rotations(model: nn.Module, seed: int = 0) -> dict[str, Any]:
    """The offline part of QuaRot on a model in memory, in place; the model computes the
    same function."""
    check_supported(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    quarot_rotation(model.config, seed).whole(model)
    return {"untied_embeddings": tied}


def _config(ctx: MethodContext) -> Any:
    if ctx.model_config is None:
        raise TorqError("QuaRot needs the model's configuration (MethodContext.model_config)")
    return ctx.model_config


class QuaRotTransform(TransformBuilder):
    """QuaRot's rotations: the residual and head rotations fused into each part of the model
    as the driver loads it (:meth:`residual`, so QuaRot streams), then the online
    full-width Hadamard on down_proj's input (the only input of the intermediate width)."""

    def compressed_tensors(self, qconfig: QuantConfig, ctx: MethodContext) -> str | None:
        return "QuaRot's full-width Hadamard before down_proj has no compressed-tensors form yet"

    def residual(self, ctx: MethodContext) -> ResidualRotation:
        return quarot_rotation(_config(ctx), int(ctx.options.get("seed", 0)))

    def fixed(self, width: int, qconfig: QuantConfig, ctx: MethodContext) -> nn.Module | None:
        # one module for every layer (cached), as the export stores each transform once
        intermediate = _config(ctx).intermediate_size
        return block_hadamard(width, width) if width == intermediate else None

    def record(self, qconfig: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        config = _config(ctx)
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return {
            "residual_width": config.hidden_size,
            "head_dim": hd,
            "seed": int(ctx.options.get("seed", 0)),
        }

    def key_settings(
        self, run: RunKey, settings: dict[str, Any] | None, capture: dict[str, Any]
    ) -> dict[str, Any]:
        # the random signs follow the run's seed; "signs" marks QuaRot's Q = diag(s)·H, so
        # models kept or carried from torq's earlier H·diag(s) (whose signs had no effect,
        # docs/research/comparisons.md §6.1) are never taken for this one
        return {"seed": run.seed, "signs": "before-hadamard"}


QUAROT = register(
    Method(
        "quarot",
        "QuaRot: fused random-Hadamard residual + head rotations, online Hadamard at down_proj",
        QuaRotTransform(),
    )
)
