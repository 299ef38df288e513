"""Model surgery: quantized layers and the pass that puts them into a model."""

from torq.surgery.apply import quantize_layer, quantize_model
from torq.surgery.qlinear import QuantConfig, QuantExperts, QuantLinear

__all__ = ["QuantConfig", "QuantExperts", "QuantLinear", "quantize_layer", "quantize_model"]
