"""torq: Two-level Orthogonal Rotation for MXFP4 Quantization (TORQ) of LLMs."""

from torq.version import __version__

__all__ = ["__version__"]
