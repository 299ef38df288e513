"""Block-Hadamard baselines: an online Hadamard on each group of ``g`` input channels.

Every decoder-linear input is multiplied, group by group, by a normalized Hadamard matrix
``H_g`` before quantization, and the inverse is fused into the weight (``W' = W Tᵀ``):

* ``had32``: ``g = 32``, aligned with the MX blocks (BRQ-style): it spreads each block's
  energy over that block only. The "online 32-block Hadamard" reference of the TORQ issue.
* ``had16``: ``g = 16``, aligned with NVFP4's blocks of 16 (in MXFP4 two groups per block).
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

from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import nn

from torq.calibration.capture import BlockStatistics, LinearGroup
from torq.errors import TorqError
from torq.knobs import knob
from torq.methods.registry import Method, MethodContext, RunKey, TransformBuilder, register
from torq.methods.settings import EXPERTS_MEMBER, linear_names, names_a_member
from torq.rotations.hadamard import hadamard_factors, hadamard_matrix, has_hadamard
from torq.rotations.transform import BlockRotation
from torq.surgery.fusion import RESIDUAL_READERS, ResidualRotation, block_hadamard_residual
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
def block_hadamard(width: int, group: int) -> BlockRotation:
    """:func:`hadamard_rotation` of ``group``, one module per (width, group) for the whole
    process: every layer of a width shares it (the export stores each transform once)."""
    return hadamard_rotation(group)


@dataclass(frozen=True)
class HadamardSettings:
    """The block Hadamard's own settings."""

    # the linears, by their name within a decoder layer ("q_proj"), that get no Hadamard
    # (calibrating, with GPTQ's weights: the group of linears reading one input, when it
    # names one of them): vLLM runs no transform on a linear with a bias (Qwen2's q/k/v).
    # ``None``: every linear gets it
    unrotated: tuple[str, ...] | None = knob(None, flag="--unrotated", help=None)
    # the inputs of the linears reading a norm's output (q/k/v, gate/up) rotated offline, by
    # the block Hadamard of the residual stream fused into the weights (the norms' weights
    # folded into their readers), not online: none of them runs a transform, so vLLM
    # serves a q/k/v with a bias rotated. The other inputs (o_proj, down_proj) keep theirs
    residual: bool = knob(False, flag="--residual-hadamard", help=None)

    def __post_init__(self) -> None:
        if self.unrotated is not None:
            names = linear_names(self.unrotated, "unrotated", "get no Hadamard (e.g. q_proj)")
            object.__setattr__(self, "unrotated", names)


class BlockHadamard(TransformBuilder):
    """The online block-diagonal Hadamard of groups of ``group_size`` channels (``None``:
    the full width), :func:`hadamard_group` choosing the group for each width; none on the
    linears its settings leave ``unrotated``."""

    settings_type = HadamardSettings

    def __init__(self, group_size: int | None) -> None:
        self.group_size = group_size
        self.groups: dict[int, int] = {}  # width → group actually used (recorded)

    def fixed(self, width: int, qconfig: QuantConfig, ctx: MethodContext) -> BlockRotation:
        transform = block_hadamard(width, hadamard_group(width, self.group_size))
        self.groups[width] = transform.block_size
        return transform

    @staticmethod
    def _unrotated(ctx: MethodContext) -> tuple[str, ...] | None:
        unrotated = getattr(ctx.settings, "unrotated", None)
        if getattr(ctx.settings, "residual", False):  # rotated offline, through the stream
            return (*(unrotated or ()), *RESIDUAL_READERS)
        return unrotated

    def residual(self, ctx: MethodContext) -> ResidualRotation | None:
        if not getattr(ctx.settings, "residual", False):
            return None
        if ctx.model_config is None:
            raise TorqError("the residual Hadamard needs the model's configuration")
        width = ctx.model_config.hidden_size
        return block_hadamard_residual(width, hadamard_group(width, self.group_size))

    def fixed_for(
        self, name: str, width: int, qconfig: QuantConfig, ctx: MethodContext
    ) -> BlockRotation | None:
        if names_a_member(self._unrotated(ctx), [name]):
            return None
        return self.fixed(width, qconfig, ctx)

    def for_group(
        self,
        group: LinearGroup,
        stats: BlockStatistics,
        weight: Any,
        qconfig: QuantConfig,
        ctx: MethodContext,
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        if names_a_member(self._unrotated(ctx), group.members):
            return None, {"unrotated": True}
        return self.fixed(group.width, qconfig, ctx), {}

    def key_settings(
        self, run: RunKey, settings: dict[str, Any] | None, capture: dict[str, Any]
    ) -> dict[str, Any]:
        # absent when every linear is rotated, so the keys made before settings stay
        unrotated = (settings or {}).get("unrotated")
        key: dict[str, Any] = {} if unrotated is None else {"unrotated": list(unrotated)}
        if (settings or {}).get("residual"):
            key["residual"] = True
        return key

    def experts_online(self, qconfig: QuantConfig, ctx: MethodContext) -> bool:
        return not names_a_member(self._unrotated(ctx), [EXPERTS_MEMBER])

    def compressed_tensors(self, qconfig: QuantConfig, ctx: MethodContext) -> str | None:
        if self.group_size == 32:
            return None
        return "compressed-tensors holds the 32-block Hadamard only (had32)"

    def record(self, qconfig: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        # a new dict per plan, filled as its layers are quantized (an earlier row keeps its own)
        self.groups = {}
        return {"group_by_width": self.groups}


# BRQ-style, aligned with the MX blocks: the "online 32-block Hadamard" reference.
HAD32 = register(
    Method(
        "had32",
        "online Hadamard on each 32-element block, inverse fused into the weights",
        BlockHadamard(32),
    )
)
# aligned with NVFP4's 16-element blocks: whether H₃₂'s loss in NVFP4 came from its block
# size (it did not: both are worse than RTN there, docs/research/paper-tables.md §12.2)
HAD16 = register(
    Method(
        "had16",
        "online Hadamard on each 16-element block (NVFP4's block), inverse fused into the weights",
        BlockHadamard(16),
    )
)
HAD128 = register(
    Method(
        "had128",
        "online Hadamard on groups of 128 channels (largest valid group <= 128)",
        BlockHadamard(128),
    )
)
HADFULL = register(
    Method(
        "hadfull",
        "online Hadamard over the full input width, inverse fused into the weights",
        BlockHadamard(None),
    )
)
