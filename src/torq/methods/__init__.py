"""Quantization methods behind one registry (``fp``, ``rtn``, ``had32``, ``gptq``, ``torq``
and its ablations; ``<method>+gptq`` composes a method with GPTQ weights)."""

from torq.methods.gptq import GPTQ
from torq.methods.hadamard import Hadamard32, Hadamard128, HadamardFull
from torq.methods.quarot import QuaRot
from torq.methods.registry import METHODS, Method, MethodContext, get_method, register_method
from torq.methods.rtn import FullPrecision, RoundToNearest
from torq.methods.torq_rotation import Torq, TorqHadamard, TorqInter, TorqIntra, TorqSettings

__all__ = [
    "GPTQ",
    "METHODS",
    "FullPrecision",
    "Hadamard32",
    "Hadamard128",
    "HadamardFull",
    "Method",
    "MethodContext",
    "QuaRot",
    "RoundToNearest",
    "Torq",
    "TorqHadamard",
    "TorqInter",
    "TorqIntra",
    "TorqSettings",
    "get_method",
    "register_method",
]
