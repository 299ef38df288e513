"""A precision budget: the linears that hurt most stay in MXFP8, the rest in the 4-bit format.

``--avg-bits B`` asks that the quantized linears of the decoder layers store ``B`` bits per
weight on average (MXFP4 is 4.25 with its scales, MXFP8 8.25). The unit kept in 8 bits is an
*input group*, the linears that read one tensor (q/k/v, o, gate/up, down): they share one
activation quantizer, and vLLM fuses them into one linear that takes one scheme.

Which groups (:func:`choose_high_precision`, ``--budget-by``):

* ``block`` (the default): each group's sensitivity is the rise in its decoder layer's output
  error when that group alone is quantized, ``s_g = mean_t ‖B_g(h_t) − B(h_t)‖² / ‖B(h_t)‖²``
  over the calibration tokens ``t``, with ``B`` the float layer, ``B_g`` the same layer with
  the group in W4A4 (RTN weights, an online 32-block Hadamard) and ``h`` the float model's
  hidden states. The layer's output is the residual stream the next layers read (after their
  norm), so the error is measured where it lands, relative to what it lands on.
* ``linear``: the group's own relative output error ``Σ‖Q(x)Q(W)ᵀ − xWᵀ‖² / Σ‖xWᵀ‖²``, the
  usual local measure; it ignores what the layer does with the error (an error in ``v`` is
  averaged by attention, one in ``down`` goes straight into the residual).
* ``random`` (seeded) and ``ends`` (the first and last layers, alternately, inward): the
  baselines the measured choice is held against.

The groups are then taken greedily by sensitivity per weight, each while it fits the budget:
the knapsack's greedy order, since the 8 bits a group costs grow with its size. The
sensitivities are measured in one streamed pass over the first ``windows`` calibration
windows before the method's own pass (one layer in memory; each group costs one forward of
its layer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from torq.calibration.capture import LinearGroup, discover_groups, layer_outputs
from torq.errors import TorqError
from torq.formats.config import FORMAT_BITS, HIGH_PRECISION_FORMAT
from torq.methods.hadamard import hadamard_rotation
from torq.models.streaming import LayerSource, embed_windows, give_back_memory
from torq.surgery.qlinear import ActivationQuantizer, QuantConfig, QuantLinear

BUDGET_BY: tuple[str, ...] = ("block", "linear", "random", "ends")
# the online Hadamard of the probe: the served default's block, aligned with the MX blocks
_PROBE_BLOCK = 32


@dataclass(frozen=True)
class PrecisionBudget:
    """``avg_bits``: the average stored bits per weight asked of the quantized linears;
    ``by``: how the 8-bit groups are chosen (:data:`BUDGET_BY`); ``windows``: how many
    calibration windows the sensitivities are measured on; ``seed``: ``random``'s."""

    avg_bits: float
    by: str = "block"
    windows: int = 16
    seed: int = 0


@dataclass
class GroupCost:
    """One input group of one layer: its linears' full names, weights and sensitivities."""

    layer: int
    name: str
    linears: list[str]
    weights: int
    block: float = 0.0
    linear: float = 0.0


def check_budget(budget: PrecisionBudget | None, qconfig: QuantConfig) -> None:
    """Refuse, in one line and before any work, a budget that cannot be kept: no quantized
    weights, or an average below the 4-bit format's own or above MXFP8's."""
    if budget is None:
        return
    if budget.by not in BUDGET_BY:
        raise TorqError(f"--budget-by takes {', '.join(BUDGET_BY)}, not '{budget.by}'")
    if qconfig.weight is None:
        raise TorqError("--avg-bits needs quantized weights: --w-format is none")
    low, high = FORMAT_BITS[qconfig.weight.name], FORMAT_BITS[HIGH_PRECISION_FORMAT]
    if not low <= budget.avg_bits <= high:
        raise TorqError(
            f"--avg-bits {budget.avg_bits:g} is outside what {qconfig.weight.name.upper()} and "
            f"MXFP8 can average: from {low:g} (every linear in {qconfig.weight.name.upper()}) "
            f"to {high:g} (every one in MXFP8)"
        )


@torch.no_grad()
def measure_sensitivity(
    source: LayerSource,
    windows: torch.Tensor,
    qconfig: QuantConfig,
    progress: bool = False,
) -> list[GroupCost]:
    """Every input group's sensitivities (module doc), one float layer of ``source`` at a
    time on ``windows``; the layers are given back as they came."""
    hidden, kwargs = embed_windows(source, windows)
    out: list[GroupCost] = []
    for li in tqdm(range(source.num_layers), desc="sensitivity", disable=not progress):
        layer = source.load_layer(li)
        reference = layer_outputs(layer, hidden, kwargs[li])
        for group in discover_groups(layer, hidden[0], kwargs[li]):
            # the linears kept in float (--ignore) have nothing to budget
            kept = [m for m in group.members if not qconfig.ignores(f"layers.{li}.{m}")]
            if kept:
                # named by the linears it keeps, as the record lists them
                name = "+".join(m.rsplit(".", 1)[-1] for m in kept)
                group = LinearGroup(name, kept, group.width)
                out.append(_group_cost(li, layer, group, hidden, kwargs[li], reference, qconfig))
        source.release_layer(li)
        del layer
        hidden = reference
        give_back_memory()
    return out


