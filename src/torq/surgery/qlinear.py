"""Quantized layers for simulated ("fake-quant") W4A4 inference.

A quantized linear computes ``y = Q_a(T x) · Q_w(W')ᵀ + b``: the optional online input
transform ``T`` (identity for RTN; the TORQ or Hadamard rotation for later methods), then
block quantization of the activation along the reduction dimension, then a float matmul with
weights that were quantized once, offline, with blocks along their input dimension. This is
the computation of the paper's Algorithm 3 (Appendix A.3) with Option B (weight fusion).
"""

from __future__ import annotations

import fnmatch
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from torq.formats import FormatSpec, PackedTensor, fake_quantize, get_format, pack_exact
from torq.formats.config import HIGH_PRECISION_FORMAT, scale_mode_for
from torq.formats.reference import nvfp4_tensor_scale, tensor_amax

T = TypeVar("T")


ACT_SCALES: tuple[str, ...] = ("dynamic", "static")


@dataclass(frozen=True)
class QuantConfig:
    """What to quantize: weight and activation formats (``None`` keeps that side in float).

    ``act_scale`` is where NVFP4 activations take their FP32 tensor scale from: each tensor's
    own amax at every call (``"dynamic"``, torq's default), or one scale per activation
    quantizer calibrated beforehand from the calibration windows (``"static"``: the amax of
    the transformed input over those tokens), the form compressed-tensors and vLLM serve
    (``input_global_scale``). Only NVFP4 activations have a tensor scale.
    """

    weight: FormatSpec | None
    activation: FormatSpec | None
    act_scale: str = "dynamic"
    # linears kept in float, by name pattern (:func:`ignored`)
    ignore: tuple[str, ...] = ()
    # linears a precision budget keeps in MXFP8 (W8A8; A16 where activations stay float), by
    # full name ``layers.<i>.<name>`` (:func:`torq.driver.budget.choose_high_precision`)
    high: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.act_scale not in ACT_SCALES:
            raise ValueError(f"act_scale must be one of {ACT_SCALES}, got {self.act_scale!r}")
        if self.static_activations and (self.activation is None or self.activation.name != "nvfp4"):
            raise ValueError(
                "a static activation tensor scale is NVFP4's (its FP32 tensor scale); the "
                f"activations here are {self.activation.name if self.activation else 'float'}"
            )

    @property
    def static_activations(self) -> bool:
        return self.act_scale == "static"

    @classmethod
    def from_names(
        cls,
        weight: str | None,
        activation: str | None,
        scale_mode: str = "ocp",
        act_scale: str = "dynamic",
        ignore: tuple[str, ...] = (),
    ) -> QuantConfig:
        def spec(name: str | None, side: str) -> FormatSpec | None:
            if name is None or name.lower() in ("", "none", "fp", "float"):
                return None
            return get_format(name.lower(), scale_mode_for(name.lower(), scale_mode, side))

        return cls(
            weight=spec(weight, "weight"),
            activation=spec(activation, "activation"),
            act_scale=act_scale,
            ignore=ignore,
        )

    @property
    def label(self) -> str:
        w = self.weight.name if self.weight else "fp"
        a = self.activation.name if self.activation else "fp"
        return f"W[{w}]A[{a}]"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "weight": self.weight.to_dict() if self.weight else None,
            "activation": self.activation.to_dict() if self.activation else None,
        }
        if self.static_activations:  # absent at the default: records made before stay equal
            out["act_scale"] = self.act_scale
        if self.ignore:
            out["ignore"] = list(self.ignore)
        if self.high:
            out["high_precision"] = {"format": HIGH_PRECISION_FORMAT, "linears": list(self.high)}
        return out

    def at(self, name: str) -> QuantConfig:
        """The formats of the linear ``name`` (``layers.<i>.<its name in the layer>``): MXFP8
        weights (and MXFP8 activations, where activations are quantized) for a linear the
        precision budget keeps (:attr:`high`), else this config."""
        if name not in self.high:
            return self

        def high(spec: FormatSpec | None) -> FormatSpec | None:
            # MXFP8 with the 4-bit format's scale rule where it has one of MXFP8's (the
            # default's "nearest" is compressed-tensors' rule for both)
            if spec is None:
                return None
            mode = spec.scale_mode if spec.scale_mode in ("ocp", "nearest") else "ocp"
            return get_format(HIGH_PRECISION_FORMAT, mode)

        return QuantConfig(
            weight=high(self.weight), activation=high(self.activation), ignore=self.ignore
        )

    def ignores(self, name: str) -> bool:
        """Whether the linear ``name`` (``layers.<i>.<its name in the layer>``) stays in
        float: a pattern of :attr:`ignore` matches it (:func:`ignored`)."""
        return ignored(name, self.ignore)


def ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a pattern matches the linear ``name`` (``layers.3.mlp.down_proj``): a
    shell-style pattern (``*``, ``?``, ``[0-3]``) matching the whole name or its last
    dot-separated parts (``down_proj``, ``mlp.*``, ``layers.[0-3].*``), or ``re:`` and a
    regular expression searched in it."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.search(pattern[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}"):
            return True
    return False


class ActivationQuantizer(nn.Module):
    """``x ↦ Q_a(T x)``: the online transform, then block fake-quantization of the activation.

    Linear layers that read the same tensor (q/k/v; gate/up) share one instance, which keeps
    the result for the last input it saw: the transform and the quantization then run once
    per tensor instead of once per layer. The cache holds the input only weakly and checks
    its version counter, so a new or modified tensor is always recomputed; it is dropped
    once every consumer has been served, so no activation outlives the forward pass.
    """

    def __init__(
        self,
        fmt: FormatSpec | None,
        transform: nn.Module | None = None,
        tensor_scale: torch.Tensor | float | None = None,
    ) -> None:
        super().__init__()
        self.fmt = fmt
        self.transform = transform
        self.consumers = 0
        self._last: tuple[weakref.ref[torch.Tensor], int, torch.Tensor] | None = None
        self._pending = 0
        # while observing (:meth:`observe`): the largest |T x| seen, for a static tensor scale
        self.observed_amax: torch.Tensor | None = None
        self._observing = False
        if tensor_scale is not None:
            self.set_tensor_scale(tensor_scale)

    @property
    def tensor_scale(self) -> torch.Tensor | None:
        """The static NVFP4 tensor scale (0-d float32), or ``None``: each tensor's own."""
        return getattr(self, "static_tensor_scale", None)

    def set_tensor_scale(self, scale: torch.Tensor | float) -> None:
        """Quantize from now on with the static NVFP4 tensor scale ``scale``."""
        if self.fmt is None or self.fmt.name != "nvfp4":
            raise ValueError("a static tensor scale is NVFP4's; this quantizer's format has none")
        value = torch.as_tensor(scale, dtype=torch.float32).reshape(()).clone()
        if not (torch.isfinite(value) and value > 0):
            raise ValueError(f"a tensor scale must be finite and positive, got {float(value)}")
        # registered only when there is one (accelerate's offload cannot place a None
        # buffer); persistent=False: checkpoints keep it in their manifest
        device = self.tensor_scale.device if self.tensor_scale is not None else None
        self.register_buffer("static_tensor_scale", value.to(device), persistent=False)

    def observe(self, on: bool = True) -> None:
        """Start (``on``) or stop recording ``observed_amax``, the largest ``|T x|`` of the
        inputs seen; the inputs are quantized as before meanwhile. Starting clears it."""
        if on:
            self.observed_amax = None
            self.clear_cache()
        self._observing = on

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            x = self.transform(x)
        if self._observing and x.numel():
            amax = x.detach().abs().amax().to(torch.float32).cpu()
            seen = self.observed_amax
            self.observed_amax = amax if seen is None else torch.maximum(seen, amax)
        if self.fmt is not None:
            scale = self.tensor_scale
            if scale is not None and scale.device != x.device:
                # set on the CPU after the module moved (calibration, a checkpoint's
                # manifest): moved once, not copied to the device at every call
                scale = self.static_tensor_scale = scale.to(x.device)
            x = fake_quantize(x, self.fmt, scale)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is None and self.fmt is None:
            return x
        try:
            version = x._version
        except RuntimeError:  # inference-mode tensors have no version counter
            return self._compute(x)
        last = self._last
        if last is not None and last[0]() is x and last[1] == version:
            self._pending -= 1
            if self._pending <= 0:
                self._last = None
            return last[2]
        out = self._compute(x)
        self._pending = self.consumers - 1
        self._last = (weakref.ref(x), version, out) if self._pending > 0 else None
        return out

    def clear_cache(self) -> None:
        self._last = None


