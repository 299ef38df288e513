"""torq's plugin for vLLM: a linear with a bias runs its online input transform.

vLLM (0.32, 0.33) runs compressed-tensors' online transforms in
``CompressedTensorsLinearTransformMethod``, whose ``apply`` asserts that the linear has no
bias, so a folder whose biased linears (Qwen2's q/k/v) keep their Hadamard does not run.
An *input* transform commutes with the bias, ``y = (x T) W'ᵀ + b``: this plugin runs the
transformed product without the bias and adds the bias after it. A linear with an *output*
transform still goes to vLLM's own code, which refuses it (the output transform would
rotate the bias too), as does anything this plugin does not recognise.

Installed into vLLM's environment (``pip install integrations/vllm`` from torq's
repository), vLLM loads it in every process through its ``vllm.general_plugins`` entry
point; it imports nothing but vLLM.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

# vLLM's compressed-tensors quantization, through which its transforms are imported.
ENTRY_MODULE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors"
# The classes whose ``apply`` asserts ``bias is None``: module, class name.
TRANSFORM_METHODS: tuple[tuple[str, str], ...] = (
    (
        "vllm.model_executor.layers.quantization.compressed_tensors.transform.linear",
        "CompressedTensorsLinearTransformMethod",
    ),
    (
        "vllm.model_executor.layers.quantization.compressed_tensors.transform.schemes."
        "linear_qutlass_nvfp4",
        "QutlassNvFP4LinearMethod",
    ),
)

_MARK = "_torq_bias_after_transform"


def register() -> None:
    """vLLM's plugin hook: wrap each transformed linear method's ``apply`` (once)."""
    try:
        # the transform modules import this one as they load: importing them first fails
        # on the circle
        importlib.import_module(ENTRY_MODULE)
    except ImportError:
        return  # this vLLM has no compressed-tensors transforms: nothing to relax
    for module_name, class_name in TRANSFORM_METHODS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # this vLLM has no such class: nothing to relax
        allow_bias(cls)


def allow_bias(cls: type) -> None:
    """``cls.apply(layer, x, bias)`` with a bias and no output transform: the product
    without the bias, then ``+ bias``; otherwise ``cls``'s own ``apply``."""
    apply = cls.__dict__.get("apply")
    if apply is None or getattr(apply, _MARK, False):
        return

    @functools.wraps(apply)
    def apply_with_bias(self: Any, layer: Any, x: Any, bias: Any = None) -> Any:
        if bias is None or getattr(self, "output_transform", None) is not None:
            return apply(self, layer, x, bias)
        return apply(self, layer, x, None) + bias

    setattr(apply_with_bias, _MARK, True)
    cls.apply = apply_with_bias
