"""How a method quantizes one decoder layer: its transform builder, then RTN or GPTQ weights.

A method whose transform is fixed and whose weights are RTN needs no data: each linear
gets ``T = builder.fixed(width)``, fused (``W' = W Tᵀ``) and quantized. Any other method
calibrates (Algorithm 3): the driver hands it each input group's statistics, the builder
gives the group's ``T`` (from them, for TORQ), and the group's linears are fused and
quantized sharing one activation quantizer, with RTN or, for GPTQ, on the Hessian
``T H Tᵀ`` of the inputs the fused weights see.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torq.calibration.capture import (
    BlockStatistics,
    ExpertsGroup,
    ExpertsStatistics,
    LinearGroup,
)
from torq.formats import FormatSpec, fake_quantize
from torq.formats.reference import nvfp4_tensor_scale, tensor_amax
from torq.methods.registry import LayerPlan, Method, MethodContext, float_windows
from torq.rotations.fold import ExpertTransforms
from torq.rotations.transform import BlockRotation
from torq.surgery.apply import quantize_layer
from torq.surgery.gptq import GPTQConfig, gptq_quantize
from torq.surgery.qlinear import (
    ActivationQuantizer,
    QuantConfig,
    QuantExperts,
    QuantLinear,
)

# An expert whose down_proj input was seen on fewer calibration tokens than this gets the
# transform fitted on all experts' down_proj inputs pooled (too few tokens for its own
# balancing and rotations), and GPTQ falls back to RTN for a projection with no token.
EXPERT_MIN_TOKENS = 64

_SAME = object()


def activation_error_power(
    sample: torch.Tensor, transform: BlockRotation | None, fmt: FormatSpec | None
) -> torch.Tensor:
    """``E[(Q_a(T x) − T x)²]`` per input channel (float64 ``[width]``) over the group's
    token sample ``x``: what the activation quantizer's error adds to the diagonal of the
    Hessian of the inputs the fused weights multiply (:attr:`GPTQConfig.input_noise`);
    zeros for float activations or an empty sample."""
    width = sample.shape[-1]
    if fmt is None or sample.shape[0] == 0:
        return torch.zeros(width, dtype=torch.float64)
    x = sample.float()
    if transform is not None:
        # the sample is kept on the CPU; the transform is wherever the calibration built it
        x = x.to(next((b.device for b in transform.buffers()), x.device))
    with torch.no_grad():
        t = x if transform is None else transform(x)
        error = fake_quantize(t, fmt) - t
    return error.double().pow(2).mean(0).cpu()


def quantize_group(
    layer: nn.Module,
    group: LinearGroup,
    transform: BlockRotation | None,
    qconfig: QuantConfig,
    stats: BlockStatistics | None = None,
    gptq: GPTQConfig | None = None,
    online: Any = _SAME,
    prefix: str = "",
) -> dict[str, Any]:
    """Replace a group's linears by :class:`QuantLinear` sharing one activation quantizer:
    ``W' = W Tᵀ`` fused (when ``T`` is given), then RTN or, with ``gptq``, GPTQ on the
    Hessian ``T H Tᵀ`` of the group's captured inputs (Algorithm 3, option B). ``online``:
    the transform the quantizer runs, when part of ``T`` was folded into the module that
    produces the group's input (default: ``T``). A member ``qconfig`` ignores (named
    ``prefix`` and its name) stays a float ``nn.Linear`` that reads the group's input
    untransformed: its weight takes only the channel scale folded into that input. A group
    the precision budget keeps (:meth:`QuantConfig.at`, the same for every member) is
    quantized in MXFP8, with the same transform."""
    qconfig = _group_config(qconfig, group, prefix)
    shared = ActivationQuantizer(qconfig.activation, transform if online is _SAME else online)
    record: dict[str, Any] = {}
    h = cross = None
    if gptq is not None and qconfig.weight is not None:
        if stats is None:
            raise ValueError("GPTQ needs the group's calibration statistics")
        h = stats.hessian()
        h = h if transform is None else transform.conjugate_hessian(h)
        if gptq.input_noise:
            noise = activation_error_power(stats.sample, transform, qconfig.activation)
            h = h + torch.diag(noise.to(h))
        cross = stats.cross_term() if gptq.asymmetry > 0 else None
        if cross is not None and transform is not None:
            # T C Tᵀ (C is not symmetric: conjugate_hessian of Cᵀ gives it)
            cross = transform.conjugate_hessian(cross.T.contiguous())
    tensor_scale = _group_tensor_scale(layer, group, transform, qconfig, prefix)
    for name in group.members:
        # looked up one at a time, not from a table of the layer's modules: a float linear
        # is freed as soon as its quantized replacement is in place (an 8B layer's float
        # linears are 0.87 GB)
        linear = layer.get_submodule(name)
        if qconfig.ignores(f"{prefix}{name}"):
            _keep_in_float(linear, transform, online)
            record.setdefault("ignored", []).append(name)
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        weight = linear.weight if transform is None else transform.fuse_inverse(linear.weight)
        quantized = False
        if h is not None:
            assert qconfig.weight is not None
            weight, rec = gptq_quantize(weight, h, qconfig.weight, gptq, cross, tensor_scale)
            record[name] = rec
            quantized = True
        setattr(
            parent,
            attr,
            QuantLinear(
                weight,
                linear.bias,
                qconfig,
                input_quantizer=shared,
                weight_quantized=quantized,
                weight_tensor_scale=tensor_scale,
            ),
        )
        del linear, weight
    return record


def _group_tensor_scale(
    layer: nn.Module,
    group: LinearGroup,
    transform: BlockRotation | None,
    qconfig: QuantConfig,
    prefix: str,
) -> torch.Tensor | None:
    """In NVFP4, the one FP32 tensor scale of the group's quantized weights ``W Tᵀ``: a
    serving engine fuses them into one linear (q/k/v, gate/up) with one global scale
    (:data:`~torq.surgery.qlinear.FUSED_LINEARS`). ``None`` in another format."""
    if qconfig.weight is None or qconfig.weight.name != "nvfp4":
        return None
    # ``W Tᵀ`` formed here for its amax and again when each member is quantized: holding the
    # group's fused weights instead would keep every float linear of it alive at once
    amax = [
        tensor_amax(w if transform is None else transform.fuse_inverse(w))
        for m in group.members
        if not qconfig.ignores(f"{prefix}{m}")
        for w in [layer.get_submodule(m).weight.detach()]
    ]
    return nvfp4_tensor_scale(torch.stack(amax).max()) if amax else None


def _group_config(qconfig: QuantConfig, group: LinearGroup, prefix: str) -> QuantConfig:
    """The one config of a group's members (they share an activation quantizer, and vLLM
    fuses them into one linear of one scheme): the budget chooses whole groups."""
    quantized = [f"{prefix}{m}" for m in group.members if not qconfig.ignores(f"{prefix}{m}")]
    configs = {qconfig.at(name) for name in quantized} or {qconfig}
    if len(configs) > 1:
        raise ValueError(f"{prefix}{group.name}: its linears differ in precision; keep the group")
    return configs.pop()


def _fused_experts_weight(w: torch.Tensor, transform: BlockRotation | None) -> torch.Tensor:
    """``W' = W T⁻¹`` for a stack of expert weights ``[E, N, K]`` sharing one ``T`` (a new
    tensor either way: GPTQ writes into it)."""
    if transform is None:
        return w.clone()
    e, n, k = w.shape
    return transform.fuse_inverse(w.reshape(e * n, k)).reshape(e, n, k)


def quantize_experts(
    experts: nn.Module,
    qconfig: QuantConfig,
    input_transform: BlockRotation | None = None,
    down_transforms: list[BlockRotation | None] | None = None,
    stats: ExpertsStatistics | None = None,
    gptq: GPTQConfig | None = None,
    online: ExpertTransforms | None = None,
) -> tuple[QuantExperts, dict[str, Any]]:
    """Fused MoE experts in W4A4 (Algorithm 3, option B, on every expert): the expert
    input's transform ``T`` fused into every ``gate_up_proj`` (``W'_e = W_e Tᵀ``), expert
    ``e``'s ``down_proj`` transform ``T_e`` (one shared, or one per expert) into its
    ``down_proj``; then RTN or, with ``gptq``, GPTQ on each expert's Hessians ``T H_e Tᵀ``
    of the tokens routed to it (RTN for a projection no calibration token reached).
    ``online``: the transforms the quantizers run where a fold left only part of these
    online (:func:`torq.rotations.fold.fold_expert_scales`). With no transform and RTN
    weights this is :class:`QuantExperts`' own quantization."""
    down = list(down_transforms) if down_transforms is not None else [None]
    use_gptq = gptq is not None and qconfig.weight is not None
    if input_transform is None and all(t is None for t in down) and not use_gptq:
        return QuantExperts(experts, qconfig), {}
    gu = _fused_experts_weight(experts.gate_up_proj.detach(), input_transform)
    dn = experts.down_proj.detach()
    if len(down) == 1:
        dn = _fused_experts_weight(dn, down[0])
    else:
        dn = torch.stack(
            [dn[e] if t is None else t.fuse_inverse(dn[e]) for e, t in enumerate(down)]
        )
    record: dict[str, Any] = {}
    if qconfig.weight is not None:
        if use_gptq:
            if stats is None or stats.input_per_expert is None:
                raise ValueError("GPTQ on experts needs their per-expert Hessians")
            rtn = []
            for e in range(gu.shape[0]):
                for name, w, st, t in (
                    ("gate_up_proj", gu, stats.input_per_expert[e], input_transform),
                    ("down_proj", dn, stats.down[e], down[0 if len(down) == 1 else e]),
                ):
                    if st.count == 0:
                        w[e] = fake_quantize(w[e], qconfig.weight)
                        rtn.append(f"{e}.{name}")
                        continue
                    h = st.hessian() if t is None else t.conjugate_hessian(st.hessian())
                    w[e], _ = gptq_quantize(w[e], h, qconfig.weight, gptq)
            record["gptq_rtn_fallback"] = rtn
        else:
            gu, dn = fake_quantize(gu, qconfig.weight), fake_quantize(dn, qconfig.weight)
    quantized = QuantExperts.from_quantized(
        experts.act_fn,
        gu,
        dn,
        qconfig,
        ActivationQuantizer(
            qconfig.activation, input_transform if online is None else online.input
        ),
        [
            ActivationQuantizer(qconfig.activation, t)
            for t in (down if online is None else online.down)
        ],
    )
    return quantized, record


