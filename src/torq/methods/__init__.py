"""Quantization methods behind one registry (``fp``, ``rtn``, ``had32``, ``gptq``, ``torq``
and its ablations, ``quarot``; ``<method>+gptq`` composes a method with GPTQ weights).

Every module of this package is imported here, so a new method is one new file: its
transform builder and its ``register(Method(...))``.
"""

import importlib
import pkgutil

from torq.methods.registry import (
    METHODS,
    LayerPlan,
    Method,
    MethodContext,
    TransformBuilder,
    get_method,
    register,
)
from torq.methods.settings import TorqSettings

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "METHODS",
    "LayerPlan",
    "Method",
    "MethodContext",
    "TorqSettings",
    "TransformBuilder",
    "get_method",
    "register",
]
