"""``accelerate(model)``: a quantized model's MXFP4 W4A4 layers swapped for the packed kernels.

A model loaded from a torq checkpoint (:func:`torq.export.load_model`, weights unpacked to
float) computes every quantized linear as the fake-quant definition: ``Q_a(T x)`` times the
de-quantized ``Q_w(W Tᵀ)`` (Algorithm 3, option B). :func:`accelerate` replaces each such
layer whose weights and activations are MXFP4 (activation scales by the OCP or the nearest
rule, both of which the kernels compute) by a
:class:`~torq.kernels.linear.PackedMXFP4Linear` holding the same weight packed (4.25 bits
per weight) and the same online transform ``T``, fused into the activation pre-pass when it
is a block rotation of 32 (:func:`~torq.kernels.launch.fusable_in_prepass`), and fused MoE
experts by :class:`~torq.kernels.experts.PackedMXFP4Experts`. On a CUDA GPU
these run the Triton kernels; on a CPU the same arithmetic in float32 (the reference), so
an accelerated model's logits are the fake-quant model's within the kernels' accumulation
order. A layer that cannot be swapped keeps computing as before, and the report says why
in one line.

A compressed-tensors checkpoint loaded through transformers (:func:`torq.load`) holds plain
linears with a ``quantization_scheme`` (MXFP4 weights de-quantized to bf16, activations
quantized on the fly with the nearest rule, compressed-tensors' own) and their online
Hadamard as a transform module run by a forward pre-hook; each such linear whose transform
is one shared 32×32 block matrix is swapped the same way, its transform read off the
module by applying it to the identity.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torq.kernels.config import SCALE_RULES, Backend
from torq.kernels.experts import PackedMXFP4Experts
from torq.kernels.linear import PackedMXFP4Linear
from torq.kernels.weight import MXFP4Weight
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import QuantExperts, QuantLinear


@dataclass
class AccelerateReport:
    """What :func:`accelerate` did: the layers swapped, and each layer left as it was with
    its one-line reason."""

    swapped: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    # layers that read one input and run as one packed product (q/k/v; gate/up)
    shared: list[list[str]] = field(default_factory=list)

    def summary(self) -> str:
        """One line: how many layers run on the kernels, and the reasons for the others."""
        line = f"{len(self.swapped)} layers on torq's MXFP4 W4A4 kernels"
        if self.shared:
            line += f" ({sum(map(len, self.shared))} of them in {len(self.shared)} shared products)"
        if self.kept:
            reasons = Counter(self.kept.values())
            line += "; kept as they were: " + "; ".join(
                f"{n} ({reason})" for reason, n in reasons.most_common()
            )
        return line


def _format_reason(config: object) -> str | None:
    """Why a layer quantized with ``config`` (a :class:`~torq.surgery.QuantConfig`) cannot
    run on the kernels (None: it can)."""
    for side in ("weight", "activation"):
        spec = getattr(config, side)
        if spec is None:
            return f"float {side}s: the kernels run W4A4"
        if spec.name != "mxfp4" or spec.block_size != 32:
            return f"{side}s in {spec.name}: the kernels compute MXFP4 in blocks of 32"
        if spec.scale_mode not in SCALE_RULES:
            return (
                f"{side}s in MXFP4 with the {spec.scale_mode} rule: the kernels compute the OCP "
                "and nearest rules"
            )
    return None


def packed_linear(module: QuantLinear, backend: Backend = "auto") -> PackedMXFP4Linear:
    """``module`` as a :class:`PackedMXFP4Linear`: its weight (on the MXFP4 grid already)
    packed, checked to de-quantize to the same values, and its online transform kept."""
    reason = _format_reason(module.config)
    if reason is not None:
        raise ValueError(reason)
    packed = module.packed_weight()
    if packed is None:
        raise ValueError("its weight is not on the MXFP4 grid (not packed exactly)")
    weight = MXFP4Weight.from_packed(packed)
    bias = None if module.bias is None else module.bias.detach().clone()
    nearest = module.config.activation.scale_mode == "nearest"
    return PackedMXFP4Linear(
        weight, bias, input_transform=module.input_transform, backend=backend, nearest=nearest
    )


def _ct_args_reason(args: object, side: str) -> str | None:
    """Why a compressed-tensors ``QuantizationArgs`` is not what the kernels compute."""
    if args is None:
        return f"float {side}s: the kernels run W4A4"
    bits, kind = getattr(args, "num_bits", None), str(getattr(args, "type", ""))
    group = getattr(args, "group_size", None)
    if bits != 4 or not kind.endswith("float") or group != 32:
        return f"{side}s in {kind}{bits}, groups of {group}: the kernels compute MXFP4"
    return None


def _ct_block_transform(module: nn.Module) -> tuple[nn.Module | None, str | None]:
    """The online input transform compressed-tensors attached to ``module``, as a
    :class:`BlockRotation` of one 32×32 matrix (``None`` when it has none), or the reason
    it is not one."""
    transforms = [
        m
        for m in module.children()
        if type(m).__module__.startswith("compressed_tensors.transform")
        and getattr(getattr(m, "args", None), "location", None) == "input"
    ]
    if len(transforms) != len(list(module.children())) or len(transforms) > 1:
        return None, "other modules than one online input transform are attached to it"
    if not transforms:
        return None, None
    k = module.in_features
    if k % 32:
        return None, "its online transform is not on blocks of 32"
    # two probes of 32 rows (not the identity of the whole width: 0.8 GB at 14336): the
    # basis of one block in every block at once, and in the first block alone; a transform
    # that is one 32×32 matrix B on every block gives B in every block, and B then zeros
    eye = torch.eye(32)
    every, first = eye.repeat(1, k // 32), torch.cat([eye, torch.zeros(32, k - 32)], 1)
    with torch.no_grad():
        got = [transforms[0](x.to(module.weight.device)).float().cpu() for x in (every, first)]
    block = got[1][:, :32].clone()
    if not torch.equal(got[0], block.repeat(1, k // 32)) or got[1][:, 32:].any():
        return None, "its online transform is not one 32×32 matrix on every block"
    rotation = BlockRotation(32, None, block)
    with torch.no_grad():  # the rotation's convention checked against the module's
        probes = zip((every, first), got, strict=True)
        same = all(torch.allclose(rotation(x), y, atol=1e-6) for x, y in probes)
    if not same:
        return None, "its online transform is not the block matrix it was read as"
    return rotation, None


def _ct_packed(module: nn.Linear, backend: Backend) -> PackedMXFP4Linear:
    """A compressed-tensors linear (module doc) as a :class:`PackedMXFP4Linear`."""
    scheme = module.quantization_scheme  # type: ignore[attr-defined]
    for side, args in (("weight", scheme.weights), ("activation", scheme.input_activations)):
        reason = _ct_args_reason(args, side)
        if reason is not None:
            raise ValueError(reason)
    if not hasattr(module, "weight"):  # still compressed (before the model's first call)
        from compressed_tensors.compressors import decompress_module

        decompress_module(module)
    rotation, reason = _ct_block_transform(module)
    if reason is not None:
        raise ValueError(reason)
    weight = MXFP4Weight.from_quantized(module.weight)
    bias = None if module.bias is None else module.bias.detach().clone()
    return PackedMXFP4Linear(weight, bias, input_transform=rotation, backend=backend, nearest=True)


class SharedInputLinears(nn.Module):
    """Packed layers that read one input (q/k/v; gate/up) as one product: their packed rows
    stacked into one :class:`PackedMXFP4Linear`, so the input is transformed and quantized
    once and the weights are read in one GEMV; each layer's output is its columns of the
    product. The product of an input is kept until every layer of the group has read it
    (keyed on the input tensor itself and its version, so another input is computed anew)."""

    def __init__(self, layers: list[PackedMXFP4Linear]) -> None:
        super().__init__()
        first = layers[0]
        codes = torch.cat([m.codes for m in layers])
        scales = torch.cat([m.scales for m in layers])
        bias = None
        given = [m.bias for m in layers if m.bias is not None]
        if given:  # a layer without a bias adds zeros
            bias = torch.cat(
                [
                    m.bias if m.bias is not None else given[0].new_zeros(m.out_features)
                    for m in layers
                ]
            )
        self.linear = PackedMXFP4Linear(
            MXFP4Weight(codes, scales, first.in_features),
            bias,
            first.block_transform,
            first.input_transform,
            first.backend,
            nearest=first.nearest,
        )
        bounds = [0]
        for m in layers:
            bounds.append(bounds[-1] + m.out_features)
        self.bounds = bounds
        self._last: tuple[Any, int, torch.Tensor] | None = None
        self._pending = 0
        # torch.compile's form of the same (traced_output): [input, product, reads left]
        self._traced: list[Any] = []

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Layer ``index``'s output for the input ``x``: its columns of the product."""
        last = self._last
        if last is not None and last[0]() is x and last[1] == x._version:
            y = last[2]
        else:
            y = self.linear(x)
            self._last = (weakref.ref(x), x._version, y)
            self._pending = len(self.bounds) - 1
        self._pending -= 1
        if self._pending <= 0:
            self._last = None  # every layer has read it: not held on
        return y[..., self.bounds[index] : self.bounds[index + 1]]

    def traced_output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """:meth:`output` as ``torch.compile`` traces it: the product computed for the first
        layer that reads ``x`` and taken by the others from a list (dynamo follows a list,
        not a weak reference or a version counter). The compiler would not merge the
        layers' calls of the operator itself: it never merges custom operators."""
        held = self._traced
        if held and held[0] is x:
            y = held[1]
            held[2] -= 1
        else:
            y = self.linear(x)
            held[:] = [x, y, len(self.bounds) - 2]
        if held[2] <= 0:
            held.clear()  # every layer has read it: not held on
        return y[..., self.bounds[index] : self.bounds[index + 1]]