GroupTransform = Callable[
    [LinearGroup, BlockStatistics, torch.Tensor], tuple[nn.Module | None, dict[str, Any]]
]


def _keep_in_float(linear: nn.Linear, transform: BlockRotation | None, online: Any) -> None:
    """An ignored linear of a group, in float: where the group's channel scale ``s`` was
    folded into the module that produces its input (which then gives ``x ⊘ s``), its weight
    becomes ``W diag(s)``, the same function of the float model's ``x``; otherwise it reads
    ``x`` itself and keeps ``W``."""
    scale = None if transform is None else transform.channel_scale
    if online is not _SAME and scale is not None:
        w = linear.weight.detach()
        linear.weight.data = (w.to(torch.float64) * scale.to(w.device, torch.float64)).to(w.dtype)


def _group_weight(layer: nn.Module, groups: list[LinearGroup]) -> torch.Tensor:
    """The weights of ``groups``' members stacked by rows, on the CPU (where the
    transforms are solved, beside the statistics)."""
    return torch.cat(
        [layer.get_submodule(m).weight.detach().cpu() for g in groups for m in g.members]
    )


def _with_scale_of(t: nn.Module | None, experts: nn.Module | None) -> nn.Module | None:
    """A group's transform ``t`` with the channel balancing of the experts' input transform
    (the same input, one ``⊘ s`` folded for all its readers): ``t``'s rotations after it."""
    s = experts.channel_scale if isinstance(experts, BlockRotation) else None
    if s is None:
        return t
    if t is None:
        return BlockRotation(experts.block_size, channel_scale=s)  # type: ignore[union-attr]
    if not isinstance(t, BlockRotation):
        raise TypeError(f"a {type(t).__name__} cannot take the experts' balancing")
    return t.with_channel_scale(s)


