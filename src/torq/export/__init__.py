"""Saving a quantized model as a checkpoint folder, and loading it back.

:func:`save_quantized` writes a Hugging Face style folder (``config.json``, the tokenizer,
``model.safetensors``) whose quantized weights are stored packed (two 4-bit codes per byte,
one scale byte per block), with the online input transforms and a manifest
(``torq_quant.json``); :func:`load_quantized` rebuilds the same model from it, either with
torq's fake-quant layers (bit-identical to the model that was saved) or with the packed
MXFP4 layers of :mod:`torq.kernels` (``packed=True``, the GPU kernels).
"""

from torq.export.checkpoint import save_quantized
from torq.export.loading import load_model
from torq.export.reading import load_quantized, read_manifest
from torq.models.loading import MANIFEST, is_quantized_checkpoint

__all__ = [
    "MANIFEST",
    "is_quantized_checkpoint",
    "load_model",
    "load_quantized",
    "read_manifest",
    "save_quantized",
]
