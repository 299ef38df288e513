"""Methods as small typed values, all run by one layer-streaming driver.

A :class:`Method` is a frozen value: its name, an online-transform builder
(:class:`TransformBuilder`: none, a fixed block Hadamard, QuaRot's, TORQ's calibrated
ones…) and a weight quantizer (``"rtn"`` or ``"gptq"``). ``<method>+gptq`` is the same
value with GPTQ weights (:meth:`Method.with_gptq`), composable with any transform, as
llm-compressor composes its GPTQ modifier with any transform.

A run holds :class:`MethodSpec` values: a method's name with its own frozen settings (its
builder's :attr:`TransformBuilder.settings_type`, e.g. TORQ's, and its GPTQ settings),
made by :func:`method_spec` from whatever settings values the caller has; what every
calibrating method reads alike is the run's
:class:`~torq.calibration.data.CaptureSettings`. Each builder keys its own settings
(:meth:`TransformBuilder.key_settings`), so a spec's settings key
(:meth:`MethodSpec.key`) names exactly what makes its quantized model.

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
from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.errors import TorqError
from torq.surgery.gptq import GPTQConfig, gptq_key
from torq.surgery.qlinear import QuantConfig

WEIGHT_QUANTIZERS: tuple[str, ...] = ("rtn", "gptq")
GPTQ_SUFFIX = "+gptq"
# ``<method>+gptaq``: GPTQ on GPTAQ's asymmetric loss, its asymmetric term weighted as in
# GPTAQ's own code (α = 0.25; :class:`~torq.surgery.gptq.GPTQConfig`'s ``asymmetry``)
GPTAQ_SUFFIX = "+gptaq"
GPTAQ_ASYMMETRY = 0.25
# ``<method>+qronos``: the same solver on the mismatched loss ``‖Ŵ X̃ − W X‖²`` in full
# (α = 1), which is Qronos (Zhang et al., ICLR 2026): its first step, the least-squares
# correction of every weight to the quantized inputs, is the shifted start
# ``W + W C (H + λI)⁻¹``, and its later steps are GPTQ's on ``H + λI``, ``H = X̃ X̃ᵀ``. λ is
# its reference code's (Brevitas): 10⁻³ of H's largest eigenvalue, not GPTQ's 1 % of H's
# mean diagonal. On SmolLM2 it fails with either damping (152.1 and 216.5 on the default's
# transform, where Brevitas's own Qronos works): docs/recipes.md says what still differs
QRONOS_SUFFIX = "+qronos"
QRONOS_ASYMMETRY = 1.0
QRONOS_DAMP = 1e-3
QRONOS_SETTINGS: tuple[tuple[str, Any], ...] = (
    ("asymmetry", QRONOS_ASYMMETRY),
    ("damp", QRONOS_DAMP),
    ("damp_scale", "largest-eigenvalue"),
)
# each weight-quantizer suffix: its name in descriptions and its GPTQ settings
_GPTQ_SUFFIXES: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    GPTQ_SUFFIX: ("GPTQ", ()),
    GPTAQ_SUFFIX: ("GPTAQ", (("asymmetry", GPTAQ_ASYMMETRY),)),
    QRONOS_SUFFIX: ("Qronos", QRONOS_SETTINGS),
}


@dataclass
class MethodContext:
    """What one method reads beyond the model: its own settings (its
    :class:`MethodSpec`'s), the run's capture, the tokenizer and the run's options
    (``data_dir``, ``progress``, ``seed``)."""

    tokenizer: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    # the model's Hugging Face configuration (shapes a builder may read; the driver sets it)
    model_config: Any = None
    # the transform's own settings (a :attr:`TransformBuilder.settings_type` value; None:
    # that type's defaults) and, with GPTQ weights, GPTQ's
    settings: Any = None
    gptq: GPTQConfig | None = None
    capture: CaptureSettings = field(default_factory=CaptureSettings)


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
    # the float model's calibration states carried beside the quantized model's (which it
    # needs ``sequential``), each group's statistics with GPTAQ's cross term
    # (:meth:`torq.calibration.capture.BlockStatistics.cross_term`)
    asymmetric: bool = False
    # with ``asymmetric``, the float model's states on the first N calibration windows only,
    # N fewer than all (0: every window; :func:`float_windows`): the cross term from those
    reference_windows: int = 0
    # the calibration forwards' and statistics' arithmetic
    # (:func:`torq.calibration.capture.calibration_arithmetic`)
    arithmetic: str = "exact"


def float_windows(reference_windows: int, n_samples: int | None) -> int:
    """The calibration windows GPTAQ's float states cover where they cover fewer than all
    ``n_samples`` (``--gptaq-windows``), else 0."""
    fewer = reference_windows or 0
    return fewer if fewer and (n_samples is None or fewer < n_samples) else 0


@dataclass(frozen=True)
class RunKey:
    """What of a run makes a method's quantized model besides the method's own settings:
    the model, its formats, the window length and the run's seed (QuaRot's signs); a part of
    every settings key (:meth:`Method.settings_key`)."""

    model: str | None = None
    weight_format: str | None = "mxfp4"
    act_format: str | None = "mxfp4"
    scale_mode: str = "ocp"
    act_scale: str = "dynamic"
    ignore: tuple[str, ...] = ()
    avg_bits: float | None = None
    budget_by: str = "block"
    budget_windows: int = 16
    seqlen: int | None = 2048
    gguf_dtype: str = "float32"
    seed: int = 0


class TransformBuilder:
    """The online transform ``T`` of each input group (its inverse fused into the weights,
    ``W' = W Tᵀ``). Fixed builders answer :meth:`fixed` from the width alone; calibrating
    ones (``calibrates``) answer :meth:`for_group` from the group's statistics and weights.
    """

    calibrates: bool = False
    composes_with_gptq: bool = True
    # the frozen type of this transform's own settings (a :class:`MethodSpec` holds a value
    # of it, made from its defaults when the run gives none); None: it has none
    settings_type: type | None = None

    def fixed(self, width: int, qconfig: QuantConfig, ctx: MethodContext) -> nn.Module | None:
        """The transform for an input of ``width`` channels (``None``: none)."""
        return None

    def fixed_for(
        self, name: str, width: int, qconfig: QuantConfig, ctx: MethodContext
    ) -> nn.Module | None:
        """The transform of the linear ``name`` (its path in the model), whose input has
        ``width`` channels: :meth:`fixed`'s, unless the settings leave that linear out."""
        return self.fixed(width, qconfig, ctx)

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

    def experts_readers(
        self, groups: list[LinearGroup], experts: list[Any], ctx: MethodContext
    ) -> dict[str, list[LinearGroup]]:
        """Fused MoE experts' input groups (``experts``, by name) and the linear groups
        (``groups``) that read the same input and take the experts' transform, fitted on
        their weights and the experts' stacked (one balancing folded once for all readers,
        Qwen2-MoE's shared expert); none by default."""
        return {}

    def experts_online(self, qconfig: QuantConfig, ctx: MethodContext) -> bool:
        """Whether fused MoE experts keep an online transform on their inputs with these
        settings (the engines run none inside the experts). A builder with a transform says
        yes unless it answers otherwise; the base builder has none."""
        return type(self) is not TransformBuilder

    def residual(self, ctx: MethodContext) -> Any:
        """An offline rotation of the whole model fused part by part (embedding, each layer
        before its capture, head), as :class:`torq.surgery.fusion.ResidualRotation` does for
        QuaRot; ``None``: none."""
        return None

    def key_settings(
        self, run: RunKey, settings: dict[str, Any] | None, capture: dict[str, Any]
    ) -> dict[str, Any]:
        """What of its own ``settings`` (``asdict`` of its settings type, as records keep
        them), the run's ``capture`` and the run (its seed…) makes this transform, for the
        settings key."""
        return {}

    def capture_block(self, ctx: MethodContext) -> int:
        """The block width of the statistics a calibrating transform reads."""
        return 32

    def needs_hessian(self, ctx: MethodContext) -> bool:
        """Whether :meth:`for_group` reads each group's ``Σ x xᵀ`` (captured as GPTQ's is)
        with these settings."""
        return False

    def expert_down_shared(self, ctx: MethodContext) -> bool:
        """Fused MoE experts: whether one ``down_proj`` transform is fitted on every
        expert's inputs pooled, instead of one per expert."""
        return False

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

    def gptq_config(self, ctx: MethodContext) -> GPTQConfig:
        """The GPTQ settings this method runs with: its spec's, then its own."""
        return replace(ctx.gptq or GPTQConfig(), **dict(self.gptq_settings))

    @property
    def gptq_enabled(self) -> bool:
        return self.weights == "gptq"

    @property
    def supports_gptq(self) -> bool:
        """Whether ``<name>+gptq`` exists: this transform, then GPTQ weights."""
        return self.quantizes and self.transform.composes_with_gptq and not self.gptq_enabled

    def with_gptq(self, name: str | None = None, suffix: str = GPTQ_SUFFIX) -> Method:
        """The same transform with GPTQ weights (``<name>+gptq``), GPTAQ's (``+gptaq``: GPTQ
        against the float model's output, its asymmetric term weighted 0.25) or Qronos's
        (``+qronos``: the same loss in full, Qronos's damping),
        :func:`torq.surgery.gptq.gptq_quantize`."""
        if not self.supports_gptq:
            raise TorqError(f"method '{self.name}' does not compose with GPTQ")
        if suffix not in _GPTQ_SUFFIXES:
            raise ValueError(f"weight-quantizer suffix must be one of {sorted(_GPTQ_SUFFIXES)}")
        label, settings = _GPTQ_SUFFIXES[suffix]
        what = self.description.replace("(RTN weights)", "").rstrip()
        return replace(
            self,
            name=name or f"{self.name}{suffix}",
            description=f"{what}, {label} weights",
            weights="gptq",
            gptq_settings=settings,
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
        return ctx.capture.calibration if self.calibrates(qconfig) else None

    def settings_key(
        self,
        run: RunKey,
        settings: dict[str, Any] | None,
        gptq: dict[str, Any] | None,
        capture: dict[str, Any],
    ) -> str:
        """What makes two rows of this method the same quantized model: the model, formats
        and window length (``run``), plus what its transform keys of its own ``settings``
        and, with GPTQ, its ``gptq`` settings and the ``capture`` (as records keep them)."""
        key: dict[str, Any] = {
            "model": run.model,
            "weight_format": run.weight_format,
            "act_format": run.act_format,
            "scale_mode": run.scale_mode,
            "seqlen": run.seqlen,
        }
        if run.gguf_dtype != "float32":  # another float model
            key["gguf_dtype"] = run.gguf_dtype
        key.update(self.transform.key_settings(run, settings, capture))
        if self.gptq_enabled:
            key["gptq"] = gptq_key({**(gptq or {}), **dict(self.gptq_settings)})
            key["calibration"] = [
                capture.get(k) for k in ("calibration", "sequential", "reservoir_tokens")
            ]
        asymmetry = {**(gptq or {}), **dict(self.gptq_settings)}.get("asymmetry", 0)
        calibration = capture.get("calibration")
        n = calibration.get("n_samples") if isinstance(calibration, dict) else None
        fewer = float_windows(capture.get("reference_windows", 0), n)
        if self.gptq_enabled and asymmetry > 0 and fewer:
            # GPTAQ's cross term from fewer windows (absent for every window: earlier keys
            # stay); a method without the cross term ignores it
            key["reference_windows"] = fewer
        if self.calibrates() and capture.get("arithmetic", "exact") != "exact":
            # reduced-precision statistics make another model (absent at "exact", so the
            # keys made before stay)
            key["arithmetic"] = capture["arithmetic"]
        if run.ignore:  # linears kept in float (absent when none, so earlier keys stay)
            key["ignore"] = list(run.ignore)
        if run.avg_bits is not None:  # a precision budget (absent when none)
            key["avg_bits"] = run.avg_bits
            key["budget_by"] = run.budget_by
            key["budget_calibration"] = capture.get("calibration")  # what it is measured on
            if run.budget_windows != 16:  # absent at the default
                key["budget_windows"] = run.budget_windows
        if run.act_scale != "dynamic":
            # static activation scales: calibrated on the calibration windows (absent at
            # the default, so the keys made before stay)
            key["act_scale"] = run.act_scale
            key["act_calibration"] = [capture.get(k) for k in ("calibration", "sequential")]
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


def get_method(name: str) -> Method:
    """A registered method by name; ``<method>+gptq`` composes its transform with GPTQ
    weights (``rtn+gptq`` is ``gptq``), ``<method>+gptaq`` with GPTAQ's (``rtn+gptaq`` is
    ``gptaq``), ``<method>+qronos`` with Qronos's. Unknown names list the known ones."""
    key = name.strip().lower()
    for suffix in _GPTQ_SUFFIXES:
        if not key.endswith(suffix):
            continue
        base = key[: -len(suffix)]
        if base == "rtn":
            return get_method(suffix[1:])
        method = METHODS.get(base)
        if method is None or not method.supports_gptq:
            composable = sorted(n for n, m in METHODS.items() if m.supports_gptq and n != "rtn")
            raise TorqError(
                f"unknown method '{name}': '{suffix}' composes with rtn, {', '.join(composable)}"
            )
        return method.with_gptq(key, suffix)
    try:
        return METHODS[key]
    except KeyError:
        raise TorqError(
            f"unknown method '{name}'; known methods: {', '.join(sorted(METHODS))}"
            f" (and <method>+gptq, <method>+gptaq, <method>+qronos)"
        ) from None


@dataclass(frozen=True)
class MethodSpec:
    """A method of a run with its own settings: its name (:func:`get_method`'s), its
    transform's settings (a value of the builder's ``settings_type``, or None) and, with
    GPTQ weights, its GPTQ settings (its own, such as MR-GPTQ's, already applied)."""

    name: str
    settings: Any = None
    gptq: GPTQConfig | None = None

    @property
    def method(self) -> Method:
        return get_method(self.name)

    def context(
        self,
        capture: CaptureSettings,
        tokenizer: Any = None,
        model_config: Any = None,
        **options: Any,
    ) -> MethodContext:
        """What this method reads as it runs (:class:`MethodContext`)."""
        return MethodContext(
            tokenizer=tokenizer,
            options=options,
            model_config=model_config,
            settings=self.settings,
            gptq=self.gptq,
            capture=capture,
        )


def method_spec(name: str, *given: Any) -> MethodSpec:
    """The method ``name`` as a run holds it, its settings taken from ``given`` (settings
    values of any types: each method takes those of its own types, and its types' defaults
    where none is given)."""
    method = get_method(name)
    settings = None
    kind = method.transform.settings_type
    if kind is not None and method.quantizes:
        settings = next((g for g in given if isinstance(g, kind)), None) or kind()
    gptq = None
    if method.gptq_enabled:
        base = next((g for g in given if isinstance(g, GPTQConfig)), None) or GPTQConfig()
        gptq = replace(base, **dict(method.gptq_settings))
    return MethodSpec(method.name, settings, gptq)


def method_specs(names: list[Any], *given: Any) -> list[MethodSpec]:
    """:func:`method_spec` of each name (a spec given stays as it is), each method once."""
    specs = [n if isinstance(n, MethodSpec) else method_spec(n, *given) for n in names]
    seen: dict[str, str] = {}
    for n, spec in zip(names, specs, strict=True):
        named = n.name if isinstance(n, MethodSpec) else str(n)
        if spec.name in seen:
            first = seen[spec.name]
            twice = f"'{named}' is given twice"
            if first.strip().lower() != named.strip().lower():
                twice = f"'{first}' and '{named}' are the same method"
            raise TorqError(f"methods: {twice}")
        seen[spec.name] = named
    return specs
