"""Channel balancing before the block rotations (torq's addition to TORQ, not in the paper).

Why. After a rotation inside each 32-element block, the quantization error of a block is
close to white, with a variance proportional to the block's energy, for activations and
weights alike. The expected W4A4 output error of one linear layer is then, up to
format-dependent constants,

    ``E‖Q(x̃) Q(W̃)ᵀ − x Wᵀ‖² ∝ Σ_b  E‖x̃_b‖² · ‖W̃_b‖²_F``

(``x̃ = T x``, ``W̃ = W T⁻¹``, ``b`` runs over blocks). An orthogonal ``T`` that mixes only
inside blocks leaves both block energies as they are, so neither TORQ's intra-block rotation
nor a block Hadamard can lower this product. A per-channel scale ``s`` (``x ↦ x ⊘ s``,
``W ↦ W diag(s)``, exact in float) can: per block the product becomes
``(Σ_j E[x_j²] / s_j²) · (Σ_j s_j² ‖w_j‖²)``, which by Cauchy–Schwarz is smallest,
``(Σ_j rms(x_j) ‖w_j‖)²``, at ``s_j² ∝ rms(x_j) / ‖w_j‖`` — SmoothQuant's migration
strength ``α = ½`` with root-mean-square statistics (``w_j`` is column ``j`` of the
group's stacked weights). :func:`balance_scales` returns ``s_j = rms(x_j)^α / rms(w_j)^{1−α}``
(``α = ½`` is the optimum above; other ``α`` are for measurement), normalized to geometric
mean 1.

Where it runs. ``s`` is the first step of the online transform
(:class:`torq.rotations.transform.BlockRotation`); the inter-block rotation is then computed
from the balanced covariances ``Σ_k / (s s ᵀ)`` and the intra-block rotation from balanced
samples. For inputs read right after an RMSNorm (q/k/v, gate/up) ``1/s`` can be folded into
the norm's weight at no online cost; by default it is kept in the transform, and with
``fold`` (:mod:`torq.rotations.fold`) it goes into the module that produces the group's
input (the norm, ``v_proj``'s or ``up_proj``'s rows), as an exported model needs.
"""

from __future__ import annotations

import math

import torch


def channel_energy(covariance: torch.Tensor) -> torch.Tensor:
    """``E[x_j²]`` per input channel from the per-position block covariances.

    ``covariance`` is ``Σ_k`` as ``[K, B, B]`` (:meth:`BlockStatistics.covariance`); channel
    ``j = b·K + k`` is entry ``(b, b)`` of ``Σ_k``. Returns ``[B·K]`` (float64).
    """
    if covariance.dim() != 3 or covariance.shape[1] != covariance.shape[2]:
        raise ValueError(f"covariance must be [K, B, B], got {tuple(covariance.shape)}")
    return covariance.diagonal(dim1=1, dim2=2).transpose(0, 1).reshape(-1).to(torch.float64)


def balance_scales(
    energy: torch.Tensor, weight: torch.Tensor, alpha: float = 0.5, floor: float = 1e-5
) -> torch.Tensor:
    """Per-channel balancing scales ``s_j = rms(x_j)^α / rms(w_j)^{1−α}`` (module docstring).

    ``energy`` is ``E[x_j²]`` (``[d]``), ``weight`` the group's stacked weights
    (``[out, d]``). Channel statistics below ``floor`` times their mean are raised to it, so
    dead channels get a finite scale. The result (float64, ``[d]``) has geometric mean 1.
    """
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if energy.dim() != 1 or weight.dim() != 2 or weight.shape[1] != energy.shape[0]:
        raise ValueError(
            f"energy [d] and weight [out, d] must agree; got {tuple(energy.shape)} and "
            f"{tuple(weight.shape)}"
        )
    x_rms = energy.to(torch.float64).clamp_min(0).sqrt()
    w_rms = weight.detach().to(torch.float64).pow(2).mean(0).sqrt()
    if not (torch.isfinite(x_rms).all() and torch.isfinite(w_rms).all()):
        raise ValueError("balancing statistics contain NaN or Inf")
    x_rms = x_rms.clamp_min(floor * float(x_rms.mean()) + 1e-300)
    w_rms = w_rms.clamp_min(floor * float(w_rms.mean()) + 1e-300)
    log_s = alpha * x_rms.log() - (1.0 - alpha) * w_rms.log()
    return (log_s - log_s.mean()).exp()


