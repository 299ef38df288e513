"""Inter-block rotation: Schur–Horn variance equalization (paper §5.1, Algorithm 1, A.1).

For each position ``k`` of a block (``k < K``), an orthogonal ``R_k ∈ O(B)`` acts on the
``B`` elements at that position, ``y[:, k] = R_k x[:, k]``, such that
``diag(R_k Σ_k R_kᵀ) = tr(Σ_k)/B · 1``: every block gets the same expected energy
(Theorem 1). Conventions: ``Σ' = R Σ Rᵀ``; a Givens rotation ``G(i, j, θ)`` maps
``x_i ← cos θ x_i + sin θ x_j``, ``x_j ← −sin θ x_i + cos θ x_j``.

Two constructions:

* :func:`equalize_givens` — Algorithm 1 with its angle corrected. The paper's line 6,
  ``θ = ½ arctan(2σ_ij / (σ_ii − σ_jj))``, is the Jacobi angle: it zeroes ``σ_ij`` and moves
  the two variances *apart*, to the 2×2 eigenvalues. The default (``angle="exact"``) solves
  for the angle that sets ``σ_ii`` exactly to ``c = tr(Σ)/B``. Such an angle exists whenever
  the two deviations have opposite signs, and each rotation fixes one entry for good, so the
  loop ends after at most ``B − 1`` rotations. ``angle="paper"`` keeps the literal rule.
* :func:`equalize_closed_form` — the eigenbasis, then a matrix ``Q`` whose entries all have
  magnitude ``1/√B`` (a normalized Hadamard matrix): ``diag(Q Λ Qᵀ) = tr(Σ)/B`` exactly.
  Where no Hadamard matrix of order ``B`` exists (e.g. ``B = 18``: only 1, 2 and multiples
  of 4 can have one), an orthonormal DCT-II mixes the eigenbasis instead; its entries do not
  all have magnitude ``1/√B``, so exact Givens steps finish the job.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from torq.knobs import knob
from torq.rotations.hadamard import hadamard_matrix, has_hadamard

ANGLE_RULES = ("exact", "paper")
CONSTRUCTIONS = ("givens", "closed_form")


@dataclass(frozen=True)
class InterBlockConfig:
    """How to build the inter-block rotations."""

    construction: str = knob(
        "givens", flag="--inter", choices=CONSTRUCTIONS, help="inter-block construction"
    )
    angle: str = knob(
        "exact",
        flag="--angle",
        choices=ANGLE_RULES,
        help="Givens angle rule: exact equalization, or Algorithm 1's literal angle",
    )
    shared: bool = knob(
        False,
        flag="--shared-inter",
        action="store_true",
        help="one inter-block R for all positions",
    )
    tol: float = 1e-9
    ridge: float = 1e-8

    def __post_init__(self) -> None:
        if self.construction not in CONSTRUCTIONS:
            raise ValueError(
                f"construction must be one of {CONSTRUCTIONS}, got {self.construction!r}"
            )
        if self.angle not in ANGLE_RULES:
            raise ValueError(f"angle must be one of {ANGLE_RULES}, got {self.angle!r}")
        if self.tol <= 0 or self.ridge < 0:
            raise ValueError("tol must be positive and ridge non-negative")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EqualizationInfo:
    """How Algorithm 1's Givens equalization ended: rotations applied, whether the block
    energies met the tolerance, and the largest relative deviation of a block's energy from
    their mean."""

    rotations: int
    converged: bool
    max_rel_deviation: float


def _check_cov(sigma: torch.Tensor) -> torch.Tensor:
    if sigma.dim() not in (2, 3) or sigma.shape[-1] != sigma.shape[-2]:
        raise ValueError(f"covariance must be [B, B] or [K, B, B], got {tuple(sigma.shape)}")
    if not torch.isfinite(sigma).all():
        raise ValueError("covariance has NaN or Inf entries")
    return sigma.to(torch.float64)


def regularize(sigma: torch.Tensor, ridge: float = 1e-8) -> torch.Tensor:
    """``Σ + δI`` with ``δ = ridge · tr(Σ)/B`` (A.7, numerical stability)."""
    b = sigma.shape[-1]
    tr = torch.diagonal(sigma, dim1=-2, dim2=-1).sum(-1)
    delta = ridge * tr / b
    eye = torch.eye(b, dtype=sigma.dtype, device=sigma.device)
    return sigma + delta[..., None, None] * eye


def _rel_deviation(s: torch.Tensor) -> torch.Tensor:
    d = torch.diagonal(s, dim1=-2, dim2=-1)
    c = d.mean(-1, keepdim=True)
    return ((d - c).abs() / c.clamp_min(torch.finfo(s.dtype).tiny)).amax(-1)


def _exact_angle(
    sii: torch.Tensor, sjj: torch.Tensor, sij: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """θ with ``σ_ii(θ) = c``: ``m + A cos 2θ + σ_ij sin 2θ = c`` (smallest |θ| solution)."""
    m, a = (sii + sjj) / 2, (sii - sjj) / 2
    rho = torch.sqrt(a * a + sij * sij)
    alpha = torch.atan2(sij, a)
    ratio = ((c - m) / rho.clamp_min(torch.finfo(rho.dtype).tiny)).clamp(-1.0, 1.0)
    beta = torch.acos(ratio)
    t1, t2 = (alpha + beta) / 2, (alpha - beta) / 2
    return torch.where(t1.abs() <= t2.abs(), t1, t2)


def _paper_angle(sii: torch.Tensor, sjj: torch.Tensor, sij: torch.Tensor) -> torch.Tensor:
    """Algorithm 1, line 6, literally: the Jacobi angle ½·arctan(2σ_ij / (σ_ii − σ_jj))."""
    return 0.5 * torch.atan2(2 * sij, sii - sjj)


def _rotate_rows(
    m: torch.Tensor, i: torch.Tensor, j: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    ar = torch.arange(m.shape[0], device=m.device)
    ri, rj = m[ar, i].clone(), m[ar, j].clone()
    m[ar, i] = cos[:, None] * ri + sin[:, None] * rj
    m[ar, j] = -sin[:, None] * ri + cos[:, None] * rj


def equalize_givens(
    sigma: torch.Tensor, angle: str = "exact", tol: float = 1e-9, max_rotations: int | None = None
) -> tuple[torch.Tensor, EqualizationInfo]:
    """Algorithm 1 (Givens rotations for variance equalization), batched over positions.

    ``sigma`` is ``[B, B]`` or ``[K, B, B]``; returns ``R`` of the same shape with
    ``diag(R Σ Rᵀ) ≈ tr(Σ)/B``. Each step pairs the most positive and the most negative
    deviation (opposite signs, line 5). With ``angle="exact"`` it stops after at most
    ``B − 1`` rotations; with ``angle="paper"`` it stops at ``max_rotations`` (default
    ``4·B²``) and reports ``converged=False`` when the literal angle does not equalize.
    """
    if angle not in ANGLE_RULES:
        raise ValueError(f"angle must be one of {ANGLE_RULES}, got {angle!r}")
    s = _check_cov(sigma)
    squeeze = s.dim() == 2
    s = s[None].clone() if squeeze else s.clone()
    n, b = s.shape[0], s.shape[-1]
    r = torch.eye(b, dtype=s.dtype, device=s.device).expand(n, b, b).clone()
    if max_rotations is None:
        max_rotations = b - 1 if angle == "exact" else 4 * b * b
    target = torch.diagonal(s, dim1=-2, dim2=-1).mean(-1)
    steps = 0
    for _ in range(max_rotations):
        d = torch.diagonal(s, dim1=-2, dim2=-1) - target[:, None]
        active = d.abs().amax(-1) > tol * target.clamp_min(torch.finfo(s.dtype).tiny)
        if not bool(active.any()):
            break
        i, j = d.argmax(-1), d.argmin(-1)
        ar = torch.arange(n, device=s.device)
        sii, sjj, sij = s[ar, i, i], s[ar, j, j], s[ar, i, j]
        theta = (
            _exact_angle(sii, sjj, sij, target) if angle == "exact" else _paper_angle(sii, sjj, sij)
        )
        theta = torch.where(active & (i != j), theta, torch.zeros_like(theta))
        cos, sin = torch.cos(theta), torch.sin(theta)
        _rotate_rows(s, i, j, cos, sin)
        s = s.transpose(-1, -2).contiguous()
        _rotate_rows(s, i, j, cos, sin)
        _rotate_rows(r, i, j, cos, sin)
        steps += 1
    dev = float(_rel_deviation(s).max())
    info = EqualizationInfo(
        rotations=steps, converged=dev <= max(tol, 1e-12) * 10, max_rel_deviation=dev
    )
    return (r[0] if squeeze else r), info


def dct_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal DCT-II matrix of order ``n`` (rows are frequencies)."""
    k = torch.arange(n, dtype=dtype)[:, None]
    x = torch.arange(n, dtype=dtype)[None, :]
    m = torch.cos(math.pi * (2 * x + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m


def flat_mixing_matrix(n: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, bool]:
    """An orthogonal matrix with entries of magnitude ``1/√n`` if one exists here, else a DCT.

    Returns ``(Q, exact)``; ``exact`` says whether every entry has magnitude ``1/√n``.
    """
    if has_hadamard(n):
        return hadamard_matrix(n, dtype=dtype), True
    return dct_matrix(n, dtype=dtype), False


def equalize_closed_form(
    sigma: torch.Tensor, tol: float = 1e-9
) -> tuple[torch.Tensor, EqualizationInfo]:
    """Closed form (method-notes §2): ``R = Q Uᵀ`` with ``Σ = U Λ Uᵀ`` and a flat ``Q``.

    ``diag(Q Λ Qᵀ) = Σ_k Q_bk² λ_k = tr(Σ)/B`` when every ``|Q_bk| = 1/√B``. For orders with
    no Hadamard matrix, exact Givens steps (at most ``B − 1``) correct the DCT's residue.
    """
    s = _check_cov(sigma)
    _, u = torch.linalg.eigh(s)
    q, exact = flat_mixing_matrix(s.shape[-1], s.dtype)
    r = q.to(s.device) @ u.transpose(-1, -2)
    if exact:
        rotated = r @ s @ r.transpose(-1, -2)
        dev = float(_rel_deviation(rotated).max())
        return r, EqualizationInfo(rotations=0, converged=True, max_rel_deviation=dev)
    rotated = r @ s @ r.transpose(-1, -2)
    g, info = equalize_givens(rotated, "exact", tol)
    return g @ r, info


def inter_block_rotations(
    cov: torch.Tensor, config: InterBlockConfig
) -> tuple[torch.Tensor, EqualizationInfo]:
    """The per-position rotations ``R_k`` (``[K, B, B]``) for per-position covariances ``Σ_k``.

    With ``config.shared``, one ``R`` is built from ``Σ = Σ_k Σ_k`` and repeated for every k.
    """
    cov = _check_cov(cov)
    if cov.dim() != 3:
        raise ValueError(f"expected per-position covariances [K, B, B], got {tuple(cov.shape)}")
    k = cov.shape[0]
    target = cov.sum(0, keepdim=True) if config.shared else cov
    target = regularize(target, config.ridge)
    if config.construction == "closed_form":
        r, info = equalize_closed_form(target, config.tol)
    else:
        r, info = equalize_givens(target, config.angle, config.tol)
    if config.shared:
        r = r.expand(k, -1, -1).contiguous()
    return r, info