class SharedInputSlice(nn.Module):
    """One layer of a :class:`SharedInputLinears` group, where the layer was."""

    def __init__(self, group: SharedInputLinears, index: int) -> None:
        super().__init__()
        self.group = group
        self.index = index
        self.in_features = group.linear.in_features
        self.out_features = group.bounds[index + 1] - group.bounds[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.group.traced_output(x, self.index)
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        return f"columns {self.group.bounds[self.index]}:{self.group.bounds[self.index + 1]}"


def _same_transform(a: nn.Module | None, b: nn.Module | None) -> bool:
    if a is b:
        return True
    if a is None or b is None or type(a) is not type(b):
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _input_groups(model: nn.Module, names: list[str]) -> list[list[str]]:
    """The packed layers ``names`` that read one input tensor, found by one forward pass of
    two tokens (a layer read more than once stays alone); none when the model cannot run
    such a pass."""
    seen: dict[int, list[str]] = {}
    calls: Counter[str] = Counter()
    held: list[torch.Tensor] = []  # kept alive, so that no id is reused during the pass
    hooks = []
    for name in names:

        def hook(_m: nn.Module, args: tuple, _name: str = name) -> None:
            held.append(args[0])
            seen.setdefault(id(args[0]), []).append(_name)
            calls[_name] += 1

        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    except Exception:  # not a language model that takes input_ids: nothing shared
        return []
    finally:
        for h in hooks:
            h.remove()
    return [g for g in seen.values() if len(g) > 1 and all(calls[n] == 1 for n in g)]


def share_inputs(model: nn.Module, names: list[str]) -> list[list[str]]:
    """Put the packed layers among ``names`` that read one input into
    :class:`SharedInputLinears` groups, in place (the same input transform, scale rule and
    width: one product); returns the groups made."""
    made = []
    for group in _input_groups(model, names):
        layers = [model.get_submodule(n) for n in group]
        first = layers[0]
        if not all(
            isinstance(m, PackedMXFP4Linear)
            and m.in_features == first.in_features
            and m.nearest == first.nearest
            and m.backend == first.backend
            and m.block_transform is None
            and _same_transform(m.input_transform, first.input_transform)
            for m in layers
        ):
            continue
        shared = SharedInputLinears(layers)
        for i, name in enumerate(group):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, SharedInputSlice(shared, i))
        made.append(group)
    return made


