"""TORQ: the two-level orthogonal rotation, calibrated on real activations and fused.

For every group of linear layers that read the same tensor, the calibration statistics
give the inter-block rotations ``R_k`` (§5.1, Algorithm 1, from ``Σ_k``) and the intra-block
rotation ``R_intra`` (§5.2, Algorithm 2, from sampled blocks after the inter-block
rotation). The group's online transform ``T`` (inter, then intra) runs before activation
quantization; ``W' = W Tᵀ`` is fused into each member's weight, which is then quantized
(Algorithm 3, option B). ``torq-inter`` and ``torq-intra`` are the paper's ablations
(Table 3): one level only.

torq's addition (``balance``, on by default; ``balance=None`` is the paper's method): a
per-channel scale that balances activation and weight energy runs first
(:mod:`torq.rotations.balance`), and both rotations are fitted to the balanced statistics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from torq.calibration.capture import BlockStatistics, LinearGroup
from torq.calibration.data import CalibrationConfig
from torq.formats import FormatSpec, fake_quantize
from torq.methods.registry import Method, MethodContext, TransformBuilder, register
from torq.rotations.balance import balance_covariance, balance_scales, channel_energy
from torq.rotations.inter_block import InterBlockConfig, inter_block_rotations
from torq.rotations.intra_block import IntraBlockConfig, fit_intra_block_rotation
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import QuantConfig

# torq's defaults for Algorithm 2 where they differ from the paper's (identity start,
# K/2 candidate columns): start from the block Hadamard and let every column be a candidate.
# Measured in docs/RESULTS.md §3; ``paper_settings()`` restores the paper's reading.
TORQ_INTRA_DEFAULTS: dict[str, Any] = {"init": "hadamard", "k_top": 32}


@dataclass
class TorqSettings:
    """Every knob of TORQ; recorded verbatim in the result JSON.

    ``balance`` is the migration strength ``α`` of the channel balancing step
    (:func:`torq.rotations.balance.balance_scales`; ``0.5`` is its optimum), or ``None``
    for the paper's method without it. :meth:`paper` gives the paper's TORQ exactly.
    """

    use_inter: bool = True
    use_intra: bool = True
    inter: InterBlockConfig = field(default_factory=InterBlockConfig)
    intra: IntraBlockConfig = field(default_factory=lambda: IntraBlockConfig(**TORQ_INTRA_DEFAULTS))
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    sequential: bool = False
    reservoir_tokens: int = 1024
    block_size: int = 32
    balance: float | None = 0.5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def paper(self) -> TorqSettings:
        """These settings with the paper's method: no balancing, Algorithm 2 from the
        identity with ``K/2`` candidate columns."""
        return replace(self, balance=None, intra=replace(self.intra, init="identity", k_top=None))


def build_group_transform(
    stats: BlockStatistics,
    settings: TorqSettings,
    fmt: FormatSpec | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[BlockRotation, dict[str, Any]]:
    """``T`` for one input group (Algorithm 3, steps 1–3): the balancing scales ``s`` (torq's
    addition, from ``E[x_j²]`` and the group's stacked ``weight``), inter-block ``R_k`` from
    the balanced ``Σ_k`` (Algorithm 1), then ``R_intra`` (Algorithm 2) on balanced blocks."""
    k = settings.block_size
    record: dict[str, Any] = {"tokens": stats.count, "width": stats.width}
    covariance = stats.covariance()
    scales = None
    if settings.balance is not None:
        if weight is None:
            raise ValueError("channel balancing needs the group's weights")
        scales = balance_scales(channel_energy(covariance), weight, settings.balance)
        covariance = balance_covariance(covariance, scales)
        record["balance"] = {
            "alpha": settings.balance,
            "scale_min": float(scales.min()),
            "scale_max": float(scales.max()),
        }
    if not (settings.use_inter or settings.use_intra or scales is not None):
        raise ValueError("TORQ settings select no transform (no inter, intra or balancing)")
    r_inter = None
    if settings.use_inter:
        r_inter, info = inter_block_rotations(covariance, settings.inter)
        record["inter"] = {"rotations": info.rotations, "max_rel_deviation": info.max_rel_deviation}
    r_intra = None
    if settings.use_intra:
        sample = stats.sample.to(torch.float64)
        if scales is not None:
            sample = sample / scales
        if r_inter is not None:
            sample = BlockRotation(k, r_inter, None, dtype=torch.float64)(sample)
        result = fit_intra_block_rotation(sample.reshape(-1, k), settings.intra)
        r_intra = result.rotation
        record["intra"] = {
            "loss_first": result.loss_history[0],
            "loss_last": result.loss_history[-1],
            "iterations": len(result.loss_history) - 1,
            "rotations": result.n_rotations,
            "stop_reason": result.stop_reason,
            "samples": result.n_samples,
        }
    transform = BlockRotation(
        k,
        r_inter,
        r_intra,
        dtype=torch.float32,
        channel_scale=None if scales is None else scales.to(torch.float32),
    )
    if fmt is not None and stats.sample.shape[0]:
        # Diagnostic: relative activation quantization error on the sampled tokens, without
        # and with the transform (relative to each one's own energy: with balancing T is not
        # orthogonal).
        x = stats.sample
        record["act_rel_err"] = {
            "rtn": relative_quant_error(x, fmt),
            "transformed": relative_quant_error(transform(x), fmt),
        }
    return transform, record


def relative_quant_error(x: torch.Tensor, fmt: FormatSpec) -> float:
    """``‖x − Q(x)‖² / ‖x‖²`` of block fake quantization along the last dimension."""
    err = (x - fake_quantize(x, fmt)).double().pow(2).sum()
    return float(err / x.double().pow(2).sum().clamp_min(1e-300))


class TorqTransform(TransformBuilder):
    """TORQ's calibrated transform of each input group (:func:`build_group_transform`) with
    the run's :class:`TorqSettings`, one or both levels, or the fixed ``H₃₂`` after the
    balancing (``fixed_hadamard``: Algorithm 2 from the Hadamard with no iteration)."""

    calibrates = True

    def __init__(
        self, use_inter: bool = True, use_intra: bool = True, fixed_hadamard: bool = False
    ) -> None:
        self.use_inter, self.use_intra, self.fixed_hadamard = use_inter, use_intra, fixed_hadamard

    def settings(self, qconfig: QuantConfig, ctx: MethodContext) -> TorqSettings:
        """The run's settings with this method's levels, and the intra-block solver's scale
        rule that of the MXFP4 activations it fits for."""
        base: TorqSettings = ctx.options.get("torq_settings") or TorqSettings()
        settings = replace(base, use_inter=self.use_inter, use_intra=self.use_intra)
        if self.fixed_hadamard:
            settings = replace(settings, intra=replace(settings.intra, init="hadamard", max_iter=0))
        act = qconfig.activation
        if act is not None and act.name == "mxfp4" and settings.intra.scale_mode != act.scale_mode:
            settings = replace(settings, intra=replace(settings.intra, scale_mode=act.scale_mode))
        return settings

    def for_group(
        self,
        group: LinearGroup,
        stats: BlockStatistics,
        weight: torch.Tensor,
        qconfig: QuantConfig,
        ctx: MethodContext,
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        return build_group_transform(stats, self.settings(qconfig, ctx), qconfig.activation, weight)

    def key_settings(self, run: dict[str, Any]) -> dict[str, Any]:
        return {"torq": run.get("torq") or {}}

    def record(self, qconfig: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        return {"settings": self.settings(qconfig, ctx).to_dict()}


# TORQ: inter-block (Schur–Horn) then intra-block (codebook occupancy) rotation.
TORQ = register(
    Method(
        "torq",
        "TORQ: inter-block + intra-block rotation, calibrated, fused (RTN weights)",
        TorqTransform(),
    )
)
# Ablations (Table 3): one level only.
TORQ_INTER = register(
    Method("torq-inter", "TORQ ablation: inter-block rotation only", TorqTransform(use_intra=False))
)
TORQ_INTRA = register(
    Method("torq-intra", "TORQ ablation: intra-block rotation only", TorqTransform(use_inter=False))
)
# Ablation (ours): TORQ's channel balancing with the fixed 32-block Hadamard in place of the
# calibrated rotations — separates what the balancing and the rotations contribute.
TORQ_HAD32 = register(
    Method(
        "torq-had32",
        "TORQ ablation: channel balancing + 32-block Hadamard (no calibrated rotation)",
        TorqTransform(use_inter=False, fixed_hadamard=True),
    )
)
