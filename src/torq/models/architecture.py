"""Architecture discovery that works for any Hugging Face causal LM.

Instead of one hand-written table per model family, the decoder stack is found as the
``nn.ModuleList`` whose length is ``config.num_hidden_layers``; everything quantized lives
inside it, and everything outside it (embeddings, final norm, lm_head) stays in float.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from torq.errors import TorqError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer decoder layers."""
    n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) > 0
        and (n_layers is None or len(mod) == n_layers)
    ]
    if not candidates:
        raise TorqError(
            f"unsupported model {type(model).__name__}: found no list of {n_layers} decoder layers"
        )
    # The shortest dotted name is the outermost stack (e.g. model.layers, not a nested list).
    return min(candidates, key=lambda c: c[0].count("."))[1]


def is_fused_experts(module: nn.Module) -> bool:
    """A mixture-of-experts block stored as 3D tensors (transformers >= 5 layout)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and hasattr(module, "act_fn")
    )


def cache_argument(model: Any) -> str:
    """The name under which ``model``'s forward takes a key/value cache: ``cache`` since
    transformers 5.x renamed it (``past_key_values`` is deprecated there, to be removed in
    5.40), ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def biased_linears(model: nn.Module) -> tuple[str, ...]:
    """The names, within a decoder layer (``q_proj``), of the linears that have a bias in
    any decoder layer (Qwen2's q/k/v): vLLM runs no online transform on such a linear.
    Reads only the modules, so a skeleton on the meta device answers too."""
    names: set[str] = set()
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                names.add(name.rsplit(".", 1)[-1])
    return tuple(sorted(names))


def served_unrotated(model: nn.Module, rotate_biased: bool = False) -> tuple[str, ...]:
    """The names, within a decoder layer, whose input groups a servable recipe leaves
    unrotated (an ``unrotated`` setting): the linears with a bias, where vLLM runs no
    online transform (:func:`biased_linears`; none with ``rotate_biased``), and fused MoE
    experts (``experts``), inside which neither transformers nor vLLM runs one. A skeleton on
    the meta device answers too."""
    biased = () if rotate_biased else biased_linears(model)
    experts = ("experts",) if any(is_fused_experts(m) for m in model.modules()) else ()
    return (*biased, *experts)


def layer_linear_names(model: nn.Module) -> list[str]:
    """Every linear of the decoder layers as ``layers.<i>.<its name in the layer>``, the
    names ``--ignore`` patterns match (a skeleton on the meta device answers too)."""
    return [
        f"layers.{i}.{name}"
        for i, layer in enumerate(decoder_layers(model))
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    ]
