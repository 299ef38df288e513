"""Inter-block rotation (Algorithm 1, corrected angle; closed form; shared variant)."""

from __future__ import annotations

import pytest
import torch

from torq.rotations.hadamard import hadamard_matrix, has_hadamard
from torq.rotations.inter_block import (
    InterBlockConfig,
    equalize_closed_form,
    equalize_givens,
    inter_block_rotations,
)

F64 = torch.float64


def _cov(b: int, seed: int = 0, rank: int | None = None) -> torch.Tensor:
    """A covariance with outlier blocks and correlations, like real activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3000, rank or b, generator=g, dtype=F64)
    if rank is not None:
        x = x @ torch.randn(rank, b, generator=g, dtype=F64)
    x = x * torch.logspace(0, 1.5, b, dtype=F64)[torch.randperm(b, generator=g)]
    return x.T @ x / x.shape[0]


def _check(r: torch.Tensor, s: torch.Tensor) -> None:
    b = s.shape[-1]
    eye = torch.eye(b, dtype=F64)
    assert (r @ r.transpose(-1, -2) - eye).abs().max() < 1e-10
    d = torch.diagonal(r @ s @ r.transpose(-1, -2), dim1=-2, dim2=-1)
    c = torch.diagonal(s, dim1=-2, dim2=-1).sum(-1, keepdim=True) / b
    assert ((d - c).abs() / c).max() < 1e-6


@pytest.mark.parametrize("b", [2, 3, 18, 28, 48, 152])
def test_givens_equalizes_in_at_most_b_minus_1_rotations(b: int) -> None:
    s = _cov(b)
    r, info = equalize_givens(s)
    _check(r, s)
    assert info.converged and info.rotations <= b - 1


@pytest.mark.parametrize("b", [2, 12, 18, 28, 48, 152])
def test_closed_form_equalizes(b: int) -> None:
    s = _cov(b, seed=1)
    r, info = equalize_closed_form(s)
    _check(r, s)
    if has_hadamard(b):
        assert info.rotations == 0  # the Hadamard mixing is exact on its own


def test_singular_covariance() -> None:
    s = _cov(18, seed=2, rank=3)
    assert torch.linalg.matrix_rank(s) == 3
    for fn in (equalize_givens, equalize_closed_form):
        r, _ = fn(s)
        _check(r, s)


def test_zero_covariance_and_b_equals_one() -> None:
    r, info = equalize_givens(torch.zeros(4, 4, dtype=F64))
    assert torch.equal(r, torch.eye(4, dtype=F64)) and info.rotations == 0
    r1, _ = equalize_givens(torch.tensor([[3.0]], dtype=F64))
    assert torch.equal(r1, torch.ones(1, 1, dtype=F64))
    rc, _ = equalize_closed_form(torch.tensor([[3.0]], dtype=F64))
    assert rc.abs().item() == pytest.approx(1.0)


def test_paper_angle_does_not_equalize() -> None:
    """Algorithm 1's literal line 6 is the Jacobi angle: it zeroes σ_ij and pushes the two
    variances apart, towards the 2×2 eigenvalues, so the loop never reaches c·1."""
    s = _cov(18, seed=3)
    d0 = torch.diagonal(s)
    c = d0.mean()
    r, info = equalize_givens(s, angle="paper", max_rotations=200)
    assert not info.converged
    d = torch.diagonal(r @ s @ r.T)
    assert (d - c).abs().max() > (d0 - c).abs().max() * 0.5
    # One literal step on a pair with opposite deviations moves them apart.
    pair = torch.tensor([[3.0, 0.5], [0.5, 1.0]], dtype=F64)
    r1, _ = equalize_givens(pair, angle="paper", max_rotations=1)
    d1 = torch.diagonal(r1 @ pair @ r1.T)
    assert (d1[0] - d1[1]).abs() > 2.0
    assert torch.allclose(torch.sort(d1).values, torch.linalg.eigvalsh(pair))


def test_per_position_and_shared() -> None:
    cov = torch.stack([_cov(18, seed=k) for k in range(4)])
    r, _ = inter_block_rotations(cov, InterBlockConfig())
    assert r.shape == (4, 18, 18)
    _check(r, cov)
    rs, _ = inter_block_rotations(cov, InterBlockConfig(shared=True, construction="closed_form"))
    assert torch.equal(rs[0], rs[3])
    _check(rs[:1], cov.sum(0, keepdim=True))


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        equalize_givens(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="NaN"):
        equalize_givens(torch.full((3, 3), float("nan")))
    with pytest.raises(ValueError):
        InterBlockConfig(angle="jacobi")


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 48, 152, 576, 896])
def test_hadamard_orders(n: int) -> None:
    h = hadamard_matrix(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=F64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), n**-0.5, dtype=F64))


def test_no_hadamard_of_order_18() -> None:
    assert not has_hadamard(18)
    with pytest.raises(ValueError):
        hadamard_matrix(18)
