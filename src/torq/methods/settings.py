"""TORQ's own settings (:class:`TorqSettings`), frozen, and their settings key
(:func:`torq_key`). The calibration every calibrating method shares is the run's
:class:`torq.calibration.data.CaptureSettings`, not TORQ's."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from torq.calibration.capture import LinearGroup
from torq.knobs import knob, paper_values, strength, strength_or_none
from torq.rotations.inter_block import InterBlockConfig
from torq.rotations.intra_block import IntraBlockConfig
from torq.surgery.fusion import RESIDUAL_READERS

# torq's defaults for Algorithm 2 where they differ from the paper's (identity start,
# K/2 candidate columns): start from the block Hadamard and let every column be a candidate.
# Measured in docs/research/method.md §3; ``paper_settings()`` restores the paper's reading.
TORQ_INTRA_DEFAULTS: dict[str, Any] = {"init": "hadamard", "k_top": 32}


# a linear layer's own name inside its decoder layer (``o_proj``), as ``calibrate`` takes it
LINEAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def linear_names(value: Any, setting: str, what: str) -> tuple[str, ...]:
    """``value`` (a setting naming linear layers within a decoder layer, ``o_proj``) as a
    tuple, or a one-line error naming ``setting`` and what its groups ``what``."""
    names = tuple(value)
    if not names or not all(isinstance(n, str) and LINEAR_NAME.fullmatch(n) for n in names):
        raise ValueError(
            f"{setting} names the linear layers whose input groups {what}, got {value!r}"
        )
    return names


def parse_linear_names(value: str) -> tuple[str, ...]:
    """An argparse type: comma-separated linear layer names (``o_proj,down_proj``)."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names or not all(LINEAR_NAME.fullmatch(n) for n in names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated linear layer names such as o_proj, got '{value}'"
        )
    return names


def names_a_member(names: tuple[str, ...] | None, members: list[str]) -> bool:
    """Whether ``names`` (names within a decoder layer: a linear's, ``q_proj``, or a module's
    holding linears, ``experts``) names one of ``members`` (dotted paths,
    ``self_attn.q_proj``), by any part of its path."""
    return names is not None and any(set(m.split(".")) & set(names) for m in members)


# the path of fused MoE experts' input group within a decoder layer, as the solver names it;
# ``experts`` in a setting that names linears (``unrotated``) names their groups
EXPERTS_MEMBER = "mlp.experts.gate_up_proj"


SOLVER_DEVICES: tuple[str, ...] = ("cpu", "calibration")

# TORQ's block sizes K: the divisors of 32 with at least two columns, so K divides every
# width a 32-element MX block does (and NVFP4's 16) and has a Sylvester Hadamard matrix
ROTATION_BLOCKS: tuple[int, ...] = (2, 4, 8, 16, 32)

# the powers ``β`` of the balancing scales ``s`` the balancing check chooses from, per group
# (``s^β``: 0 no balancing, 1 the full strength ``α``)
BALANCE_POWERS: tuple[float, ...] = (0.0, 0.5, 1.0)
# the weights the balancing check scores each power with: RTN's, or GPTQ's on the group's
# Hessian after the probe transform (what the weight quantizers that follow do)
BALANCE_PROBES: tuple[str, ...] = ("rtn", "gptq")


