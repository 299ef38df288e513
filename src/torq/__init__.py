"""torq: Two-level Orthogonal Rotation for MXFP4 Quantization (TORQ) of LLMs.

The Python API (:mod:`torq.api`): ``torq.quantize``, ``torq.save``, ``torq.load``,
``torq.accelerate``, ``torq.generate``, ``torq.evaluate``, ``torq.quantize_checkpoint`` and
``torq.compare``, and ``torq.read_record`` for the records ``torq run --out`` writes;
imported on first use, so that ``import torq`` stays light.
"""

from typing import Any

from torq.version import __version__

_API = (
    "quantize",
    "save",
    "load",
    "accelerate",
    "generate",
    "evaluate",
    "quantize_checkpoint",
    "compare",
)
_RECORDS = ("read_record",)

__all__ = ["__version__", *_API, *_RECORDS]


def __getattr__(name: str) -> Any:
    if name in _API:
        from torq import api

        return getattr(api, name)
    if name in _RECORDS:
        from torq import results

        return getattr(results, name)
    raise AttributeError(f"module 'torq' has no attribute {name!r}")
