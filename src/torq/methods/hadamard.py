"""Block-Hadamard baselines: an online Hadamard on each group of ``g`` input channels.

Every decoder-linear input is multiplied, group by group, by a normalized Hadamard matrix
``H_g`` before quantization, and the inverse is fused into the weight (``W' = W Tᵀ``):

* ``had32``: ``g = 32``, aligned with the MX blocks (BRQ-style): it spreads each block's
  energy over that block only. The "online 32-block Hadamard" reference of the TORQ issue.
* ``had128``: ``g = 128`` where it divides the width; otherwise the largest multiple of 32
  below 128 that divides the width and has a Hadamard matrix (SmolLM2's 576: 96). The
  group actually used is recorded per layer.
* ``hadfull``: ``g`` = the full width (QuaRot's online Hadamard; applied through its
  Kronecker factors, e.g. 1536 = 4·384).

The matrices come from :mod:`torq.rotations.hadamard` (Sylvester, Paley and Kronecker
constructions), which covers the non-power-of-two widths of our models (576, 896, 1536,
4864); the maintained implementations we know (``scipy.linalg.hadamard``, the CUDA
``fast-hadamard-transform``) handle powers of two only.
"""

from __future__ import annotations

from functools import cache
from typing import Any, ClassVar

from torch import nn

from torq.calibration.data import CalibrationConfig
from torq.errors import TorqError
from torq.methods.gptq import (
    FixedTransformSolver,
    calibrated_apply,
    gptq_calibration,
    gptq_config,
)
from torq.methods.registry import Method, MethodContext, register_method
from torq.rotations.hadamard import hadamard_factors, hadamard_matrix, has_hadamard
from torq.rotations.transform import BlockRotation, fuse_inverse_into_weight
from torq.surgery.apply import quantize_model
from torq.surgery.qlinear import QuantConfig


def hadamard_group(width: int, target: int | None) -> int:
    """The group size for ``width``: ``target`` if it divides the width, else the largest
    multiple of 32 below it that divides the width and has a Hadamard matrix; ``None``
    means the full width."""
    if target is None:
        if not has_hadamard(width):
            raise TorqError(f"no Hadamard matrix of order {width} is known")
        return width
    for g in range(target, 0, -32):
        if width % g == 0 and has_hadamard(g):
            return g
    raise TorqError(f"input width {width} has no Hadamard group of at most {target}")


# Above this order a Kronecker-factored Hadamard is applied factor by factor; below it one
# dense product is as fast on a CPU (fewer, larger matrix products).
FACTORED_ABOVE = 256


def hadamard_rotation(group: int) -> BlockRotation:
    """The online normalized Hadamard ``x ↦ H_g x`` on each group of ``g`` channels; large
    orders are applied through their Kronecker factors (:func:`hadamard_factors`), the
    same matrix at ``O(g·Σ fᵢ)`` instead of ``O(g²)`` per group."""
    factors = hadamard_factors(group) if group > FACTORED_ABOVE else None
    return BlockRotation(group, None, hadamard_matrix(group), intra_factors=factors)


@cache
def _block_hadamard(width: int, group: int) -> BlockRotation:
    return hadamard_rotation(group)


class _BlockHadamard(Method):
    group_size: ClassVar[int | None] = 32
    supports_gptq = True

    def transform_for(self, width: int) -> BlockRotation:
        return _block_hadamard(width, hadamard_group(width, self.group_size))

    def calibration(self, ctx: MethodContext) -> CalibrationConfig | None:
        return gptq_calibration(self, ctx)

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        groups: dict[int, int] = {}

        def transform_for(width: int) -> BlockRotation:
            t = self.transform_for(width)
            groups[width] = t.block_size
            return t

        if self.gptq_enabled:
            cfg = gptq_config(ctx)
            solver = FixedTransformSolver(transform_for, config, cfg)
            rec = calibrated_apply(model, config, ctx, solver)
            return {"group_by_width": groups, "gptq": cfg.__dict__, **rec}

        def factory(name: str, linear: nn.Linear) -> nn.Module:
            transform = transform_for(linear.in_features)
            linear.weight.data = fuse_inverse_into_weight(linear.weight, transform)
            return transform

        replaced = quantize_model(model, config, factory)
        return {"group_by_width": groups, "replaced": replaced}


@register_method
class Hadamard32(_BlockHadamard):
    """Online block-diagonal Hadamard, group 32 (aligned with the MX blocks)."""

    name = "had32"
    description = "online Hadamard on each 32-element block, inverse fused into the weights"
    group_size = 32


@register_method
class Hadamard128(_BlockHadamard):
    """Online block-diagonal Hadamard, group 128 (or the largest valid group below)."""

    name = "had128"
    description = "online Hadamard on groups of 128 channels (largest valid group <= 128)"
    group_size = 128


@register_method
class HadamardFull(_BlockHadamard):
    """Online Hadamard over the full input width (dense)."""

    name = "hadfull"
    description = "online Hadamard over the full input width, inverse fused into the weights"
    group_size = None
