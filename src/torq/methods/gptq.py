"""GPTQ as a method and as a suffix: ``gptq`` (RTN activations, GPTQ weights) and
``<method>+gptq`` (the method's transforms, then GPTQ on the fused weights).

GPTQ needs each layer's inputs, so every GPTQ variant calibrates layer by layer
(:func:`torq.calibration.capture.calibrate_layerwise`, with the Hessian ``Σ x xᵀ`` of each
input group); a group's transform ``T`` turns it into ``T H Tᵀ``, the Hessian of the
inputs the fused weight ``W' = W Tᵀ`` actually sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torq.calibration.capture import BlockStatistics, LinearGroup, calibrate_layerwise
from torq.calibration.data import CalibrationConfig, calibration_windows
from torq.methods.registry import Method, MethodContext, register_method
from torq.rotations.transform import fuse_inverse_into_weight
from torq.surgery.apply import quantize_layer
from torq.surgery.gptq import GPTQConfig, gptq_quantize, transform_hessian
from torq.surgery.qlinear import ActivationQuantizer, QuantConfig, QuantLinear

GPTQ_SUFFIX = "+gptq"


def quantize_group(
    layer: nn.Module,
    group: LinearGroup,
    transform: nn.Module | None,
    qconfig: QuantConfig,
    stats: BlockStatistics | None = None,
    gptq: GPTQConfig | None = None,
) -> dict[str, Any]:
    """Replace a group's linears by :class:`QuantLinear` sharing one activation quantizer:
    ``W' = W Tᵀ`` fused (when ``T`` is given), then RTN or, with ``gptq``, GPTQ on the
    Hessian ``T H Tᵀ`` of the group's captured inputs (Algorithm 3, option B)."""
    modules = dict(layer.named_modules())
    shared = ActivationQuantizer(qconfig.activation, transform)
    record: dict[str, Any] = {}
    h = None
    if gptq is not None and qconfig.weight is not None:
        if stats is None:
            raise ValueError("GPTQ needs the group's calibration statistics")
        h = transform_hessian(stats.hessian(), transform)
    for name in group.members:
        linear = modules[name]
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name] if parent_name else layer
        weight = (
            linear.weight
            if transform is None
            else fuse_inverse_into_weight(linear.weight, transform)
        )
        quantized = False
        if h is not None:
            assert qconfig.weight is not None
            weight, rec = gptq_quantize(weight, h, qconfig.weight, gptq)
            record[name] = rec
            quantized = True
        setattr(
            parent,
            attr,
            QuantLinear(
                weight, linear.bias, qconfig, input_quantizer=shared, weight_quantized=quantized
            ),
        )
    return record


class GroupSolver:
    """Calibration callback: for each input group of a layer, a transform (``transform``,
    defined by subclasses), fused and quantized by :func:`quantize_group`; whatever the
    groups do not cover (fused MoE experts) falls back to RTN."""

    def __init__(self, qconfig: QuantConfig, gptq: GPTQConfig | None = None) -> None:
        self.qconfig = qconfig
        self.gptq = gptq

    def transform(
        self, group: LinearGroup, stats: BlockStatistics, weight: torch.Tensor
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        """The group's online transform; ``weight`` is its members' weights stacked by rows."""
        raise NotImplementedError

    def __call__(
        self,
        index: int,
        layer: nn.Module,
        groups: list[LinearGroup],
        stats: dict[str, BlockStatistics],
    ) -> dict[str, Any]:
        record: dict[str, Any] = {}
        modules = dict(layer.named_modules())
        for g in groups:
            t0 = time.perf_counter()
            # the transforms are solved on the CPU, where the statistics are kept
            weight = torch.cat([modules[m].weight.detach().cpu() for m in g.members])
            transform, rec = self.transform(g, stats[g.name], weight)
            gptq_rec = quantize_group(layer, g, transform, self.qconfig, stats[g.name], self.gptq)
            if gptq_rec:
                rec["gptq"] = gptq_rec
            rec["seconds"] = time.perf_counter() - t0
            record[g.name] = rec
        record["rtn_fallback"] = quantize_layer(layer, self.qconfig)
        return record


class FixedTransformSolver(GroupSolver):
    """For methods whose transform does not depend on the data (none, or a block
    Hadamard): each group gets ``transform_for(width)``."""

    def __init__(
        self,
        transform_for: Callable[[int], nn.Module | None],
        qconfig: QuantConfig,
        gptq: GPTQConfig | None,
    ) -> None:
        super().__init__(qconfig, gptq)
        self.transform_for = transform_for

    def transform(
        self, group: LinearGroup, stats: BlockStatistics, weight: torch.Tensor
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        return self.transform_for(group.width), {}


def calibrated_apply(
    model: nn.Module,
    config: QuantConfig,
    ctx: MethodContext,
    solver: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """Run ``solver`` layer by layer on calibration windows, with Hessians captured."""
    from torq.methods.torq_rotation import TorqSettings

    settings: TorqSettings = ctx.options.get("torq_settings") or TorqSettings()
    t0 = time.perf_counter()
    windows = calibration_windows(ctx.tokenizer, settings.calibration, ctx.options.get("data_dir"))
    t_data = time.perf_counter() - t0
    records, times = calibrate_layerwise(
        model,
        windows,
        solver,
        block_size=settings.block_size,
        reservoir=settings.reservoir_tokens,
        sequential=settings.sequential,
        seed=settings.calibration.seed,
        progress=ctx.options.get("progress", True),
        hessian=True,
    )
    return {
        "calibration": {
            "samples": settings.calibration.n_samples,
            "seqlen": settings.calibration.seqlen,
            "corpus": settings.calibration.corpus,
            "sequential": settings.sequential,
        },
        "calibration_seconds": {
            "data": t_data,
            "capture_forward": times.forward_seconds,
            "solve": times.solve_seconds,
        },
        "layers": records,
    }


def gptq_config(ctx: MethodContext) -> GPTQConfig:
    return ctx.options.get("gptq_config") or GPTQConfig()


def gptq_calibration(method: Method, ctx: MethodContext) -> CalibrationConfig | None:
    """The calibration tokens of :func:`calibrated_apply` when ``method`` runs GPTQ."""
    from torq.methods.torq_rotation import TorqSettings

    if not method.gptq_enabled:
        return None
    settings: TorqSettings = ctx.options.get("torq_settings") or TorqSettings()
    return settings.calibration


@register_method
class GPTQ(Method):
    """GPTQ weights on the format's grid, RTN activations, no transform."""

    name = "gptq"
    description = "GPTQ weights (format grid, damp 0.01), RTN activations, no transform"
    gptq_enabled = True

    def calibration(self, ctx: MethodContext) -> CalibrationConfig | None:
        return gptq_calibration(self, ctx)

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        cfg = gptq_config(ctx)
        rec = calibrated_apply(
            model, config, ctx, FixedTransformSolver(lambda w: None, config, cfg)
        )
        return {"gptq": cfg.__dict__, **rec}
