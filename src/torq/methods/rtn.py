"""The two reference points of every table: full precision and round-to-nearest (RTN)."""

from __future__ import annotations

from typing import Any

from torch import nn

from torq.methods.registry import Method, MethodContext, register_method
from torq.surgery.apply import quantize_model
from torq.surgery.qlinear import QuantConfig


@register_method
class FullPrecision(Method):
    """The float model itself (the GGUF de-quantized to float32): the baseline row."""

    name = "fp"
    description = "full precision, no quantization"
    quantizes = False

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        return {}


@register_method
class RoundToNearest(Method):
    """RTN: Eq. (1) of the paper applied directly, no transform, to weights and activations."""

    name = "rtn"
    description = "round to nearest in the target format, no transform"

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        return {"replaced": quantize_model(model, config)}