def balance_covariance(covariance: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``Σ_k`` of the balanced input ``x ⊘ s``: entry ``(b, c)`` divided by ``s_{b,k} s_{c,k}``."""
    k, b, _ = covariance.shape
    s = scales.to(covariance.dtype).reshape(b, k).T  # [K, B]
    return covariance / (s[:, :, None] * s[:, None, :])


def tied_energies(
    energy: torch.Tensor, weight: torch.Tensor, ties: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E[x_j²]`` and the weights' column energies averaged over the channels that must share
    one scale (``ties[j]``: channel ``j``'s set, e.g. the value channel of a grouped-query
    attention head that ``o_proj``'s input channel ``j`` comes from), then given back per
    channel: the balancing of whole sets (the module doc's optimum with ``s`` constant on
    each set, taken on the sets' mean statistics). Returns ``(energy [d], weight [out, d])``
    whose :func:`balance_scales` are equal within every set."""
    ties = ties.long()
    n = int(ties.max()) + 1
    count = torch.zeros(n, dtype=torch.float64).index_add_(
        0, ties, torch.ones_like(ties, dtype=torch.float64)
    )
    mean_x = (
        torch.zeros(n, dtype=torch.float64).index_add_(0, ties, energy.to(torch.float64)) / count
    )
    w_ms = weight.detach().to(torch.float64).pow(2).mean(0)
    mean_w = torch.zeros(n, dtype=torch.float64).index_add_(0, ties, w_ms) / count
    # one row whose mean square is each set's: balance_scales reads rms(w_j) over rows
    return mean_x[ties], mean_w[ties].sqrt().unsqueeze(0)


def block_mass_permutation(mass: torch.Tensor, block: int = 32) -> torch.Tensor:
    """A channel permutation ``π`` (int64 ``[d]``) giving every block of ``block`` channels a
    near-equal share of ``mass`` (after balancing, ``m_j = rms(x_j / s_j) · ‖w_j s_j‖``).

    Why: by the module docstring the W4A4 output error after a block rotation is about
    ``Σ_b E‖x̃_b‖² ‖W̃_b‖²_F``; at the balancing's optimum each block's factor is
    ``(Σ_{j∈b} m_j)²``, which for a fixed total is smallest when every block carries the same
    share — which channels share a block is free to choose, online a gather (MixQuant's
    block balancing for INT4, here for the MX formats). The rule is the greedy one for
    equal-cardinality partitioning: channels by decreasing mass, each into the block with
    the smallest sum that still has room; block ``b`` of the permuted vector holds the
    channels ``π[b·block : (b+1)·block]``.
    """
    if mass.dim() != 1 or mass.numel() % block or mass.numel() == 0:
        raise ValueError(f"mass must be [d] with d a multiple of {block}, got {tuple(mass.shape)}")
    if not bool(torch.isfinite(mass).all()):
        raise ValueError("block masses contain NaN or Inf")
    n_blocks = mass.numel() // block
    sums = [0.0] * n_blocks
    bins: list[list[int]] = [[] for _ in range(n_blocks)]
    open_blocks = list(range(n_blocks))
    for j in torch.argsort(mass.to(torch.float64), descending=True, stable=True).tolist():
        b = min(open_blocks, key=sums.__getitem__)
        bins[b].append(j)
        sums[b] += float(mass[j])
        if len(bins[b]) == block:
            open_blocks.remove(b)
    return torch.tensor([j for b in bins for j in b], dtype=torch.int64)
