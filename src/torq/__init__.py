"""torq: Two-level Orthogonal Rotation for MXFP4 Quantization (TORQ) of LLMs."""

__version__ = "0.1.0"
