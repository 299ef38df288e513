"""The method registry: a name maps to a class that turns a float model into a quantized one.

A method sees the float model, the quantization config and a :class:`MethodContext` (the
tokenizer and, for methods that calibrate, a way to get calibration data). Later methods
(TORQ, Hadamard, GPTQ) register themselves here with :func:`register_method`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from torq.calibration.data import CalibrationConfig
from torq.errors import TorqError
from torq.surgery.qlinear import QuantConfig


@dataclass
class MethodContext:
    """What a method may need beyond the model: tokenizer, calibration settings, options."""

    tokenizer: Any = None
    options: dict[str, Any] = field(default_factory=dict)


class Method:
    """Base class: ``apply`` quantizes ``model`` in place and returns a record of what it did."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    quantizes: ClassVar[bool] = True
    # whether ``<name>+gptq`` exists: the method's transforms, then GPTQ weights
    supports_gptq: ClassVar[bool] = False
    gptq_enabled: bool = False

    def apply(self, model: nn.Module, config: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        raise NotImplementedError

    def calibration(self, ctx: MethodContext) -> CalibrationConfig | None:
        """The calibration tokens ``apply`` will read with these options; ``None`` when the
        method needs no data (checked before any work, :func:`torq.pipeline.run`)."""
        return None


METHODS: dict[str, type[Method]] = {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator adding a method to :data:`METHODS` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in METHODS:
        raise ValueError(f"method '{cls.name}' is registered twice")
    METHODS[cls.name] = cls
    return cls


def get_method(name: str) -> Method:
    """Instantiate a registered method by name; ``<method>+gptq`` composes a method's
    transforms with GPTQ weights (``rtn+gptq`` is ``gptq``). Unknown names list the known
    ones."""
    key = name.strip().lower()
    if key.endswith("+gptq"):
        base = key[: -len("+gptq")]
        if base == "rtn":
            return get_method("gptq")
        cls = METHODS.get(base)
        if cls is None or not cls.supports_gptq:
            composable = sorted(n for n, c in METHODS.items() if c.supports_gptq)
            raise TorqError(
                f"unknown method '{name}': '+gptq' composes with rtn, {', '.join(composable)}"
            )
        method = cls()
        method.gptq_enabled = True
        method.name = key  # type: ignore[misc]
        return method
    try:
        return METHODS[key]()
    except KeyError:
        raise TorqError(
            f"unknown method '{name}'; known methods: {', '.join(sorted(METHODS))}"
            f" (and <method>+gptq)"
        ) from None