class GroupSolver:
    """The per-layer step of a calibrating method: for each input group of a layer, a
    transform (:meth:`transform`), fused and quantized by :func:`quantize_group`; whatever
    the groups do not cover (fused MoE experts) falls back to RTN."""

    def __init__(self, qconfig: QuantConfig, gptq: GPTQConfig | None = None) -> None:
        self.qconfig = qconfig
        self.gptq = gptq

    def transform(
        self, group: LinearGroup, stats: BlockStatistics, weight: torch.Tensor
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        """The group's online transform; ``weight`` is its members' weights stacked by rows."""
        raise NotImplementedError

    def __call__(
        self,
        index: int,
        layer: nn.Module,
        groups: list[LinearGroup],
        stats: dict[str, Any],
    ) -> dict[str, Any]:
        record: dict[str, Any] = {}
        transforms: dict[str, nn.Module | None] = {}
        seconds: dict[str, float] = {}
        experts = [g for g in groups if isinstance(g, ExpertsGroup)]
        groups = [g for g in groups if not isinstance(g, ExpertsGroup)]
        # Every group's transform first, from the float layer (a group's transform reads
        # only its own statistics and weights, so the order changes no number), then the
        # fold, which may change the float weights of modules in other groups, then the
        # quantization of each group.
        joint = self.experts_readers(groups, experts)
        for g in groups:
            t0 = time.perf_counter()
            # the transforms are solved on the CPU, where the statistics are kept
            weight = _group_weight(layer, [g])
            transforms[g.name], record[g.name] = self.transform(g, stats[g.name], weight)
            del weight  # (a copy of the group's weights: 0.47 GB for an 8B model's gate/up)
            seconds[g.name] = time.perf_counter() - t0
        fused: dict[str, ExpertTransforms] = {}
        for g in experts:
            t0 = time.perf_counter()
            shared = joint.get(g.name, [])
            fused[g.name], record[g.name] = self.expert_transforms(
                layer, g, stats[g.name], _group_weight(layer, shared) if shared else None
            )
            for r in shared:  # their own rotation after the experts' balancing
                transforms[r.name] = _with_scale_of(transforms[r.name], fused[g.name].input)
                record[r.name]["balancing_of"] = g.name
            seconds[g.name] = time.perf_counter() - t0
        folded = self.fold(layer, [*groups, *experts], {**transforms, **fused})
        for g in groups:
            t0 = time.perf_counter()
            rec = record[g.name]
            online: Any = _SAME
            if g.name in folded:
                online, rec["fold"] = folded[g.name]
            gptq_rec = quantize_group(
                layer,
                g,
                transforms[g.name],
                self.qconfig,
                stats[g.name],
                self.gptq,
                online,
                prefix=f"layers.{index}.",
            )
            ignored = gptq_rec.pop("ignored", None)
            if ignored:
                rec["ignored"] = ignored
            if gptq_rec:
                rec["gptq"] = gptq_rec
            rec["seconds"] = seconds[g.name] + time.perf_counter() - t0
        for g in experts:
            t0 = time.perf_counter()
            rec = record[g.name]
            kept = fused[g.name]
            if g.name in folded:
                kept, rec["fold"] = folded[g.name]
            rec.update(self.quantize_experts(layer, g, stats[g.name], fused[g.name], kept))
            rec["seconds"] = seconds[g.name] + time.perf_counter() - t0
        record["rtn_fallback"] = quantize_layer(layer, self.qconfig, f"layers.{index}.")
        return record

    def expert_down_shared(self) -> bool:
        """Whether the experts' ``down_proj`` inputs get one transform fitted on all experts'
        inputs pooled, rather than one per expert (the run's TORQ settings say)."""
        return False

    def experts_readers(
        self, groups: list[LinearGroup], experts: list[ExpertsGroup]
    ) -> dict[str, list[LinearGroup]]:
        """The groups that take the experts' input transform (the method's
        :meth:`~torq.methods.registry.TransformBuilder.experts_readers`); none by default."""
        return {}

    def calibrates(self) -> bool:
        """Whether :meth:`transform` reads the statistics (else it is one per width)."""
        return True

    def expert_transforms(
        self,
        layer: nn.Module,
        group: ExpertsGroup,
        stats: ExpertsStatistics,
        readers: torch.Tensor | None = None,
    ) -> tuple[ExpertTransforms, dict[str, Any]]:
        """A fused-experts module's transforms: :meth:`transform` on the expert input (all
        tokens; fitted on the experts' weights and ``readers``', the stacked weights of the
        groups that share it), and on each expert's ``down_proj`` input (its routed tokens,
        or pooled)."""
        path = group.members[0]
        module = layer.get_submodule(path)
        gu = module.gate_up_proj.detach().cpu()
        dn = module.down_proj.detach().cpu()
        h, i = group.width, group.intermediate
        record: dict[str, Any] = {}
        weight = gu.reshape(-1, h)
        if readers is not None:
            weight = torch.cat([weight, readers.to(weight.dtype)])
        t_in, record["gate_up_proj"] = self.transform(
            LinearGroup(f"{group.name}.gate_up_proj", [f"{path}.gate_up_proj"], h),
            stats.input,
            weight,
        )
        down_group = LinearGroup(f"{group.name}.down_proj", [f"{path}.down_proj"], i)
        # one transform per expert only where the method fits it to data (a fixed one is the
        # same for every expert) and the expert saw enough tokens; the pooled fit otherwise
        per_expert = self.calibrates() and not self.expert_down_shared()
        own = [e for e, st in enumerate(stats.down) if per_expert and st.count >= EXPERT_MIN_TOKENS]
        shared = None
        if len(own) < len(stats.down):
            shared, record["down_proj"] = self.transform(
                down_group, stats.down_shared, dn.reshape(-1, i)
            )
        down: list[nn.Module | None] = [shared]
        if own:
            down = [shared] * len(stats.down)
            for e in own:
                down[e], record[f"down_proj.{e}"] = self.transform(down_group, stats.down[e], dn[e])
        if per_expert:
            record["down_proj_own_transform"] = own
        record["tokens_per_expert"] = [st.count for st in stats.down]
        return ExpertTransforms(t_in, down), record

    def quantize_experts(
        self,
        layer: nn.Module,
        group: ExpertsGroup,
        stats: ExpertsStatistics,
        fused: ExpertTransforms,
        online: ExpertTransforms,
    ) -> dict[str, Any]:
        """:func:`quantize_experts` with the ``fused`` transforms in the weights and the
        ``online`` ones run on the inputs (the same, or what a fold left of them); the module
        is replaced in place."""
        path = group.members[0]
        module = layer.get_submodule(path)
        quantized, record = quantize_experts(
            module, self.qconfig, fused.input, fused.down, stats, self.gptq, online
        )
        parent_name, _, attr = path.rpartition(".")
        setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, quantized)
        return record

    def fold(
        self, layer: nn.Module, groups: list[LinearGroup], transforms: dict[str, nn.Module | None]
    ) -> dict[str, tuple[nn.Module | None, dict[str, Any]]]:
        """The transforms to run online where part of one was folded into the layer's float
        weights (:meth:`TransformBuilder.fold`); none by default."""
        return {}