def calibrate_activation_scales(
    module: nn.Module, forward: Callable[[], T]
) -> tuple[T, dict[str, int]]:
    """Static NVFP4 activation tensor scales (``act_scale="static"``): run ``forward`` (the
    calibration tokens through ``module``) with every NVFP4 activation quantizer in
    ``module`` recording the largest ``|T x|`` it quantizes, then give each that saw an input
    the tensor scale ``amax / (448 · 6)`` (method notes §1, the scale NVFP4 takes from a
    whole tensor), which it quantizes with from then on. Quantizers shared by several
    linears are one quantizer. Returns ``forward``'s result and how many quantizers got a
    scale (``"static"``) and how many saw no token (``"unobserved"``: an expert no
    calibration token was routed to), which keep each tensor's own."""

    quantizers = [
        m
        for m in module.modules()
        if isinstance(m, ActivationQuantizer) and m.fmt is not None and m.fmt.name == "nvfp4"
    ]
    for q in quantizers:
        q.observe(True)
    try:
        out = forward()
    finally:
        for q in quantizers:
            q.observe(False)
    counts = {"static": 0, "unobserved": 0}
    for q in quantizers:
        if q.observed_amax is None:
            counts["unobserved"] += 1
            continue
        q.set_tensor_scale(nvfp4_tensor_scale(q.observed_amax))
        q.observed_amax = None
        counts["static"] += 1
    return out, counts


def nvfp4_weight_tensor_scale(weight: torch.Tensor) -> torch.Tensor:
    """The FP32 tensor scale NVFP4 quantization of ``weight`` uses (by rounding, as
    :func:`torq.formats.fake_quantize`, or by GPTQ): ``amax(weight) / (448 · 6)``."""

    return nvfp4_tensor_scale(tensor_amax(weight.detach()))


# The linears a serving engine fuses into one (vLLM's packed modules: q/k/v, gate/up), by
# their last name under one parent. Their NVFP4 weights share one FP32 tensor scale: the
# fused linear has one global scale (vLLM takes the largest divisor), with which a member's
# own E4M3 block scales would be read wrong.
FUSED_LINEARS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


def fused_set(name: str) -> tuple[str, int] | None:
    """The fused set the linear ``name`` (a module path) belongs to: its parent's path and
    the set's index in :data:`FUSED_LINEARS`; ``None`` for a linear no engine fuses."""
    parent, _, last = name.rpartition(".")
    found = [i for i, names in enumerate(FUSED_LINEARS) if last in names]
    return (parent, found[0]) if found else None