@dataclass(frozen=True)
class TorqSettings:
    """Every knob of TORQ (Algorithms 1–3 and torq's additions); recorded verbatim in the
    result JSON.

    ``balance`` is the migration strength ``α`` of the channel balancing step
    (:func:`torq.rotations.balance.balance_scales`; ``0.5`` is its optimum), or ``None``
    for the paper's method without it. :meth:`paper` gives the paper's TORQ exactly.
    """

    use_inter: bool = True
    use_intra: bool = True
    inter: InterBlockConfig = knob(factory=InterBlockConfig)
    # torq's Algorithm 2: from the block Hadamard with every column a candidate (the paper:
    # from I with K/2 candidates, docs/research/method.md §3)
    intra: IntraBlockConfig = knob(
        factory=lambda: IntraBlockConfig(**TORQ_INTRA_DEFAULTS),
        paper=lambda intra: replace(intra, init="identity", k_top=None),
    )
    block_size: int = knob(
        32,
        flag="--rotation-block",
        type=int,
        choices=ROTATION_BLOCKS,
        metavar="K",
        help="TORQ's block size K, the order of its rotations and of torq-had32's Hadamard "
        "(default 32, the MX block; 16 matches NVFP4's block)",
    )
    balance: float | None = knob(
        0.5,
        paper=None,
        flag="--balance",
        type=strength_or_none,
        help="channel balancing strength α before the rotations (torq's addition; "
        "0.5 is optimal), or 'none' for the paper's TORQ",
    )
    # the fraction of each group's sampled tokens held back to check the calibrated
    # transform against the balanced Hadamard (module doc); ``None``: no check
    guard: float | None = knob(
        None,
        paper=None,
        flag="--torq-guard",
        type=float,
        metavar="FRACTION",
        help="hold back this fraction of each group's sampled tokens and keep TORQ's "
        "calibrated transform only where it lowers the W4A4 output error there, else the "
        "balanced 32-block Hadamard (torq-guard uses 0.25)",
    )
    # the fraction of each group's sampled tokens held back to check its rotation against
    # its balancing alone: the rotation kept only where it lowers the W4A4 output error on
    # those tokens (RTN weights), else the group is balanced only (folded: nothing online);
    # ``None``: every group keeps its rotation
    rotation_check: float | None = knob(
        None,
        paper=None,
        flag="--rotation-check",
        type=float,
        metavar="FRACTION",
        help="hold back this fraction of each group's sampled tokens and keep the group's "
        "rotation only where it lowers the W4A4 output error there (RTN weights), else its "
        "balancing alone (with --fold-balance: no online transform)",
    )
    # choose each group's balancing strength: the scales ``s^β`` with ``β`` in
    # :data:`BALANCE_POWERS` (``β = 0``: no balancing), the one with the lowest W4A4 output
    # error of the group on its sampled tokens (the 32-block Hadamard as probe, the weights
    # ``balance_probe``'s); ``False``: every group balanced in full (``β = 1``)
    balance_check: bool = knob(
        False, paper=False, flag="--balance-check", help=None, value=lambda probe: True
    )
    # the balancing check's weights (:data:`BALANCE_PROBES`): "rtn", or "gptq", GPTQ's on the
    # group's Hessian after the probe transform
    balance_probe: str = knob(
        "rtn",
        paper="rtn",
        flag="--balance-check",
        nargs="?",
        const="rtn",
        choices=BALANCE_PROBES,
        metavar="WEIGHTS",
        help="choose each group's balancing strength (the scales to the power 0, 1/2 or 1; "
        "0: none) by its W4A4 output error on the sampled tokens, the 32-block Hadamard as "
        "probe and WEIGHTS: rtn (the default) or gptq, GPTQ's on the group's Hessian "
        "(default: every group balanced in full)",
    )
    # do the balancing's ``x ⊘ s`` in the module that produces each group's input (the norm,
    # v_proj's or up_proj's rows; o_proj's scales tied across the query heads of a value
    # head) instead of online: what an exported model needs (:mod:`torq.rotations.fold`)
    fold: bool = knob(
        False,
        paper=False,
        flag="--fold-balance",
        action="store_true",
        help="do the channel balancing's division in the module that produces each input "
        "(the norm, v_proj's or up_proj's rows; o_proj's scales tied across the query heads "
        "of a value head) instead of online: torq-had32 can then be exported",
    )
    # the groups that get the calibrated rotations, by the name of a member linear
    # ("o_proj": attention's output projection only); the others get torq-had32's transform
    # (the balancing and H₃₂). ``None``: every group (docs/research/method.md §10.3)
    calibrate: tuple[str, ...] | None = knob(
        None,
        paper=None,
        flag="--torq-calibrate",
        type=parse_linear_names,
        metavar="NAMES",
        help="comma-separated linear layers (e.g. o_proj) whose input groups get TORQ's "
        "calibrated rotations; the other groups get the balanced 32-block Hadamard "
        "(default: every group)",
    )
    # the groups, by the name of a member linear ("q_proj"), that get no rotation: the
    # balancing alone, which ``fold`` moves into the module producing their input, so that
    # they run with no online transform (vLLM runs no transform on a linear with a bias,
    # Qwen2's q/k/v). ``None``: every group rotated
    unrotated: tuple[str, ...] | None = knob(
        None,
        paper=None,
        flag="--unrotated",
        type=parse_linear_names,
        metavar="NAMES",
        help="comma-separated linear layers (e.g. q_proj) whose input groups get no rotation: "
        "TORQ's methods their balancing alone (with --fold-balance: no online transform), the "
        "block Hadamards none; vLLM runs no transform on a linear with a bias (default: every "
        "group rotated)",
    )
    # the balancing strength ``α`` of the ``unrotated`` groups (no rotation after it to
    # spread what stays in the activations); ``None``: ``balance``'s
    unrotated_balance: float | None = knob(
        None,
        paper=None,
        flag="--unrotated-balance",
        type=strength,
        metavar="ALPHA",
        help="the balancing strength α of the --unrotated groups (default: --balance's)",
    )
    # the groups reading a norm's output (q/k/v, gate/up) rotated offline, by the 32-block
    # Hadamard of the residual stream fused into the weights (the norms' weights folded into
    # their readers), and then balanced, folded into the norm: no online transform, so vLLM
    # serves them with a bias. The other groups as the method makes them
    residual: bool = knob(
        False,
        paper=False,
        flag="--residual-hadamard",
        action="store_true",
        help="q/k/v and gate/up rotated offline, by the 32-block Hadamard of the residual "
        "stream fused into the weights (the norms' weights folded into their readers), not "
        "online; TORQ's methods then balance them, folded into the norm; o_proj and down_proj "
        "keep their online transform (vLLM runs no transform on a linear with a bias)",
    )
    # a channel permutation after the balancing that gives each block an equal share of
    # rms(x_j)·‖w_j‖ (:func:`torq.rotations.balance.block_mass_permutation`), fitted on the
    # tokens the intra-block level fits on; intra-block level only (docs/research/method.md §10.3)
    permute: bool = knob(False, paper=False)
    # fused MoE experts: one down_proj transform fitted on every expert's down_proj input
    # pooled, instead of one per expert from the tokens routed to it (the cheap variant)
    expert_down_shared: bool = knob(
        False,
        flag="--expert-down",
        choices=("per-expert", "shared"),
        value=lambda how: how == "shared",
        help="fused MoE experts: one down_proj input transform per expert, fitted on the "
        "tokens routed to it (default), or one shared, fitted on all experts' inputs pooled",
    )
    # where the two solvers (Algorithms 1 and 2) run: "calibration", the device the
    # calibration statistics are summed on (a GPU when calibrating on one; there the angle
    # search prepares all pairs of a step at once), or "cpu". On an H200 the GPU's solvers
    # took one 8B-shaped layer's solve step 2.2x faster than 16 CPU threads, with the same
    # GPTQ loss (docs/records/gpu/gpu-bench-3-torq-solvers-h200.md); on a CPU run the two
    # are the same computation, bit for bit
    solver_device: str = knob(
        "calibration",
        flag="--solver-device",
        choices=SOLVER_DEVICES,
        help="where TORQ's inter- and intra-block solvers run: the device the calibration "
        "runs on (default; a GPU with --device cuda) or the CPU",
    )

    def __post_init__(self) -> None:
        if self.intra.k_top == TORQ_INTRA_DEFAULTS["k_top"] and self.block_size < self.intra.k_top:
            # torq's default: every column of the block a candidate, whatever its size
            object.__setattr__(self, "intra", replace(self.intra, k_top=self.block_size))
        if self.solver_device not in SOLVER_DEVICES:
            raise ValueError(
                f"solver_device must be one of {', '.join(SOLVER_DEVICES)}, "
                f"got {self.solver_device!r}"
            )
        if self.balance_probe not in BALANCE_PROBES:
            raise ValueError(
                f"balance_probe must be one of {', '.join(BALANCE_PROBES)}, "
                f"got {self.balance_probe!r}"
            )
        if self.unrotated_balance is not None and not 0.0 <= self.unrotated_balance <= 1.0:
            raise ValueError(
                f"unrotated_balance is a strength α in [0, 1]: {self.unrotated_balance}"
            )
        if self.guard is not None and not 0.0 < self.guard < 1.0:
            raise ValueError(f"guard is the fraction of tokens held back, in (0, 1): {self.guard}")
        if self.rotation_check is not None:
            if not 0.0 < self.rotation_check < 1.0:
                raise ValueError(
                    f"rotation_check is the fraction of tokens held back, in (0, 1): "
                    f"{self.rotation_check}"
                )
            if self.guard is not None or self.balance is None:
                raise ValueError(
                    "the rotation check weighs a group's rotation against its balancing "
                    "alone: it needs the balancing, and no guard"
                )
        for name, what in (
            ("calibrate", "get the calibrated rotations (e.g. o_proj)"),
            ("unrotated", "get no rotation (e.g. q_proj)"),
        ):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, linear_names(value, name, what))
        if self.balance_check and self.permute:
            raise ValueError(
                "the balancing check may drop a group's balancing, which the block-mass "
                "permutation needs: use one or the other"
            )
        if self.permute and (self.use_inter or self.balance is None):
            raise ValueError(
                "the block-mass permutation needs the balancing and no inter-block rotation "
                "(which reads per-position covariances a permutation does not keep)"
            )

    def calibrates(self, group: LinearGroup) -> bool:
        """Whether ``group`` gets the calibrated rotations (``calibrate``), else the
        balanced ``H₃₂``."""
        return self.calibrate is None or names_a_member(self.calibrate, group.members)

    def rotates(self, group: LinearGroup) -> bool:
        """Whether ``group`` gets a rotation of its own (``unrotated`` does not name a
        member, nor ``residual`` rotate its input through the residual stream)."""
        if self.residual and names_a_member(RESIDUAL_READERS, group.members):
            return False
        return not names_a_member(self.unrotated, group.members)

    def balancing_only(self) -> TorqSettings:
        """An ``unrotated`` group's transform with these settings: the balancing alone, no
        inter- or intra-block rotation, no guard."""
        alone = replace(
            self, use_inter=False, use_intra=False, guard=None, calibrate=None, permute=False
        )
        if self.balance is not None and self.unrotated_balance is not None:
            alone = replace(alone, balance=self.unrotated_balance)
        return alone

    def fixed_hadamard(self) -> TorqSettings:
        """``torq-had32``'s transform with these settings: the balancing, then Algorithm 2
        from ``H₃₂`` with no iteration, no inter-block level and no guard."""
        return replace(
            self,
            use_inter=False,
            use_intra=True,
            guard=None,
            calibrate=None,
            permute=False,
            intra=replace(self.intra, init="hadamard", max_iter=0),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def paper(self) -> TorqSettings:
        """These settings with the paper's method: every field that declares the paper's
        value (``knob(paper=…)``) set to it: no balancing or other addition of torq's,
        Algorithm 2 from the identity with ``K/2`` candidate columns."""
        return paper_values(self)


def torq_key(settings: dict[str, Any], capture: dict[str, Any] | None = None) -> dict[str, Any]:
    """TORQ's settings (``asdict(TorqSettings)``) as a settings key holds them, with the
    run's capture (``asdict(CaptureSettings)``), which TORQ's settings held when the first
    keys were made: settings added after results were kept are left out at their defaults,
    so those keys still match."""
    # the capture's arithmetic is keyed for every calibrating method alike, GPTAQ's float
    # windows for the methods that read them (:meth:`torq.methods.registry.Method.settings_key`)
    merged = {**settings, **(capture or {})}
    merged.pop("arithmetic", None)
    merged.pop("reference_windows", None)
    return {k: v for k, v in merged.items() if not (k in _LATER and _same(v, _LATER[k]))}


def _same(value: Any, default: Any) -> bool:
    # of the same type too: 0 is not False, nor 0.0 None
    return type(value) is type(default) and value == default


# settings added after keys were kept, at their defaults
_LATER: dict[str, Any] = {
    "guard": None,
    "balance_check": False,
    "balance_probe": "rtn",
    "fold": False,
    "calibrate": None,
    "unrotated": None,
    "unrotated_balance": None,
    "residual": False,
    "permute": False,
    "expert_down_shared": False,
    "rotation_check": None,
    # "cpu" before the GPU's solvers were measured faster: a CPU run's old key (none) is
    # the same computation as "calibration" there
    "solver_device": "calibration",
}
