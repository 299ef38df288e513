"""TORQ: the two-level orthogonal rotation, calibrated on real activations and fused.

For every group of linear layers that read the same tensor, the calibration statistics
give the inter-block rotations ``R_k`` (§5.1, Algorithm 1, from ``Σ_k``) and the intra-block
rotation ``R_intra`` (§5.2, Algorithm 2, from sampled blocks after the inter-block
rotation). The group's online transform ``T`` (inter, then intra) runs before activation
quantization; ``W' = W Tᵀ`` is fused into each member's weight, which is then quantized
(Algorithm 3, option B). ``torq-inter`` and ``torq-intra`` are the paper's ablations
(Table 3): one level only.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from torq.calibration.capture import BlockStatistics, LinearGroup, calibrate_layerwise
from torq.calibration.data import CalibrationConfig, calibration_windows
from torq.formats import FormatSpec, fake_quantize
from torq.methods.gptq import GroupSolver, gptq_config
from torq.methods.registry import Method, MethodContext, register_method
from torq.rotations.inter_block import InterBlockConfig, inter_block_rotations
from torq.rotations.intra_block import IntraBlockConfig, fit_intra_block_rotation
from torq.rotations.transform import BlockRotation
from torq.surgery.gptq import GPTQConfig
from torq.surgery.qlinear import QuantConfig


@dataclass
class TorqSettings:
    """Every knob of TORQ; recorded verbatim in the result JSON."""

    use_inter: bool = True
    use_intra: bool = True
    inter: InterBlockConfig = field(default_factory=InterBlockConfig)
    intra: IntraBlockConfig = field(default_factory=IntraBlockConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    sequential: bool = False
    reservoir_tokens: int = 1024
    block_size: int = 32

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_group_transform(
    stats: BlockStatistics, settings: TorqSettings, fmt: FormatSpec | None = None
) -> tuple[BlockRotation, dict[str, Any]]:
    """``T`` for one input group: inter-block ``R_k`` from ``Σ_k``, then ``R_intra`` on blocks."""
    k = settings.block_size
    record: dict[str, Any] = {"tokens": stats.count, "width": stats.width}
    r_inter = None
    if settings.use_inter:
        r_inter, info = inter_block_rotations(stats.covariance(), settings.inter)
        record["inter"] = {"rotations": info.rotations, "max_rel_deviation": info.max_rel_deviation}
    r_intra = None
    if settings.use_intra:
        sample = stats.sample.to(torch.float64)
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
    transform = BlockRotation(k, r_inter, r_intra, dtype=torch.float32)
    if fmt is not None and stats.sample.shape[0]:
        # Diagnostic: relative activation quantization error on the sampled tokens, without
        # and with the transform (T is orthogonal, so the two are directly comparable).
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


class TorqLayerSolver(GroupSolver):
    """Builds, fuses and quantizes one decoder layer's transforms (the calibration callback);
    with ``gptq`` the fused weights are quantized by GPTQ instead of RTN."""

    def __init__(
        self, settings: TorqSettings, qconfig: QuantConfig, gptq: GPTQConfig | None = None
    ) -> None:
        super().__init__(qconfig, gptq)
        self.settings = settings

    def transform(
        self, group: LinearGroup, stats: BlockStatistics
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        return build_group_transform(stats, self.settings, self.qconfig.activation)


class _TorqBase(Method):
    use_inter: ClassVar[bool] = True
    use_intra: ClassVar[bool] = True
    supports_gptq = True

    def settings(self, ctx: MethodContext) -> TorqSettings:
        base: TorqSettings = ctx.options.get("torq_settings") or TorqSettings()
        return replace(base, use_inter=self.use_inter, use_intra=self.use_intra)

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        settings = self.settings(ctx)
        if config.activation is not None and config.activation.name == "mxfp4":
            intra = settings.intra
            if intra.scale_mode != config.activation.scale_mode:
                settings = replace(
                    settings, intra=replace(intra, scale_mode=config.activation.scale_mode)
                )
        t0 = time.perf_counter()
        windows = calibration_windows(
            ctx.tokenizer, settings.calibration, ctx.options.get("data_dir")
        )
        t_data = time.perf_counter() - t0
        gptq = gptq_config(ctx) if self.gptq_enabled else None
        records, times = calibrate_layerwise(
            model,
            windows,
            TorqLayerSolver(settings, config, gptq),
            block_size=settings.block_size,
            reservoir=settings.reservoir_tokens,
            sequential=settings.sequential,
            seed=settings.calibration.seed,
            progress=ctx.options.get("progress", True),
            hessian=gptq is not None,
        )
        return {
            "settings": settings.to_dict(),
            "gptq": None if gptq is None else gptq.__dict__,
            "calibration_seconds": {
                "data": t_data,
                "capture_forward": times.forward_seconds,
                "solve": times.solve_seconds,
            },
            "layers": records,
        }


@register_method
class Torq(_TorqBase):
    """TORQ: inter-block (Schur–Horn) then intra-block (codebook occupancy) rotation."""

    name = "torq"
    description = "TORQ: inter-block + intra-block rotation, calibrated, fused (RTN weights)"


@register_method
class TorqInter(_TorqBase):
    """Ablation: the inter-block rotation alone (Table 3, 'R_inter')."""

    name = "torq-inter"
    description = "TORQ ablation: inter-block rotation only"
    use_intra = False


@register_method
class TorqIntra(_TorqBase):
    """Ablation: the intra-block rotation alone (Table 3, 'R_intra')."""

    name = "torq-intra"
    description = "TORQ ablation: intra-block rotation only"
    use_inter = False
