"""WUSH: a closed-form, data-aware block transform of each input group (IST-DASLab,
ICML 2026), ``T_b = H Λ^{-1/4} Uᵀ Lᵀ`` per block of 32 channels from the group's weight
Gram and its inputs' second moment (:func:`torq.rotations.block_transform.wush_matrices`).
It is not orthogonal: the weights take ``T⁻¹``. ``wush+gptq`` gives it GPTQ weights, as
WUSH's paper pairs it; compressed-tensors cannot hold it (one matrix per block)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torq.calibration.capture import BlockStatistics, LinearGroup
from torq.methods.hadamard import block_hadamard
from torq.methods.registry import Method, MethodContext, TransformBuilder, register
from torq.rotations.block_transform import BlockMatrices, block_grams, wush_matrices
from torq.surgery.qlinear import QuantConfig

WUSH_BLOCK = 32  # the MX block: each block's scale sees exactly one transform


class WushTransform(TransformBuilder):
    """WUSH's block transform of each input group, from its inputs' second moment (the
    capture's ``Σ x xᵀ``) and its members' weights."""

    calibrates = True

    def needs_hessian(self, ctx: MethodContext) -> bool:
        return True  # WUSH's transform is built from the second moment itself

    def for_group(
        self,
        group: LinearGroup,
        stats: BlockStatistics,
        weight: torch.Tensor,
        qconfig: QuantConfig,
        ctx: MethodContext,
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        if stats.xtx is None or group.width % WUSH_BLOCK:  # (experts' pooled inputs)
            return block_hadamard(group.width, WUSH_BLOCK), {"wush": "hadamard fallback"}
        w = weight.detach().to(torch.float64)
        # the Grams where the weight and the sums are (a GPU's); the small per-block
        # matrices on the CPU, where the transforms are built
        weight_gram = block_grams(w.T @ w / w.shape[0], WUSH_BLOCK).cpu()
        act_gram = block_grams(stats.hessian(), WUSH_BLOCK).cpu()
        matrices = wush_matrices(weight_gram, act_gram)
        cond = torch.linalg.cond(matrices)
        return BlockMatrices(matrices), {"wush": {"max_condition": float(cond.max())}}

    def compressed_tensors(self, qconfig: QuantConfig, ctx: MethodContext) -> str | None:
        return (
            "WUSH's data-aware block transforms have no compressed-tensors form (transformers "
            "and vLLM apply only fixed Hadamard transforms)"
        )


WUSH = register(
    Method(
        "wush",
        "WUSH: a data-aware block transform per input group (32-channel blocks, Hadamard "
        "backbone, weight and activation Grams balanced), inverse fused (RTN weights)",
        WushTransform(),
    )
)
