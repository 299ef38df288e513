"""Methods as small typed values, all run by one layer-streaming driver.

A :class:`Method` is a frozen value: its name, an online-transform builder
(:class:`TransformBuilder`: none, a fixed block Hadamard, QuaRot's, TORQ's calibrated
ones…) and a weight quantizer (``"rtn"`` or ``"gptq"``). ``<method>+gptq`` is the same
value with GPTQ weights (:meth:`Method.with_gptq`), composable with any transform, as
llm-compressor composes its GPTQ modifier with any transform. Each builder declares the
run settings it reads (:meth:`TransformBuilder.key_settings`), so a method's settings key
(:meth:`Method.settings_key`) names exactly what makes its quantized model.

Every method becomes a :class:`LayerPlan` (:func:`torq.methods.layers.layer_plan`) that
:func:`torq.driver.run_layerwise` runs one decoder layer at a time, on a model in memory
(:func:`torq.driver.apply_method`) or streamed from its checkpoint: the driver is the
only code that walks the layers. A rotation method is one file: a builder and its
``register(Method(…))`` (the package imports every module in it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from torq.calibration.capture import BlockStatistics, LinearGroup
from torq.calibration.data import CalibrationConfig
from torq.errors import TorqError
from torq.methods.settings import TorqSettings
from torq.surgery.gptq import GPTQConfig, gptq_key
from torq.surgery.qlinear import QuantConfig

WEIGHT_QUANTIZERS: tuple[str, ...] = ("rtn", "gptq")


@dataclass
class MethodContext:
    """What a method may need beyond the model: tokenizer, calibration settings, options."""

    tokenizer: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    # the model's Hugging Face configuration (shapes a builder may read; the driver sets it)
    model_config: Any = None

    def capture_settings(self) -> Any:
        """The run's :class:`~torq.methods.torq_rotation.TorqSettings`, which also hold the
        capture settings every calibrating method shares (windows, reservoir, sequential)."""

        return self.options.get("torq_settings") or TorqSettings()

    def gptq_config(self) -> Any:

        return self.options.get("gptq_config") or GPTQConfig()


LayerQuantize = Callable[[int, nn.Module, list[LinearGroup], dict[str, BlockStatistics]], dict]


@dataclass
class LayerPlan:
    """A method as the layer-streaming driver (:mod:`torq.driver`) runs it: what to capture
    for each decoder layer, and ``quantize(index, layer, groups, stats)``, which quantizes
    that layer in place and returns its record (``None``: the layer stays in float).

    With ``calibration`` the driver runs the calibration windows through every layer and
    hands ``quantize`` the statistics of each input group (``hessian``: with ``Σ x xᵀ``);
    without it ``groups`` and ``stats`` are empty. ``record`` is the method's own record
    (its settings), stored with the row.
    """

    quantize: LayerQuantize | None
    calibration: CalibrationConfig | None = None
    block_size: int = 32
    reservoir: int = 1024
    sequential: bool = False
    hessian: bool = False
    record: dict[str, Any] = field(default_factory=dict)
    # an offline rotation fused into the model's parts as the driver loads each one
    # (QuaRot's residual rotation, :class:`torq.surgery.fusion.ResidualRotation`)
    parts: Any = None
    # whether ``quantize`` reads the capture's statistics (a fixed transform with static
    # activation scales needs the calibration windows, not their statistics)
    capture_stats: bool = True
    # static NVFP4 activation scales: after ``quantize`` the calibration windows run through
    # the quantized layer once, each activation quantizer taking the amax it saw
    # (:func:`torq.surgery.qlinear.calibrate_activation_scales`)
    observe_activations: bool = False


class TransformBuilder:
    """The online transform ``T`` of each input group (its inverse fused into the weights,
    ``W' = W Tᵀ``). Fixed builders answer :meth:`fixed` from the width alone; calibrating
    ones (``calibrates``) answer :meth:`for_group` from the group's statistics and weights.
    """

    calibrates: bool = False
    composes_with_gptq: bool = True

    def fixed(self, width: int, qconfig: QuantConfig, ctx: MethodContext) -> nn.Module | None:
        """The transform for an input of ``width`` channels (``None``: none)."""
        return None

    def for_group(
        self,
        group: LinearGroup,
        stats: BlockStatistics,
        weight: torch.Tensor,
        qconfig: QuantConfig,
        ctx: MethodContext,
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        """The transform of one input group (``weight``: its members' weights stacked by
        rows) and a record of how it was built."""
        return self.fixed(group.width, qconfig, ctx), {}

    def fold(
        self,
        layer: nn.Module,
        groups: list[LinearGroup],
        transforms: dict[str, nn.Module | None],
        qconfig: QuantConfig,
        ctx: MethodContext,
    ) -> dict[str, tuple[nn.Module | None, dict[str, Any]]]:
        """Called with every group's transform ``T`` of a layer before any group is
        quantized: for the groups whose ``T`` it moved in part into the layer's float
        weights (torq's balancing folded, :mod:`torq.rotations.fold`), the transform to run
        online instead and a record. ``T`` itself still fuses the group's weights (and
        conjugates its Hessian). The default moves nothing."""
        return {}

    def check(self, qconfig: QuantConfig, ctx: MethodContext) -> None:
        """Refuse, before the method's work, a model (``ctx.model_config``) this builder
        cannot transform with its settings."""

    def compressed_tensors(self, qconfig: QuantConfig, ctx: MethodContext) -> str | None:
        """Why compressed-tensors (transformers, vLLM) cannot hold this transform with these
        settings, in one line; ``None`` when it can (no transform, or the 32-block Hadamard
        alone online). The export checks each saved layer again as it writes it."""
        return None

    def residual(self, ctx: MethodContext) -> Any:
        """An offline rotation of the whole model fused part by part (embedding, each layer
        before its capture, head), as :class:`torq.surgery.fusion.ResidualRotation` does for
        QuaRot; ``None``: none."""
        return None

    def key_settings(self, run: dict[str, Any]) -> dict[str, Any]:
        """The run settings (``asdict(RunConfig)``) this transform reads, for the key."""
        return {}

    def record(self, qconfig: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        """The method-level record (the settings it ran with)."""
        return {}


@dataclass(frozen=True)
class Method:
    """A quantization method: a transform builder and a weight quantizer (module doc)."""

    name: str
    description: str
    transform: TransformBuilder = field(default_factory=TransformBuilder)
    weights: str = "rtn"
    quantizes: bool = True
    # the method's own GPTQ settings, over the run's (``(name, value)`` pairs of
    # :class:`~torq.surgery.gptq.GPTQConfig`): MR-GPTQ's act-order and MSE-chosen scales
    gptq_settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_QUANTIZERS:
            raise ValueError(f"weight quantizer must be one of {WEIGHT_QUANTIZERS}")
        if self.gptq_settings:
            if self.weights != "gptq":
                raise ValueError("GPTQ settings need GPTQ weights")
            GPTQConfig(**dict(self.gptq_settings))  # names and values checked now

    def gptq_config(self, ctx: MethodContext) -> Any:
        """The GPTQ settings this method runs with: the run's, then its own."""
        return replace(ctx.gptq_config(), **dict(self.gptq_settings))

    @property
    def gptq_enabled(self) -> bool:
        return self.weights == "gptq"

    @property
    def supports_gptq(self) -> bool:
        """Whether ``<name>+gptq`` exists: this transform, then GPTQ weights."""
        return self.quantizes and self.transform.composes_with_gptq and not self.gptq_enabled

    def with_gptq(self, name: str | None = None) -> Method:
        """The same transform with GPTQ weights (``<name>+gptq``)."""
        if not self.supports_gptq:
            raise TorqError(f"method '{self.name}' does not compose with GPTQ")
        what = self.description.replace("(RTN weights)", "").rstrip()
        return replace(
            self,
            name=name or f"{self.name}+gptq",
            description=f"{what}, GPTQ weights",
            weights="gptq",
        )

    def calibrates(self, qconfig: QuantConfig | None = None) -> bool:
        """Whether the method reads calibration data (its transform or GPTQ does, or, with
        ``qconfig``'s static activation scales, the quantized layers' inputs)."""
        static = qconfig is not None and qconfig.static_activations
        return self.quantizes and (self.transform.calibrates or self.gptq_enabled or static)

    def calibration(
        self, ctx: MethodContext, qconfig: QuantConfig | None = None
    ) -> CalibrationConfig | None:
        """The calibration tokens the method reads with these options; ``None`` when it
        needs no data (checked before any work, :func:`torq.pipeline.run`)."""
        return ctx.capture_settings().calibration if self.calibrates(qconfig) else None

    def settings_key(self, run: dict[str, Any]) -> str:
        """What makes two rows of this method the same quantized model: the model, formats
        and window length, plus the settings its transform reads and, with GPTQ, GPTQ's
        and the calibration's (``run`` is ``asdict(RunConfig)``)."""
        key: dict[str, Any] = {
            k: run.get(k) for k in ("model", "weight_format", "act_format", "scale_mode")
        }
        key["seqlen"] = run.get("seqlen")
        if run.get("gguf_dtype", "float32") != "float32":  # another float model
            key["gguf_dtype"] = run["gguf_dtype"]
        key.update(self.transform.key_settings(run))
        if self.gptq_enabled:
            torq = run.get("torq") or {}
            gptq = run.get("gptq")
            if self.gptq_settings:
                gptq = {**(gptq or {}), **dict(self.gptq_settings)}
            key["gptq"] = gptq_key(gptq)
            key["calibration"] = [
                torq.get(k) for k in ("calibration", "sequential", "reservoir_tokens")
            ]
        if run.get("act_scale", "dynamic") != "dynamic":
            # static activation scales: calibrated on the calibration windows (absent at
            # the default, so the keys made before stay)
            key["act_scale"] = run["act_scale"]
            torq = run.get("torq") or {}
            key["act_calibration"] = [torq.get(k) for k in ("calibration", "sequential")]
        return json.dumps([self.name, key], sort_keys=True, default=str)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to :data:`METHODS` under its name."""
    if not method.name or method.name != method.name.strip().lower() or "+" in method.name:
        raise ValueError(f"invalid method name {method.name!r}")
    if method.name in METHODS:
        raise ValueError(f"method '{method.name}' is registered twice")
    METHODS[method.name] = method
    return method


GPTQ_SUFFIX = "+gptq"

# What ``torq run`` and ``torq eval`` quantize with when no method is named, and what
# ``make demo`` shows (issue 27's fallback): TORQ's rotations after torq's balancing, with GPTQ
# weights, the best row measured on both models' perplexity (full WikiText-2 test, held-out
# Wikipedia text, two calibration seeds) and on SmolLM2's zero-shot average
# (docs/research-log.md §10.5). ``torq`` alone is the same transform with RTN weights.
DEFAULT_METHOD = "torq+gptq"


def get_method(name: str) -> Method:
    """A registered method by name; ``<method>+gptq`` composes its transform with GPTQ
    weights (``rtn+gptq`` is ``gptq``). Unknown names list the known ones."""
    key = name.strip().lower()
    if key.endswith(GPTQ_SUFFIX):
        base = key[: -len(GPTQ_SUFFIX)]
        if base == "rtn":
            return get_method("gptq")
        method = METHODS.get(base)
        if method is None or not method.supports_gptq:
            composable = sorted(n for n, m in METHODS.items() if m.supports_gptq and n != "rtn")
            raise TorqError(
                f"unknown method '{name}': '+gptq' composes with rtn, {', '.join(composable)}"
            )
        return method.with_gptq(key)
    try:
        return METHODS[key]
    except KeyError:
        raise TorqError(
            f"unknown method '{name}'; known methods: {', '.join(sorted(METHODS))}"
            f" (and <method>+gptq)"
        ) from None