class _BuilderSolver(GroupSolver):
    def __init__(
        self, method: Method, qconfig: QuantConfig, ctx: MethodContext, gptq: GPTQConfig | None
    ) -> None:
        super().__init__(qconfig, gptq)
        self.method, self.ctx = method, ctx

    def transform(
        self, group: LinearGroup, stats: BlockStatistics, weight: torch.Tensor
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        return self.method.transform.for_group(group, stats, weight, self.qconfig, self.ctx)

    def fold(
        self, layer: nn.Module, groups: list[LinearGroup], transforms: dict[str, nn.Module | None]
    ) -> dict[str, tuple[nn.Module | None, dict[str, Any]]]:
        return self.method.transform.fold(layer, groups, transforms, self.qconfig, self.ctx)

    def expert_down_shared(self) -> bool:
        return self.method.transform.expert_down_shared(self.ctx)

    def experts_readers(
        self, groups: list[LinearGroup], experts: list[ExpertsGroup]
    ) -> dict[str, list[LinearGroup]]:
        return self.method.transform.experts_readers(groups, experts, self.ctx)

    def calibrates(self) -> bool:
        return self.method.transform.calibrates


def layer_plan(method: Method, qconfig: QuantConfig, ctx: MethodContext) -> LayerPlan:
    """``method`` as a :class:`LayerPlan` (module doc)."""
    if not method.quantizes:
        return LayerPlan(None)
    builder = method.transform
    builder.check(qconfig, ctx)
    record = builder.record(qconfig, ctx)
    parts = builder.residual(ctx)
    capture = ctx.capture
    static = qconfig.static_activations
    if static:
        record = {**record, "act_scale": qconfig.act_scale}
    if not method.calibrates():

        def factory(name: str, linear: nn.Linear) -> nn.Module | None:
            transform = builder.fixed_for(name, linear.in_features, qconfig, ctx)
            if transform is not None:
                linear.weight.data = transform.fuse_inverse(linear.weight)
            return transform

        def experts(name: str, module: nn.Module) -> nn.Module:
            gu, dn = module.gate_up_proj, module.down_proj
            t_in = builder.fixed(gu.shape[-1], qconfig, ctx)
            t_down = builder.fixed(dn.shape[-1], qconfig, ctx)
            return quantize_experts(module, qconfig, t_in, [t_down])[0]

        def quantize(li: int, layer: nn.Module, _groups: list, _stats: dict) -> dict[str, Any]:
            return {"replaced": quantize_layer(layer, qconfig, f"layers.{li}.", factory, experts)}

        if not static:
            return LayerPlan(quantize, record=record, parts=parts)
        # the calibration windows only to observe each quantized layer's inputs
        return LayerPlan(
            quantize,
            calibration=capture.calibration,
            record=record,
            parts=parts,
            capture_stats=False,
            observe_activations=True,
        )
    gptq = method.gptq_config(ctx) if method.gptq_enabled else None
    if gptq is not None:
        record = {**record, "gptq": gptq.__dict__}
    # GPTAQ: the quantized model's inputs with the float model's beside them
    asymmetric = gptq is not None and gptq.asymmetry > 0
    return LayerPlan(
        _BuilderSolver(method, qconfig, ctx, gptq),
        calibration=capture.calibration,
        block_size=builder.capture_block(ctx),
        reservoir=capture.reservoir_tokens,
        sequential=capture.sequential or asymmetric,
        hessian=gptq is not None or builder.needs_hessian(ctx),
        record=record,
        parts=parts,
        observe_activations=static,
        asymmetric=asymmetric,
        reference_windows=(
            float_windows(capture.reference_windows, capture.calibration.n_samples)
            if asymmetric
            else 0
        ),
        arithmetic=capture.arithmetic,
    )
