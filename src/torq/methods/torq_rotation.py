"""TORQ: the two-level orthogonal rotation, calibrated on real activations and fused.

For every group of linear layers that read the same tensor, the calibration statistics
give the inter-block rotations ``R_k`` (§5.1, Algorithm 1, from ``Σ_k``) and the intra-block
rotation ``R_intra`` (§5.2, Algorithm 2, from sampled blocks after the inter-block
rotation). The group's online transform ``T`` (inter, then intra) runs before activation
quantization; ``W' = W Tᵀ`` is fused into each member's weight, which is then quantized
(Algorithm 3, option B). ``torq-inter`` and ``torq-intra`` are the paper's ablations
(Table 3): one level only.

torq's addition (``balance``, on by default; ``balance=None`` is the paper's method): a
per-channel scale that balances activation and weight energy runs first
(:mod:`torq.rotations.balance`), and both rotations are fitted to the balanced statistics.

``balance_check`` (``--balance-check``): each group's balancing strength chosen from the
scales' powers ``s^β``, ``β ∈ {0, ½, 1}`` (0: none), by the group's W4A4 output error on its
sampled tokens with ``H₃₂`` as probe and RTN weights, or with ``balance_probe="gptq"``
(``--balance-check gptq``) GPTQ's weights on the group's Hessian (:func:`choose_balance_power`).

``guard`` (``torq-guard``): the intra-block rotation is fitted on part of each group's sampled
tokens, and the calibrated transform is kept only where it lowers the group's W4A4 output
error ``‖X Wᵀ − Q_a(T x) Q_w(W T⁻¹)ᵀ‖² / ‖X Wᵀ‖²`` on the tokens held back; elsewhere the
group gets ``torq-had32``'s transform (the balancing and ``H₃₂``). Each group records both
errors and what was chosen.

``calibrate`` (``--torq-calibrate o_proj``): the calibrated rotations for the named groups
only, ``torq-had32``'s transform for the others. ``unrotated`` (``--unrotated q_proj``):
no rotation for the named groups, their balancing alone (folded: no online transform).
``permute`` (``torq-perm``): no calibrated rotation; after the balancing the channels are
regrouped so that every block carries an equal share of ``rms(x_j)·‖w_j‖``
(:func:`torq.rotations.balance.block_mass_permutation`), then ``H₃₂``, the permutation
checked by the guard like a calibrated transform (docs/research/method.md §10.3).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from torq.calibration.capture import BlockStatistics, ExpertsGroup, LinearGroup
from torq.errors import TorqError
from torq.formats import FormatSpec, fake_quantize
from torq.methods.registry import Method, MethodContext, RunKey, TransformBuilder, register
from torq.methods.settings import BALANCE_POWERS, EXPERTS_MEMBER, TorqSettings, torq_key
from torq.rotations.balance import (
    balance_covariance,
    balance_scales,
    block_mass_permutation,
    channel_energy,
    tied_energies,
)
from torq.rotations.fold import (
    ExpertTransforms,
    check_foldable,
    fold_expert_scales,
    fold_scales,
    is_o_proj,
    o_proj_ties,
    producer_of,
)
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.inter_block import inter_block_rotations
from torq.rotations.intra_block import fit_intra_block_rotation
from torq.rotations.transform import BlockRotation
from torq.surgery.fusion import ResidualRotation, block_hadamard_residual
from torq.surgery.gptq import gptq_quantize
from torq.surgery.qlinear import QuantConfig


def build_group_transform(
    stats: BlockStatistics,
    settings: TorqSettings,
    fmt: FormatSpec | None = None,
    weight: torch.Tensor | None = None,
    weight_fmt: FormatSpec | None = None,
    ties: torch.Tensor | None = None,
    solver_device: torch.device | None = None,
) -> tuple[BlockRotation, dict[str, Any]]:
    """``T`` for one input group (Algorithm 3, steps 1–3): the balancing scales ``s`` (torq's
    addition, from ``E[x_j²]`` and the group's stacked ``weight``), inter-block ``R_k`` from
    the balanced ``Σ_k`` (Algorithm 1), then ``R_intra`` (Algorithm 2) on balanced blocks.
    With ``settings.guard`` the transform is checked on held-back tokens against the
    balanced ``H₃₂`` (module doc; ``fmt``/``weight_fmt``: the activation and weight formats).
    ``ties``: channels that must share one balancing scale (:func:`balance.tied_energies`).
    ``solver_device``: where Algorithms 1 and 2 run (their inputs are moved there and their
    rotations back to the CPU); ``None``: the CPU, where the statistics are kept."""
    k = settings.block_size
    record: dict[str, Any] = {"tokens": stats.count, "width": stats.width}
    fit_sample, held = stats.sample, None
    held_back = settings.guard if settings.guard is not None else settings.rotation_check
    if held_back is not None:
        if weight is None:
            raise ValueError("the guard and the rotation check need the group's weights")
        n = stats.sample.shape[0]
        n_held = round(n * held_back)
        if 0 < n_held < n:  # the reservoir's rows are a random draw: the last ones are too
            fit_sample, held = stats.sample[: n - n_held], stats.sample[n - n_held :]
    covariance = stats.covariance()
    scales = None
    if settings.balance is not None:
        if weight is None:
            raise ValueError("channel balancing needs the group's weights")
        energy, balance_weight = channel_energy(covariance), weight
        if ties is not None:
            energy, balance_weight = tied_energies(energy, weight, ties)
        scales = balance_scales(energy, balance_weight, settings.balance)
        record["balance"] = {
            "alpha": settings.balance,
            "scale_min": float(scales.min()),
            "scale_max": float(scales.max()),
        }
        if settings.balance_check:
            hessian = stats.hessian() if settings.balance_probe == "gptq" else None
            scales, record["balance"]["check"] = choose_balance_power(
                stats.sample, weight, scales, k, fmt, weight_fmt, hessian=hessian
            )
        if scales is not None:
            covariance = balance_covariance(covariance, scales)
    if not (settings.use_inter or settings.use_intra or scales is not None):
        raise ValueError("TORQ settings select no transform (no inter, intra or balancing)")
    perm = None
    if settings.permute:
        perm = _block_mass_permutation(fit_sample, weight, scales, settings, record)
    r_inter, r_intra = _rotations(
        covariance, fit_sample, scales, perm, settings, solver_device, record
    )
    transform = BlockRotation(
        k,
        r_inter,
        r_intra,
        dtype=torch.float32,
        channel_scale=None if scales is None else scales.to(torch.float32),
        channel_perm=perm,
    )
    if held is not None and settings.guard is not None:
        assert weight is not None
        transform = _guarded(transform, held, weight, scales, k, fmt, weight_fmt, record)
    rotated = transform.r_inter is not None or transform.r_intra is not None
    if held is not None and settings.rotation_check is not None and scales is not None and rotated:
        assert weight is not None
        transform = _rotation_kept(transform, held, weight, scales, k, fmt, weight_fmt, record)
    if fmt is not None and stats.sample.shape[0]:
        # Diagnostic: relative activation quantization error on the sampled tokens, without
        # and with the transform (relative to each one's own energy: with balancing T is not
        # orthogonal).
        x = stats.sample
        record["act_rel_err"] = {
            "rtn": relative_quant_error(x, fmt),
            "transformed": relative_quant_error(transform(x), fmt),
        }
    return transform, record


def _block_mass_permutation(
    fit_sample: torch.Tensor,
    weight: torch.Tensor | None,
    scales: torch.Tensor | None,
    settings: TorqSettings,
    record: dict[str, Any],
) -> torch.Tensor:
    """The channel permutation that gives each block an equal share of ``rms(x_j)·‖w_j‖``
    after the balancing (:func:`block_mass_permutation`), recorded with the blocks' mass."""
    k = settings.block_size
    if scales is None or weight is None or settings.use_inter:
        raise ValueError("the block-mass permutation needs the balancing and no inter level")
    x_rms = (fit_sample.to(torch.float64) / scales).pow(2).mean(0).sqrt()
    w_norm = (weight.detach().to(torch.float64) * scales).pow(2).sum(0).sqrt()
    mass = x_rms * w_norm
    perm = block_mass_permutation(mass, k)
    record["permutation"] = {
        "block_mass_sq_before": float(mass.reshape(-1, k).sum(1).pow(2).sum()),
        "block_mass_sq_after": float(mass[perm].reshape(-1, k).sum(1).pow(2).sum()),
    }
    return perm


def _rotations(
    covariance: torch.Tensor,
    fit_sample: torch.Tensor,
    scales: torch.Tensor | None,
    perm: torch.Tensor | None,
    settings: TorqSettings,
    solver_device: torch.device | None,
    record: dict[str, Any],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The inter-block rotations ``R_k`` from the balanced ``Σ_k`` (Algorithm 1) and
    ``R_intra`` (Algorithm 2) on the balanced, permuted, inter-rotated blocks of the
    sample, each where its settings ask for it, recorded."""
    k = settings.block_size
    r_inter = None
    if settings.use_inter:
        r_inter, info = inter_block_rotations(covariance.to(solver_device), settings.inter)
        r_inter = r_inter.cpu()
        record["inter"] = {"rotations": info.rotations, "max_rel_deviation": info.max_rel_deviation}
    r_intra = None
    if settings.use_intra:
        sample = fit_sample.to(torch.float64)
        if scales is not None:
            sample = sample / scales
        if perm is not None:
            sample = sample[:, perm]
        if r_inter is not None:
            sample = BlockRotation(k, r_inter, None, dtype=torch.float64)(sample)
        result = fit_intra_block_rotation(sample.reshape(-1, k).to(solver_device), settings.intra)
        r_intra = result.rotation.cpu()
        record["intra"] = {
            "loss_first": result.loss_history[0],
            "loss_last": result.loss_history[-1],
            "iterations": len(result.loss_history) - 1,
            "rotations": result.n_rotations,
            "stop_reason": result.stop_reason,
            "samples": result.n_samples,
        }
    return r_inter, r_intra


def _guarded(
    transform: BlockRotation,
    held: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    k: int,
    fmt: FormatSpec | None,
    weight_fmt: FormatSpec | None,
    record: dict[str, Any],
) -> BlockRotation:
    """The guard: the calibrated ``transform`` or the balanced ``H_K`` (torq-had32's:
    Algorithm 2 from ``H_K``, no step), whichever has the lower W4A4 output error on the
    ``held`` tokens, recorded."""
    fallback = BlockRotation(
        k,
        None,
        hadamard_matrix(k, dtype=torch.float64),
        dtype=torch.float32,
        channel_scale=None if scales is None else scales.to(torch.float32),
    )
    errors = {
        "calibrated": output_error(held, weight, transform, fmt, weight_fmt),
        "hadamard": output_error(held, weight, fallback, fmt, weight_fmt),
    }
    chosen = "calibrated" if errors["calibrated"] < errors["hadamard"] else "hadamard"
    record["guard"] = {"held_tokens": held.shape[0], "error": errors, "chosen": chosen}
    return fallback if chosen == "hadamard" else transform


def _rotation_kept(
    transform: BlockRotation,
    held: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    k: int,
    fmt: FormatSpec | None,
    weight_fmt: FormatSpec | None,
    record: dict[str, Any],
) -> BlockRotation:
    """The rotation check: ``transform`` or its balancing alone (``x ⊘ s``, no rotation),
    whichever has the lower W4A4 output error on the ``held`` tokens (RTN weights),
    recorded."""
    balanced = BlockRotation(k, None, None, dtype=torch.float32, channel_scale=scales.float())
    errors = {
        "rotated": output_error(held, weight, transform, fmt, weight_fmt),
        "balanced": output_error(held, weight, balanced, fmt, weight_fmt),
    }
    chosen = "rotated" if errors["rotated"] <= errors["balanced"] else "balanced"
    record["rotation_check"] = {"held_tokens": held.shape[0], "error": errors, "chosen": chosen}
    return transform if chosen == "rotated" else balanced


@torch.no_grad()
def choose_balance_power(
    sample: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    fmt: FormatSpec | None,
    weight_fmt: FormatSpec | None,
    hessian: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """The balancing check (torq's, per group): of the scales ``s^β``, ``β`` in
    :data:`~torq.methods.settings.BALANCE_POWERS`, the one whose W4A4 output error
    (:func:`output_error`) on the group's sampled tokens ``sample`` is lowest, each probed
    with ``H_K`` after the scales. The weights are RTN's, or with ``hessian`` (``Σ x xᵀ``
    over every calibration token of the group) GPTQ's on the probe's Hessian ``T Σ Tᵀ``
    (:func:`torq.surgery.gptq.gptq_quantize`, its default settings): GPTQ absorbs part of
    what the balancing moves into the weights, so RTN's error can prefer a balancing that
    GPTQ's does not. Returns the chosen scales (``None`` for ``β = 0``, no balancing) and a
    record of every error. The scales come from ``E[x_j²]`` over every calibration token,
    so nothing is fitted to ``sample`` alone; the probe stands in for the calibrated
    rotations too."""
    if sample.shape[0] == 0:
        return scales, {"chosen_power": 1.0, "reason": "no sampled tokens"}
    errors: dict[str, float] = {}
    best: tuple[float, float, torch.Tensor | None] | None = None
    h = hadamard_matrix(block_size, dtype=torch.float64)
    w32 = weight.detach().to(torch.float32)
    for power in BALANCE_POWERS:
        s = None if power == 0.0 else scales.pow(power)
        probe = BlockRotation(
            block_size,
            None,
            h,
            dtype=torch.float32,
            channel_scale=None if s is None else s.to(torch.float32),
        )
        quantized = None
        if hessian is not None and weight_fmt is not None:
            h_t = probe.conjugate_hessian(hessian.to(torch.float64))
            fused = probe.fuse_inverse(w32).to(h_t.device)
            quantized = gptq_quantize(fused, h_t, weight_fmt)[0].to(weight.device)
        err = output_error(sample, weight, probe, fmt, weight_fmt, quantized=quantized)
        errors[str(power)] = err
        if best is None or err < best[0]:
            best = (err, power, s)
    assert best is not None
    record = {
        "chosen_power": best[1],
        "error": errors,
        "tokens": sample.shape[0],
        "weights": "rtn" if quantized is None else "gptq",
    }
    return best[2], record


@torch.no_grad()
def output_error(
    x: torch.Tensor,
    weight: torch.Tensor,
    transform: BlockRotation,
    fmt: FormatSpec | None,
    weight_fmt: FormatSpec | None,
    rows: int = 4096,
    quantized: torch.Tensor | None = None,
) -> float:
    """The W4A4 output error of a group with ``transform`` on inputs ``x [n, width]``:
    ``‖x Wᵀ − Q_a(T x) Q_w(W T⁻¹)ᵀ‖² / ‖x Wᵀ‖²`` (Algorithm 3, option B, RTN weights, or
    ``quantized``, the fused weight already quantized, e.g. by GPTQ), in float64, ``rows``
    of the stacked ``weight`` at a time (an 8B gate/up group is 28672)."""
    xt = transform(x.to(torch.float32))
    xq = (xt if fmt is None else fake_quantize(xt, fmt)).to(torch.float64)
    x64 = x.to(torch.float64)
    err = ref = 0.0
    for r in range(0, weight.shape[0], rows):
        w = weight[r : r + rows].to(torch.float32)
        if quantized is not None:
            wq = quantized[r : r + rows]
        else:
            fused = transform.fuse_inverse(w)
            wq = fused if weight_fmt is None else fake_quantize(fused, weight_fmt)
        y = x64 @ w.to(torch.float64).T
        err += float((y - xq @ wq.to(torch.float64).T).pow(2).sum())
        ref += float(y.pow(2).sum())
    return err / max(ref, 1e-300)


def relative_quant_error(x: torch.Tensor, fmt: FormatSpec) -> float:
    """``‖x − Q(x)‖² / ‖x‖²`` of block fake quantization along the last dimension."""
    err = (x - fake_quantize(x, fmt)).double().pow(2).sum()
    return float(err / x.double().pow(2).sum().clamp_min(1e-300))


class TorqTransform(TransformBuilder):
    """TORQ's calibrated transform of each input group (:func:`build_group_transform`) with
    the run's :class:`TorqSettings`, one or both levels, or the fixed ``H₃₂`` after the
    balancing (``fixed_hadamard``: Algorithm 2 from the Hadamard with no iteration)."""

    calibrates = True
    settings_type = TorqSettings

    def __init__(
        self,
        use_inter: bool = True,
        use_intra: bool = True,
        fixed_hadamard: bool = False,
        guard: float | None = None,
        permute: bool = False,
    ) -> None:
        self.use_inter, self.use_intra, self.fixed_hadamard = use_inter, use_intra, fixed_hadamard
        self.guard = guard  # the method's own held-back fraction, unless the run sets one
        self.permute = permute

    def settings(self, qconfig: QuantConfig, ctx: MethodContext) -> TorqSettings:
        """The spec's settings with this method's levels, and the intra-block solver's scale
        rule that of the MXFP4 activations it fits for."""
        base: TorqSettings = ctx.settings or TorqSettings()
        settings = replace(base, use_inter=self.use_inter, use_intra=self.use_intra)
        if self.fixed_hadamard:
            settings = replace(
                settings,
                calibrate=None,
                intra=replace(settings.intra, init="hadamard", max_iter=0),
            )
        if self.guard is not None and settings.guard is None:
            settings = replace(settings, guard=self.guard)
        if self.permute:
            settings = replace(settings, permute=True)
        act = qconfig.activation
        if act is not None and act.name == "mxfp4" and settings.intra.scale_mode != act.scale_mode:
            settings = replace(settings, intra=replace(settings.intra, scale_mode=act.scale_mode))
        return settings

    def for_group(
        self,
        group: LinearGroup,
        stats: BlockStatistics,
        weight: torch.Tensor,
        qconfig: QuantConfig,
        ctx: MethodContext,
    ) -> tuple[nn.Module | None, dict[str, Any]]:
        settings = self.settings(qconfig, ctx)
        if not settings.rotates(group):
            if settings.balance is None:  # nothing left to do online or to fold
                return None, {"tokens": stats.count, "width": stats.width, "unrotated": True}
            settings = settings.balancing_only()
        elif not settings.calibrates(group):
            settings = settings.fixed_hadamard()
        ties = None
        if settings.fold and settings.balance is not None and is_o_proj(group):
            ties = o_proj_ties(ctx.model_config)
        solver_device = stats.device if settings.solver_device == "calibration" else None
        return build_group_transform(
            stats,
            settings,
            qconfig.activation,
            weight,
            qconfig.weight,
            ties=ties,
            solver_device=solver_device,
        )

    def check(self, qconfig: QuantConfig, ctx: MethodContext) -> None:
        """Refuse settings that cannot work (the intra-block solver's against the block
        size, torq-perm's permutation without the balancing) and, once the model is known,
        a model whose balancing cannot be folded."""
        try:
            settings = self.settings(qconfig, ctx)
        except ValueError as exc:
            raise TorqError(str(exc)) from None
        try:
            settings.intra.resolved(settings.block_size)
        except ValueError as exc:
            raise TorqError(f"TORQ's intra-block settings: {exc}") from None
        if settings.fold and ctx.model_config is not None:
            check_foldable(ctx.model_config)

    def experts_readers(
        self, groups: list[LinearGroup], experts: list[Any], ctx: MethodContext
    ) -> dict[str, list[LinearGroup]]:
        # with the balancing folded, a group reading the norm the experts' balancing goes
        # into shares it: one ``⊘ s`` in the norm, nothing of it left online
        if not (ctx.settings or TorqSettings()).fold or not experts:
            return {}
        cfg = ctx.model_config
        norms = {g.name: producer_of(g, cfg) for g in groups}
        return {
            x.name: [g for g in groups if norms[g.name] == producer_of(x, cfg)] for x in experts
        }

    def experts_online(self, qconfig: QuantConfig, ctx: MethodContext) -> bool:
        # an unrotated group keeps its balancing alone, online unless it is folded
        settings = self.settings(qconfig, ctx)
        experts = LinearGroup("experts", [EXPERTS_MEMBER], 0)
        return settings.rotates(experts) or (settings.balance is not None and not settings.fold)

    def compressed_tensors(self, qconfig: QuantConfig, ctx: MethodContext) -> str | None:
        settings = self.settings(qconfig, ctx)
        if not self.fixed_hadamard or settings.permute:
            return (
                "TORQ's calibrated rotations have no compressed-tensors form (transformers "
                "and vLLM apply only fixed Hadamard transforms)"
            )
        if settings.block_size != 32:
            return (
                f"compressed-tensors holds the balanced 32-block Hadamard only, not blocks of "
                f"{settings.block_size}: drop --rotation-block"
            )
        if settings.balance is not None and not settings.fold:
            return "compressed-tensors holds it with its balancing folded: add --fold-balance"
        return None

    def fold(
        self,
        layer: nn.Module,
        groups: list[LinearGroup],
        transforms: dict[str, nn.Module | None],
        qconfig: QuantConfig,
        ctx: MethodContext,
    ) -> dict[str, tuple[nn.Module | None, dict[str, Any]]]:
        """With ``fold``: each group's balancing ``⊘ s`` done by the module producing its
        input (:func:`torq.rotations.fold.fold_scales`), ``R`` alone kept online; fused MoE
        experts' by the norm before them and their ``up`` rows
        (:func:`~torq.rotations.fold.fold_expert_scales`), with it the balancing of a linear
        group reading the same norm, which took the experts' (:meth:`experts_readers`)."""
        if not self.settings(qconfig, ctx).fold:
            return {}
        cfg = ctx.model_config
        check_foldable(cfg)
        experts = [g for g in groups if isinstance(g, ExpertsGroup)]
        # the norms the experts' balancing goes into: no other group's may go there too
        taken = {producer_of(g, cfg).module for g in experts}
        out: dict[str, tuple[Any, dict[str, Any]]] = {}
        readers: list[LinearGroup] = []
        for g in groups:
            if isinstance(g, ExpertsGroup):
                continue
            t = transforms[g.name]
            where = producer_of(g, cfg)
            if where.kind == "norm" and where.module in taken:
                readers.append(g)
                continue
            if not isinstance(t, BlockRotation) or t.channel_scale is None:
                continue
            record = fold_scales(layer, g, t.channel_scale, cfg)
            out[g.name] = (t.without_channel_scale(), record)
        for g in experts:
            own = transforms[g.name]
            assert isinstance(own, ExpertTransforms)
            s = own.input.channel_scale if isinstance(own.input, BlockRotation) else None
            out[g.name] = fold_expert_scales(layer, g, own, cfg)
            if s is None:
                continue
            for r in readers:  # Qwen2-MoE's shared expert and its gate
                t = transforms[r.name]
                if not (
                    isinstance(t, BlockRotation)
                    and t.channel_scale is not None
                    and torch.equal(t.channel_scale, s.to(t.channel_scale.dtype))
                ):
                    raise TorqError(
                        f"{r.name} reads the norm {g.name}'s balancing goes into with a "
                        "balancing of its own: it cannot be folded there"
                    )
                # the experts' balancing (experts_readers): folded with theirs
                out[r.name] = (t.without_channel_scale(), {"balancing_of": g.name})
        return out

    def residual(self, ctx: MethodContext) -> ResidualRotation | None:
        settings: TorqSettings = ctx.settings or TorqSettings()
        if not settings.residual:
            return None
        if ctx.model_config is None:
            raise TorqError("the residual Hadamard needs the model's configuration")
        return block_hadamard_residual(ctx.model_config.hidden_size, settings.block_size)

    def key_settings(
        self, run: RunKey, settings: dict[str, Any] | None, capture: dict[str, Any]
    ) -> dict[str, Any]:
        own = dict(settings if settings is not None else asdict(TorqSettings()))
        if self.fixed_hadamard:
            own.pop("calibrate", None)  # every group gets H₃₂ whatever it names
        return {"torq": torq_key(own, capture)}

    def capture_block(self, ctx: MethodContext) -> int:
        return (ctx.settings or TorqSettings()).block_size

    def needs_hessian(self, ctx: MethodContext) -> bool:
        settings = ctx.settings or TorqSettings()
        return settings.balance_check and settings.balance_probe == "gptq"

    def expert_down_shared(self, ctx: MethodContext) -> bool:
        return (ctx.settings or TorqSettings()).expert_down_shared

    def record(self, qconfig: QuantConfig, ctx: MethodContext) -> dict[str, Any]:
        return {"settings": self.settings(qconfig, ctx).to_dict()}


# TORQ: inter-block (Schur–Horn) then intra-block (codebook occupancy) rotation.
TORQ = register(
    Method(
        "torq",
        "TORQ: inter-block + intra-block rotation, calibrated, fused (RTN weights)",
        TorqTransform(),
    )
)
# Ablations (Table 3): one level only.
TORQ_INTER = register(
    Method("torq-inter", "TORQ ablation: inter-block rotation only", TorqTransform(use_intra=False))
)
TORQ_INTRA = register(
    Method("torq-intra", "TORQ ablation: intra-block rotation only", TorqTransform(use_inter=False))
)
# torq's guard (issue 27): TORQ where it beats the balanced Hadamard on held-back tokens,
# the balanced Hadamard elsewhere
TORQ_GUARD = register(
    Method(
        "torq-guard",
        "TORQ, each group's calibrated transform kept only where it lowers the W4A4 output "
        "error on a quarter of the sampled tokens held back, else balancing + H32",
        TorqTransform(guard=0.25),
    )
)
# torq's block-mass permutation (issue 27): balancing, then the channels regrouped so each
# block carries an equal share of rms(x)·‖w‖, then H32; kept per group only where it lowers
# the W4A4 output error on held-back tokens (the guard), else torq-had32's transform
TORQ_PERM = register(
    Method(
        "torq-perm",
        "channel balancing + block-mass permutation + 32-block Hadamard, the permutation kept "
        "per group where it lowers the W4A4 output error on held-back tokens",
        TorqTransform(use_inter=False, fixed_hadamard=True, guard=0.25, permute=True),
    )
)
# Ablation (ours): TORQ's channel balancing with the fixed 32-block Hadamard in place of the
# calibrated rotations — separates what the balancing and the rotations contribute.
TORQ_HAD32 = register(
    Method(
        "torq-had32",
        "TORQ ablation: channel balancing + 32-block Hadamard (no calibrated rotation)",
        TorqTransform(use_inter=False, fixed_hadamard=True),
    )
)
