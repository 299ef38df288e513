"""Model surgery: swap every linear layer inside the decoder stack for a quantized one.

Embeddings, lm_head, norms and the attention products stay in float (method-notes §2,
"Kept in high precision"); MoE routers stay in float as well, because they choose which
weights run rather than holding features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torq.models.architecture import decoder_layers, is_fused_experts
from torq.surgery.qlinear import (
    QuantConfig,
    QuantExperts,
    QuantLinear,
    shared_weight_tensor_scales,
)

TransformFactory = Callable[[str, nn.Linear], nn.Module | None]
# the quantized replacement of a fused-experts module (its path, the module)
ExpertsFactory = Callable[[str, nn.Module], nn.Module]


def is_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    """A MoE router: a linear (or linear-like) ``gate`` next to an ``experts`` module."""
    return name.rsplit(".", 1)[-1] == "gate" and parent is not None and hasattr(parent, "experts")


def quantize_layer(
    layer: nn.Module,
    config: QuantConfig,
    prefix: str = "",
    input_transforms: TransformFactory | None = None,
    experts: ExpertsFactory | None = None,
) -> dict[str, int]:
    """Replace, in place, each ``nn.Linear`` (and fused MoE experts) of one decoder layer.

    ``input_transforms(name, linear)`` may return the online transform ``T`` for that layer
    (its inverse must already be fused into ``linear.weight``); ``experts(name, module)``
    builds the quantized experts (default: RTN, no transform). Linears that are already
    :class:`QuantLinear` (experts already :class:`QuantExperts`) are left as they are, and so
    are the linears ``config`` ignores (named ``prefix`` and their name in the layer).
    Returns counts of what was replaced (and of what was ignored, where any was).
    """
    counts = {"linear": 0, "experts": 0, "kept_router": 0}
    named = dict(layer.named_modules())
    linears: dict[str, tuple[nn.Module, nn.Linear, nn.Module | None]] = {}
    for name, module in list(named.items()):
        if not name:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = named[parent_name] if parent_name else layer
        if is_router(name, module, parent):
            counts["kept_router"] += 1
            continue
        if isinstance(module, nn.Linear) and not isinstance(module, QuantLinear):
            if config.ignores(f"{prefix}{name}"):
                counts["ignored"] = counts.get("ignored", 0) + 1
                continue  # kept in float, as it is
            # the factory fuses T's inverse into the weight: every one before the scales
            t = input_transforms(f"{prefix}{name}", module) if input_transforms else None
            linears[name] = (parent, module, t)
        elif is_fused_experts(module) and not isinstance(module, QuantExperts):
            name_in_model = f"{prefix}{name}"
            new = experts(name_in_model, module) if experts else QuantExperts(module, config)
            setattr(parent, attr, new)
            counts["experts"] += 1
    scales = _nvfp4_scales({n: m for n, (_, m, _) in linears.items()}, config, prefix)
    for name, (parent, module, t) in linears.items():
        own = config.at(f"{prefix}{name}")
        scale = scales.get(name)
        quantized = QuantLinear(module.weight, module.bias, own, t, weight_tensor_scale=scale)
        setattr(parent, name.rpartition(".")[2], quantized)
        counts["linear"] += 1
    return counts


def _nvfp4_scales(
    linears: dict[str, nn.Linear], config: QuantConfig, prefix: str
) -> dict[str, torch.Tensor]:
    """The NVFP4 tensor scale of each of ``linears`` :func:`quantize_layer` quantizes in
    NVFP4, shared within the sets a serving engine fuses
    (:func:`~torq.surgery.qlinear.shared_weight_tensor_scales`)."""
    weights = {
        name: m.weight
        for name, m in linears.items()
        if (fmt := config.at(f"{prefix}{name}").weight) is not None and fmt.name == "nvfp4"
    }
    return shared_weight_tensor_scales(weights) if weights else {}


def quantize_model(
    model: nn.Module,
    config: QuantConfig,
    input_transforms: TransformFactory | None = None,
) -> dict[str, int]:
    """Replace, in place, each ``nn.Linear`` of the decoder layers by a :class:`QuantLinear`.

    Returns the total counts of :func:`quantize_layer` over all layers.
    """
    total = {"linear": 0, "experts": 0, "kept_router": 0}
    for li, layer in enumerate(decoder_layers(model)):
        for key, n in quantize_layer(layer, config, f"layers.{li}.", input_transforms).items():
            total[key] += n
    return total
