"""Loads a compressed-tensors folder that torq wrote with its online transforms attached.

torq copies this file, as it is, into every folder whose linears need a transform applied to
their inputs at run time (the ``default`` and ``fast`` recipes' 32-block Hadamard). The
folder's ``config.json`` names it in ``auto_map``, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

loads the model as torq and vLLM compute it. transformers alone applies no online transform: its
``from_pretrained`` without ``trust_remote_code`` would run the weights on unrotated
inputs and compute garbage, so the folder's quantization config carries a second,
deliberately invalid one that transformers reads in its place (it unwraps a nested
``quantization_config``), and that load stops with :data:`REFUSAL` in its error. vLLM
reads the outer config, and applies the transforms itself.

It imports nothing of torq: the folder loads where only transformers and
compressed-tensors are installed.
"""

from __future__ import annotations

from typing import Any

import torch

# what a plain transformers load of such a folder stops with (the key of an invalid group)
REFUSAL = (
    "torq: this folder needs online Hadamard transforms that transformers does not attach "
    "by itself; load it with AutoModelForCausalLM.from_pretrained(folder, "
    "trust_remote_code=True), torq.load(folder) or vLLM"
)
# the config.json key, inside quantization_config, that transformers reads in its place
NESTED_KEY = "quantization_config"


def refusing_config() -> dict[str, Any]:
    """The nested quantization config that makes a plain transformers load stop: one
    config group named :data:`REFUSAL` that is not a valid scheme."""
    return {"quant_method": "compressed-tensors", "config_groups": {REFUSAL: {"targets": None}}}


def _decompress(model: torch.nn.Module) -> None:
    """Decompress the weights now: compressed-tensors does it on the first forward call and
    puts every module under its own offloading then, fixed to the device the model is on;
    done here and the offloading removed, ``model.to(device)`` moves the model."""
    from compressed_tensors.offload import remove_dispatch

    if hasattr(model, "ct_decompress_hook"):  # the first call fires it and removes it
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long))
    remove_dispatch(model)


def attach_online_transforms(model: torch.nn.Module, quantization_config: dict[str, Any]) -> None:
    """compressed-tensors' ``apply_transform_config`` with the ``input`` parts of the
    folder's ``transform_config`` only: the ``weight_input`` parts are in the stored
    weights already."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from compressed_tensors.transform.factory.base import TransformBase

    data = quantization_config.get("transform_config") or {}
    if not data.get("config_groups"):
        return
    if any(isinstance(m, TransformBase) for m in model.modules()):
        return  # a transformers that attaches them itself
    config = TransformConfig.model_validate(data)
    for name, group in config.config_groups.items():
        if group.type != "hadamard":
            raise ValueError(f"transform group {name!r} of type {group.type!r} is not attached")
        group.apply = [a for a in group.apply if a.is_online()]
    apply_transform_config(model, config)


class TorqForCausalLM:
    """The folder's architecture class (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, …)
    loaded as transformers loads it, then its online transforms attached: what
    ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` returns."""

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoModelForCausalLM") -> None:
        """Nothing to register: the model returned is the architecture's own class."""

    @classmethod
    def from_pretrained(cls, path: Any, *args: Any, config: Any, **kwargs: Any) -> torch.nn.Module:
        """The model of folder ``path`` (``config``: its transformers config, as the auto
        class read it), decompressed and with its online transforms attached."""
        from transformers import AutoModelForCausalLM

        quantization = dict(config.quantization_config)
        quantization.pop(NESTED_KEY, None)
        config.quantization_config = quantization
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
        model = model_class.from_pretrained(path, *args, config=config, **kwargs)
        _decompress(model)
        attach_online_transforms(model, quantization)
        return model.eval()