def _group_cost(
    li: int,
    layer: nn.Module,
    group: LinearGroup,
    hidden: list[torch.Tensor],
    kwargs: dict[str, Any],
    reference: list[torch.Tensor],
    qconfig: QuantConfig,
) -> GroupCost:
    """The group quantized alone in ``layer`` (then put back): both sensitivities."""
    floats = {m: layer.get_submodule(m) for m in group.members}
    transform = hadamard_rotation(_PROBE_BLOCK) if group.width % _PROBE_BLOCK == 0 else None
    shared = ActivationQuantizer(qconfig.activation, transform)
    sums = torch.zeros(2, dtype=torch.float64)  # Σ‖error‖², Σ‖output‖² of the linears
    handles = []
    for name, linear in floats.items():
        w = linear.weight if transform is None else transform.fuse_inverse(linear.weight)
        q = QuantLinear(w, linear.bias, qconfig, input_quantizer=shared)

        def hook(_m: nn.Module, args: tuple, y: torch.Tensor, f: nn.Linear = linear) -> None:
            exact = f(args[0])  # the group's input is the float layer's: only it is quantized
            sums[0] += (y - exact).double().pow(2).sum().cpu()
            sums[1] += exact.double().pow(2).sum().cpu()

        handles.append(q.register_forward_hook(hook))
        _put(layer, name, q)
    try:
        errors = []
        for hs, ref in zip(hidden, reference, strict=True):
            y = layer_outputs(layer, [hs], kwargs)[0]
            e = (y - ref).double().pow(2).sum(-1) / ref.double().pow(2).sum(-1).clamp_min(1e-30)
            errors.append(e.flatten())
    finally:
        for h in handles:
            h.remove()
        for name, linear in floats.items():
            _put(layer, name, linear)
    return GroupCost(
        layer=li,
        name=group.name,
        linears=[f"layers.{li}.{m}" for m in group.members],
        weights=sum(int(f.weight.numel()) for f in floats.values()),
        block=float(torch.cat(errors).mean()),
        linear=float(sums[0] / sums[1].clamp_min(1e-30)),
    )


def _put(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, module)


def choose_high_precision(
    costs: list[GroupCost], budget: PrecisionBudget, low_bits: float
) -> list[GroupCost]:
    """The groups kept in MXFP8 so that the average stays at most ``budget.avg_bits`` (each
    group's weights cost ``8.25 − low_bits`` more bits there): taken in ``budget.by``'s
    order (module doc), each while it fits."""
    high_bits = FORMAT_BITS[HIGH_PRECISION_FORMAT]
    total = sum(c.weights for c in costs)
    spare = (budget.avg_bits - low_bits) * total  # the bits there are to spend
    order = _order(costs, budget)
    chosen = []
    for c in order:
        cost = (high_bits - low_bits) * c.weights
        if cost <= spare + 1e-9 * total:
            chosen.append(c)
            spare -= cost
    return chosen


def _order(costs: list[GroupCost], budget: PrecisionBudget) -> list[GroupCost]:
    if budget.by in ("block", "linear"):
        return sorted(costs, key=lambda c: -getattr(c, budget.by) / c.weights)
    if budget.by == "random":
        shuffled = list(costs)
        random.Random(budget.seed).shuffle(shuffled)
        return shuffled
    if budget.by == "ends":
        layers = sorted({c.layer for c in costs})
        ends = [layers[i // 2] if i % 2 == 0 else layers[-1 - i // 2] for i in range(len(layers))]
        rank = {layer: i for i, layer in enumerate(ends)}
        return sorted(costs, key=lambda c: rank[c.layer])
    raise TorqError(f"--budget-by takes {', '.join(BUDGET_BY)}, not '{budget.by}'")


def budgeted(
    source: LayerSource,
    windows: torch.Tensor,
    qconfig: QuantConfig,
    budget: PrecisionBudget,
    progress: bool = False,
) -> tuple[QuantConfig, dict[str, Any]]:
    """``qconfig`` with the groups ``budget`` keeps in MXFP8 (:meth:`QuantConfig.at`), and
    the record of the choice: what was asked, the average reached, each group's
    sensitivities and which were kept."""
    check_budget(budget, qconfig)
    assert qconfig.weight is not None
    low_bits = FORMAT_BITS[qconfig.weight.name]
    costs = measure_sensitivity(source, windows[: budget.windows], qconfig, progress)
    chosen = choose_high_precision(costs, budget, low_bits)
    kept_ids = {id(c) for c in chosen}
    high = tuple(name for c in chosen for name in c.linears)
    total = sum(c.weights for c in costs)
    kept = sum(c.weights for c in chosen)
    high_bits = FORMAT_BITS[HIGH_PRECISION_FORMAT]
    record = {
        "avg_bits": budget.avg_bits,
        "by": budget.by,
        "windows": int(min(budget.windows, windows.shape[0])),
        "format": HIGH_PRECISION_FORMAT,
        "reached_bits": (low_bits * (total - kept) + high_bits * kept) / total if total else None,
        "groups": [
            {
                "layer": c.layer,
                "group": c.name,
                "weights": c.weights,
                "block": c.block,
                "linear": c.linear,
                "high": id(c) in kept_ids,
            }
            for c in costs
        ],
    }
    return QuantConfig(
        qconfig.weight, qconfig.activation, qconfig.act_scale, qconfig.ignore, high
    ), record