def accelerate(model: nn.Module, backend: Backend = "auto", share: bool = True) -> AccelerateReport:
    """Swap, in place, every quantized layer of ``model`` that the MXFP4 W4A4 kernels run
    (module doc) for its packed form, on the device the layer is on; returns the
    :class:`AccelerateReport`. ``backend``: ``"auto"`` (Triton on CUDA, the reference
    elsewhere), ``"triton"`` or ``"reference"``. With ``share`` the layers that read one
    input run as one product (:class:`SharedInputLinears`)."""
    report = AccelerateReport()
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            try:
                new: nn.Module = packed_linear(module, backend)
            except ValueError as exc:
                report.kept[name] = str(exc)
                continue
        elif isinstance(module, nn.Linear) and getattr(module, "quantization_scheme", None):
            try:
                new = _ct_packed(module, backend)
            except ValueError as exc:
                report.kept[name] = str(exc)
                continue
        elif isinstance(module, QuantExperts):
            reason = _format_reason(module.config)
            if reason is not None:
                report.kept[name] = reason
                continue
            new = PackedMXFP4Experts.from_quant_experts(module, backend)
        else:
            continue
        device = next(module.parameters()).device
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new.to(device))
        report.swapped.append(name)
    if share:
        linears = [
            n for n in report.swapped if isinstance(model.get_submodule(n), PackedMXFP4Linear)
        ]
        report.shared = share_inputs(model, linears)
    return report
