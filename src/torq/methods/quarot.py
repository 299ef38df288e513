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

from torq.methods.hadamard import block_hadamard
from torq.methods.registry import Method, MethodContext, TransformBuilder, register
from torq.rotations.hadamard import hadamard_matrix
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


class QuaRotTransform(TransformBuilder):
    """QuaRot's rotations: the residual and head rotations over the whole model first
    (:meth:`prelude`, so QuaRot does not stream), then the online full-width Hadamard on
    down_proj's input (the only input of the intermediate width)."""

    def __init__(self) -> None:
        self.intermediate: int | None = None

    def prelude(self, model: nn.Module, qconfig: QuantConfig, ctx: MethodContext) -> dict:
        self.intermediate = model.config.intermediate_size
        return apply_quarot_rotations(model, int(ctx.options.get("seed", 0)))

    def fixed(self, width: int, qconfig: QuantConfig, ctx: MethodContext) -> nn.Module | None:
        # one module for every layer (cached), as the export stores each transform once
        return block_hadamard(width, width) if width == self.intermediate else None

    def key_settings(self, run: dict[str, Any]) -> dict[str, Any]:
        # the random signs follow the run's seed; "signs" marks QuaRot's Q = diag(s)·H, so
        # models kept or carried from torq's earlier H·diag(s) (whose signs had no effect,
        # docs/RESULTS.md §6.1) are never taken for this one
        return {"seed": run.get("seed", 0), "signs": "before-hadamard"}


QUAROT = register(
    Method(
        "quarot",
        "QuaRot: fused random-Hadamard residual + head rotations, online Hadamard at down_proj",
        QuaRotTransform(),
    )
)
