"""Intra-block rotation ``R_intra ∈ O(K)``: the paper's micro-alignment step.

Section 5.2 (Algorithm 2) of the paper builds one orthogonal ``K×K`` matrix applied to every
block, ``Z = Y R_intra`` (rows of ``Y`` are blocks of calibration activations after the
inter-block rotation), by alternating

* an **S-step** (Section 5.2.3, the equation Algorithm 2 cites as Eq. (5)): per-block
  power-of-two scales from the current rotation, by the quantizer's rule (``scale_mode``);
* an **R-step**: ``P`` Givens rotations on disjoint column pairs chosen by imbalance and
  complementarity (Appendix A.5), each with the globally optimal angle for the codebook
  occupancy loss ``L_code`` (Section 5.2.2) found by an exact sweep over critical angles
  (Appendix A.4). ``objective="mse"`` swaps in the quantization MSE of Appendix A.6.

Givens convention: rotating columns ``(p, q)`` by ``θ`` maps ``z_p ← cosθ·z_p + sinθ·z_q`` and
``z_q ← −sinθ·z_p + cosθ·z_q``; with ``z_p = r cosφ, z_q = r sinφ`` that is
``(r cos(φ−θ), r sin(φ−θ))``, Appendix A.4's ``x^(1)``. ``R ← R G`` keeps ``Z = Y R``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from torq.formats.config import SCALE_MODES
from torq.knobs import knob, positive_int
from torq.rotations.angle_search import (
    N_CODES,
    _check_choice,
    _rotate_pair,
    block_scales,
    codebook_histogram,
    codebook_occupancy_loss,
    exact_angle_search,
    mse_angle_search,
    quantization_mse_loss,
)
from torq.rotations.hadamard import hadamard_matrix, has_hadamard

OBJECTIVES: tuple[str, ...] = ("occupancy", "mse")
INITS: tuple[str, ...] = ("identity", "hadamard")
DTYPES: tuple[str, ...] = ("float64", "float32")


@dataclass(frozen=True)
class IntraBlockConfig:
    """Settings of Algorithm 2; every field is a JSON scalar so the config records as-is.

    ``pairs_per_step`` (``P``) defaults to ``K // 4`` (at least 1) and ``k_top`` to ``K // 2``
    (at least 2, Appendix A.5's suggestion), resolved against the block size when fitting.
    ``tol`` is ``ε_intra``: the fit stops once an iteration lowers the loss by less than it.
    ``max_samples`` (with ``seed``) fits on a random subset of rows, the sampling the end of
    Appendix A.4 suggests. ``mse_grid`` and ``mse_refine`` set the angle search of
    ``objective="mse"``.
    """

    max_iter: int = knob(10, flag="--max-iter", type=int, help="intra-block MaxIter")
    pairs_per_step: int | None = knob(
        None, flag="--pairs", type=positive_int, help="intra-block P (default K/4)"
    )
    lam: float = knob(1.0, flag="--lam", type=float, help="pair-selection weight λ")
    k_top: int | None = knob(
        None,
        flag="--k-top",
        type=positive_int,
        help="intra-block candidate columns (default torq's: every column of the block, 32; "
        "the paper: K/2 = 16)",
    )
    objective: str = knob(
        "occupancy", flag="--objective", choices=OBJECTIVES, help="intra-block loss"
    )
    scale_mode: str = "ocp"
    tol: float = 1e-6
    # the calibration's seed (its windows, each group's token sample) seeds the subsample
    seed: int = knob(0, flag="--calib-seed", help=None)
    max_samples: int | None = knob(
        None,
        flag="--intra-samples",
        type=positive_int,
        help="blocks the intra-block solver fits on (default: all sampled)",
    )
    mse_grid: int = 128
    mse_refine: int = 32
    dtype: str = "float64"
    init: str = knob(
        "identity",
        flag="--intra-init",
        choices=INITS,
        help="start Algorithm 2 from the block Hadamard (torq) or from I (the paper)",
    )

    def __post_init__(self) -> None:
        _check_int("max_iter", self.max_iter, minimum=0)
        _check_int("pairs_per_step", self.pairs_per_step, minimum=1, optional=True)
        _check_int("k_top", self.k_top, minimum=2, optional=True)
        _check_int("seed", self.seed, minimum=0)
        _check_int("max_samples", self.max_samples, minimum=1, optional=True)
        _check_int("mse_grid", self.mse_grid, minimum=2)
        _check_int("mse_refine", self.mse_refine, minimum=2)
        for name in ("lam", "tol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if (
            self.k_top is not None
            and self.pairs_per_step is not None
            and self.pairs_per_step > self.k_top // 2
        ):
            raise ValueError(
                f"pairs_per_step={self.pairs_per_step} disjoint pairs do not fit in "
                f"k_top={self.k_top} candidate columns"
            )
        _check_choice("objective", self.objective, OBJECTIVES)
        _check_choice("init", self.init, INITS)
        _check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        _check_choice("dtype", self.dtype, DTYPES)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IntraBlockConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown IntraBlockConfig fields: {sorted(unknown)}")
        return cls(**data)

    def resolved(self, block_size: int) -> tuple[int, int]:
        """``(k_top, pairs_per_step)`` for blocks of ``block_size`` columns."""
        if block_size < 2:
            raise ValueError(f"an intra-block rotation needs at least 2 columns, got {block_size}")
        k_top = self.k_top if self.k_top is not None else max(2, block_size // 2)
        n_pairs = (
            self.pairs_per_step if self.pairs_per_step is not None else max(1, block_size // 4)
        )
        if k_top > block_size:
            raise ValueError(f"k_top={k_top} exceeds the block size {block_size}")
        if n_pairs > k_top // 2:
            raise ValueError(
                f"pairs_per_step={n_pairs} disjoint pairs do not fit in k_top={k_top} columns"
            )
        return k_top, n_pairs


@dataclass
class IntraBlockResult:
    """What Algorithm 2 returns, plus the record of how it got there.

    ``loss_history[t]`` is the objective of ``Z = Y R_t`` with the scales re-derived from
    ``R_t`` (the loss the quantizer actually sees), ``t = 0`` being the identity.
    ``rstep_losses[t]`` traces iteration ``t``'s R-step with its scales held fixed: the value
    before the first pair, then after each pair. ``rotations[t]`` lists ``(p, q, θ)`` of the
    Givens rotations that iteration applied; ``dropped_rotations`` counts those the R-step
    found but the re-derived scales turned into a loss.
    """

    rotation: Tensor
    loss_history: list[float]
    rstep_losses: list[list[float]]
    rotations: list[list[tuple[int, int, float]]]
    s_step_seconds: list[float]
    r_step_seconds: list[float]
    stop_reason: str
    config: IntraBlockConfig
    n_samples: int
    dropped_rotations: int = 0
    seconds: float = 0.0

    @property
    def n_rotations(self) -> int:
        return sum(len(step) for step in self.rotations)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable record (the rotation itself as nested lists)."""
        return {
            "rotation": self.rotation.detach().cpu().tolist(),
            "loss_history": list(self.loss_history),
            "rstep_losses": [list(step) for step in self.rstep_losses],
            "rotations": [[list(r) for r in step] for step in self.rotations],
            "n_rotations": self.n_rotations,
            "s_step_seconds": list(self.s_step_seconds),
            "r_step_seconds": list(self.r_step_seconds),
            "stop_reason": self.stop_reason,
            "config": self.config.to_dict(),
            "n_samples": self.n_samples,
            "dropped_rotations": self.dropped_rotations,
            "seconds": self.seconds,
        }


def select_column_pairs(
    z_norm: Tensor, k_top: int, n_pairs: int, lam: float = 1.0
) -> list[tuple[int, int]]:
    """Column-pair selection of Appendix A.5 (imbalance ``h_k``, complementarity ``c_kl``).

    ``H_kl = h_k + h_l + λ c_kl`` over the ``k_top`` most imbalanced columns; the ``n_pairs``
    disjoint pairs are taken greedily by decreasing ``H`` (ties: lower rank first). Each pair
    is returned as ``(p, q)`` with ``p < q``.
    """
    n_cols = z_norm.shape[-1]
    if not 2 <= k_top <= n_cols:
        raise ValueError(f"k_top must be in [2, {n_cols}], got {k_top}")
    if not 1 <= n_pairs <= k_top // 2:
        raise ValueError(f"n_pairs must be in [1, {k_top // 2}] for k_top={k_top}, got {n_pairs}")
    counts = codebook_histogram(z_norm, per_column=True).to(torch.float64)
    dev = counts / counts.sum(dim=1, keepdim=True).clamp_min(1) - 1.0 / N_CODES
    h = dev.pow(2).sum(dim=1)
    pool = torch.sort(h, descending=True, stable=True).indices[:k_top]
    d_pool = dev[pool]
    score = h[pool, None] + h[None, pool] - lam * (d_pool @ d_pool.T)
    rows, cols = torch.triu_indices(k_top, k_top, offset=1, device=score.device)
    order = torch.sort(score[rows, cols], descending=True, stable=True).indices
    used: set[int] = set()
    pairs: list[tuple[int, int]] = []
    for i, j in zip(rows[order].tolist(), cols[order].tolist(), strict=True):
        a, b = int(pool[i]), int(pool[j])
        if a in used or b in used:
            continue
        used.update((a, b))
        pairs.append((min(a, b), max(a, b)))
        if len(pairs) == n_pairs:
            break
    return pairs


def fit_intra_block_rotation(
    samples: Tensor, config: IntraBlockConfig | None = None
) -> IntraBlockResult:
    """Algorithm 2: alternate S-steps (Section 5.2.3) and R-steps (App. A.4–A.5) from ``R = I``
    (or, with ``init="hadamard"``, from the normalized Hadamard ``H_K``, a variant of ours).

    ``samples`` is ``(N, K)``: ``N`` blocks of ``K`` post-inter-rotation activations. Each
    iteration derives the scales from the current rotation, selects ``P`` pairs, solves
    their angles with the scales fixed, and re-derives the scales for the new rotation.
    The R-step can only lower the fixed-scale loss, but new scales can move it back up. If
    they do, the iteration keeps (in order) only the rotations that lower the re-scaled loss
    one at a time, and the fit stops when none does; so ``loss_history`` never rises and the
    result is never worse than the identity. The loop also stops after ``max_iter``
    iterations, when no pair improves, or when an iteration gains less than ``tol``.
    The rotation is a product of at most ``max_iter·P`` Givens factors applied to the
    columns in place, so it stays orthogonal to float rounding without re-orthonormalizing.
    """
    cfg = config if config is not None else IntraBlockConfig()
    start_time = time.perf_counter()
    y = _prepare_samples(samples, cfg)
    n_rows, block = y.shape
    k_top, n_pairs = cfg.resolved(block)
    if cfg.init == "hadamard":
        # Start from the fully mixing block Hadamard (BRQ-style) instead of the identity:
        # the S/R steps can then only lower the loss below that of the Hadamard itself.
        if not has_hadamard(block):
            raise ValueError(f"init='hadamard' needs a Hadamard matrix of order {block}")
        rotation = hadamard_matrix(block, dtype=y.dtype).to(y.device)
    else:
        rotation = torch.eye(block, dtype=y.dtype, device=y.device)

    t0 = time.perf_counter()
    z, scales, loss = _s_step(y, rotation, cfg)
    s_times, r_times = [time.perf_counter() - t0], []
    history: list[float] = [loss]
    rstep_losses: list[list[float]] = []
    applied: list[list[tuple[int, int, float]]] = []
    stop_reason = "max_iter"
    dropped = 0

    for _ in range(cfg.max_iter):
        t0 = time.perf_counter()
        # z is not read again before the S-step recomputes it from y: normalized in place,
        # and the search rotates that tensor, not a copy (a sample's copies are ~0.2 GB
        # each on an 8B model's widest group)
        z_norm = z.div_(scales.unsqueeze(-1))
        pairs = select_column_pairs(z_norm, k_top, n_pairs, cfg.lam)
        if cfg.objective == "occupancy":
            search = exact_angle_search(z_norm, pairs, inplace=True)
        else:
            search = mse_angle_search(z_norm, scales, pairs, cfg.mse_grid, cfg.mse_refine)
        steps = [
            (p, q, theta)
            for (p, q), theta in zip(search.pairs, search.angles.tolist(), strict=True)
            if theta != 0.0
        ]
        search_losses = search.losses.tolist()
        # the sample normalized and rotated (two copies of it) is not needed past the R-step
        del z_norm, search
        r_times.append(time.perf_counter() - t0)
        if not steps:
            stop_reason = "no_improving_rotation"
            break

        t0 = time.perf_counter()
        rstep_losses.append([loss, *search_losses])
        kept, candidate = steps, _apply_givens(rotation, steps)
        new_z, new_scales, new_loss = _s_step(y, candidate, cfg)
        if new_loss > loss:
            # The R-step held the scales fixed and re-derived scales undid its gain: keep,
            # in order, only the rotations that lower the re-scaled loss on their own.
            kept, candidate, new_loss = [], rotation, loss
            for step in steps:
                trial_rotation = _apply_givens(candidate, [step])
                trial = _s_step(y, trial_rotation, cfg)
                if trial[2] < new_loss:
                    kept.append(step)
                    candidate, (new_z, new_scales, new_loss) = trial_rotation, trial
        s_times.append(time.perf_counter() - t0)
        dropped += len(steps) - len(kept)
        if not kept:
            stop_reason = "rescaled_loss_rose"
            break
        rotation, z, scales = candidate, new_z, new_scales
        gain, loss = loss - new_loss, new_loss
        history.append(loss)
        applied.append(kept)
        if gain < cfg.tol:
            stop_reason = "converged"
            break

    return IntraBlockResult(
        rotation=rotation,
        loss_history=history,
        rstep_losses=rstep_losses,
        rotations=applied,
        s_step_seconds=s_times,
        r_step_seconds=r_times,
        stop_reason=stop_reason,
        config=cfg,
        n_samples=n_rows,
        dropped_rotations=dropped,
        seconds=time.perf_counter() - start_time,
    )


def _s_step(y: Tensor, rotation: Tensor, cfg: IntraBlockConfig) -> tuple[Tensor, Tensor, float]:
    z = y @ rotation
    scales = block_scales(z, cfg.scale_mode)
    if cfg.objective == "occupancy":
        loss = float(codebook_occupancy_loss(z / scales.unsqueeze(-1)))
    else:
        loss = float(quantization_mse_loss(z, scales))
    return z, scales, loss


def _apply_givens(rotation: Tensor, steps: Sequence[tuple[int, int, float]]) -> Tensor:
    out = rotation.clone()
    for p, q, theta in steps:
        new_p, new_q = _rotate_pair(out[:, p], out[:, q], theta)
        out[:, p], out[:, q] = new_p, new_q
    return out


def _prepare_samples(samples: Tensor, cfg: IntraBlockConfig) -> Tensor:
    if not isinstance(samples, Tensor) or samples.dim() != 2:
        raise ValueError("samples must be a 2-D tensor of shape (N blocks, K)")
    if samples.shape[0] < 1:
        raise ValueError("samples must contain at least one row")
    y = samples.detach().to(getattr(torch, cfg.dtype))
    if not bool(torch.isfinite(y).all()):
        raise ValueError("samples contain NaN or Inf")
    if cfg.max_samples is not None and y.shape[0] > cfg.max_samples:
        gen = torch.Generator().manual_seed(cfg.seed)
        keep = torch.randperm(y.shape[0], generator=gen)[: cfg.max_samples]
        y = y[keep.sort().values.to(y.device)]
    return y


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
