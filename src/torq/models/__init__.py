"""Model loading (GGUF, local folders, hub ids) and architecture discovery."""

from torq.models.architecture import decoder_layers
from torq.models.loading import (
    EMBEDDED_MODELS,
    LoadedModel,
    cache_dir,
    convert_gguf,
    known_models,
    load,
)

__all__ = [
    "EMBEDDED_MODELS",
    "LoadedModel",
    "cache_dir",
    "convert_gguf",
    "decoder_layers",
    "known_models",
    "load",
]