def shared_weight_tensor_scales(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For each named weight (``name`` a module path), its NVFP4 tensor scale: that of the
    largest ``amax`` among the weights of its fused set (:func:`fused_set`) present in
    ``weights``, or its own where it belongs to none."""
    amax = {name: tensor_amax(w.detach()) for name, w in weights.items()}
    largest: dict[tuple[str, int], torch.Tensor] = {}
    for name, a in amax.items():
        key = fused_set(name)
        if key is not None:
            largest[key] = torch.maximum(largest[key], a) if key in largest else a
    out = {}
    for name, a in amax.items():
        key = fused_set(name)
        out[name] = nvfp4_tensor_scale(a if key is None else largest[key])
    return out


class QuantLinear(nn.Module):
    """A linear layer with fake-quantized weights and on-the-fly fake-quantized inputs.

    ``weight`` holds ``Q_w(W Tᵀ)`` already de-quantized to float (quantized once at
    construction); ``input_transform``, when present, is the online forward transform ``T``
    applied to the activation before quantization (Appendix A.3, steps 2–4). Layers that
    read the same tensor may share one ``input_quantizer``. ``weight_quantized`` says the
    weight is already on the format's grid (GPTQ), so it is kept as given.

    NVFP4 weights keep their FP32 tensor scale (``weight_tensor_scale``, a buffer outside
    the state dict): from it the packed form is found again exactly
    (:func:`torq.formats.packed.encode_nvfp4_exact`) for checkpoints and export. A weight
    given already quantized brings its own (:func:`nvfp4_weight_tensor_scale` of the weight
    it was quantized from), or has none; one to round is rounded with ``weight_tensor_scale``
    when given (the one its fused set shares: :func:`shared_weight_tensor_scales`), else
    its own.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        config: QuantConfig,
        input_transform: nn.Module | None = None,
        input_quantizer: ActivationQuantizer | None = None,
        weight_quantized: bool = False,
        weight_tensor_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.config = config
        if input_quantizer is None:
            input_quantizer = ActivationQuantizer(config.activation, input_transform)
        elif input_transform is not None and input_quantizer.transform is not input_transform:
            raise ValueError("input_transform and input_quantizer.transform differ")
        input_quantizer.consumers += 1
        # the online transform runs where the layer runs (shared quantizers move once)
        self.input_quantizer = input_quantizer.to(weight.device)
        with torch.no_grad():
            w = weight.detach()
            nvfp4 = config.weight is not None and config.weight.name == "nvfp4"
            if nvfp4 and not weight_quantized and weight_tensor_scale is None:
                weight_tensor_scale = nvfp4_weight_tensor_scale(weight)
            if config.weight is not None and not weight_quantized:
                w = fake_quantize(w, config.weight, weight_tensor_scale if nvfp4 else None)
            if w.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
                w = w.clone()  # the caller's tensor: kept apart (a new one is used as it is)
            self.weight = nn.Parameter(w, requires_grad=False)
            if nvfp4 and weight_tensor_scale is not None:
                # a buffer (moves with the module), outside the state dict; none at all for
                # other formats (accelerate's offload cannot place a None buffer)
                self.register_buffer(
                    "weight_tensor_scale",
                    weight_tensor_scale.detach().to(torch.float32).reshape(()).clone(),
                    persistent=False,
                )
            else:
                self.weight_tensor_scale: torch.Tensor | None = None
            self.bias = (
                nn.Parameter(bias.detach().clone(), requires_grad=False)
                if bias is not None
                else None
            )

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: QuantConfig, input_transform: nn.Module | None = None
    ) -> QuantLinear:
        return cls(linear.weight, linear.bias, config, input_transform)

    @property
    def input_transform(self) -> nn.Module | None:
        return self.input_quantizer.transform

    def packed_weight(self) -> PackedTensor | None:
        """The weight's one stored form, packed codes and scales in its format
        (:func:`~torq.formats.packed.pack_exact`), that checkpoints, the kernels and
        compressed-tensors take; ``None`` for a weight that is not quantized or that no
        packing reproduces bit for bit. ``weight`` is its values, kept for fake-quantized
        compute."""
        if self.config.weight is None:
            return None
        return pack_exact(self.weight, self.config.weight, self.weight_tensor_scale)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_quantizer(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.input_quantizer(x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {self.config.label}"
        )


class QuantExperts(nn.Module):
    """Fused MoE experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) in W4A4.

    Each expert is two linear layers, so the same rule applies (Algorithm 3, option B):
    weights quantized with blocks along their input (last) dimension; the expert input (the
    hidden state every expert reads) goes through one activation quantizer ``Q_a(T x)``, and
    each expert's ``down_proj`` input through ``Q_a(T_e h)``, with one quantizer shared by
    all experts or one per expert (``down_quantizers`` of length 1 or E). The weights hold
    ``Q_w(W Tᵀ)`` already fused with those transforms. Routing stays in float.
    """

    def __init__(self, experts: nn.Module, config: QuantConfig) -> None:
        super().__init__()
        extra = [
            n
            for n, _ in experts.named_parameters(recurse=False)
            if n not in ("gate_up_proj", "down_proj")
        ]
        if extra or getattr(experts, "is_transposed", False):
            raise NotImplementedError(
                f"fused experts {type(experts).__name__} with {extra or 'transposed weights'} "
                "are not supported yet"
            )
        with torch.no_grad():
            gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
            if config.weight is not None:
                gu, dn = fake_quantize(gu, config.weight), fake_quantize(dn, config.weight)
        self._setup(experts.act_fn, gu, dn, config, None, None)

    def _setup(
        self,
        act_fn: nn.Module,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        config: QuantConfig,
        input_quantizer: ActivationQuantizer | None,
        down_quantizers: list[ActivationQuantizer] | None,
    ) -> None:
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise ValueError("fused expert weights are 3-D [experts, out, in]")
        self.config = config
        self.num_experts = gate_up_proj.shape[0]
        self.act_fn = act_fn
        if input_quantizer is None:
            input_quantizer = ActivationQuantizer(config.activation)
        down = down_quantizers or [ActivationQuantizer(config.activation)]
        if len(down) not in (1, self.num_experts):
            raise ValueError(
                f"down_quantizers: one shared or one per expert ({self.num_experts}), "
                f"got {len(down)}"
            )
        self.input_quantizer = input_quantizer.to(gate_up_proj.device)
        self.down_quantizers = nn.ModuleList(q.to(down_proj.device) for q in down)
        self.gate_up_proj = nn.Parameter(gate_up_proj.detach().clone(), requires_grad=False)
        self.down_proj = nn.Parameter(down_proj.detach().clone(), requires_grad=False)

    @classmethod
    def from_quantized(
        cls,
        act_fn: nn.Module,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        config: QuantConfig,
        input_quantizer: ActivationQuantizer | None = None,
        down_quantizers: list[ActivationQuantizer] | None = None,
    ) -> QuantExperts:
        """Experts whose weights are already quantized (``Q_w(W Tᵀ)``: by a calibrating
        method, or read back from a checkpoint), read through the given quantizers."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(act_fn, gate_up_proj, down_proj, config, input_quantizer, down_quantizers)
        return self

    @property
    def input_transform(self) -> nn.Module | None:
        return self.input_quantizer.transform

    def packed_weights(self) -> tuple[PackedTensor | None, PackedTensor | None]:
        """``gate_up_proj`` and ``down_proj`` in their stored form (as
        :meth:`QuantLinear.packed_weight`, each ``[E, out, in]``)."""
        if self.config.weight is None:
            return None, None
        return (
            pack_exact(self.gate_up_proj, self.config.weight),
            pack_exact(self.down_proj, self.config.weight),
        )

    def down_quantizer(self, expert: int) -> ActivationQuantizer:
        """The quantizer of expert ``expert``'s ``down_proj`` input."""
        return self.down_quantizers[0 if len(self.down_quantizers) == 1 else expert]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        # Transform and quantization act per token along the hidden dimension, so doing
        # them on the whole input once equals doing them on each expert's gathered rows.
        xq = self.input_quantizer(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if e < 0 or e >= self.num_experts:
                continue
            token_idx, k_pos = torch.where(top_k_index == e)
            gate, up = F.linear(xq[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = self.down_quantizer(e)(self.act_fn(gate) * up)
            y = F.linear(h, self.down_proj[e]) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        shared = "shared" if len(self.down_quantizers) == 1 else "per expert"
        return (
            f"num_experts={self.num_experts}, {self.config.label}, "
            f"input_transform={self.input_transform is not None}, down_transforms={shared}"
        )
