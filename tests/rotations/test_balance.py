"""Channel balancing: the scales minimize the per-block energy product; fusion stays exact."""

from __future__ import annotations

import pytest
import torch

from torq.rotations.balance import (
    balance_covariance,
    balance_scales,
    channel_energy,
)
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import BlockRotation

K = 32


def _energy_product(energy: torch.Tensor, weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``Σ_b (Σ_j E[x_j²]/s_j²)(Σ_j s_j² ‖w_j‖²)``: the error model of the module docstring."""
    ex = (energy / s**2).reshape(-1, K).sum(-1)
    ew = (weight.pow(2).sum(0) * s**2).reshape(-1, K).sum(-1)
    return (ex * ew).sum()


def _data(seed: int = 0, d: int = 128, out: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, d, generator=g, dtype=torch.float64)
    x = x * torch.exp(2 * torch.randn(d, generator=g, dtype=torch.float64))  # outlier channels
    w = torch.randn(out, d, generator=g, dtype=torch.float64)
    w = w * torch.exp(torch.randn(d, generator=g, dtype=torch.float64))
    return x, w


def test_half_strength_minimizes_the_block_energy_product() -> None:
    x, w = _data()
    energy = x.pow(2).mean(0)
    s = balance_scales(energy, w, 0.5)
    assert torch.allclose(s.log().mean(), torch.zeros((), dtype=torch.float64), atol=1e-12)
    best = _energy_product(energy, w, s)
    assert best < _energy_product(energy, w, torch.ones_like(s))
    g = torch.Generator().manual_seed(1)
    for _ in range(50):  # no perturbation of s does better (Cauchy–Schwarz, per block)
        t = s * torch.exp(0.3 * torch.randn(s.shape, generator=g, dtype=torch.float64))
        assert _energy_product(energy, w, t) >= best * (1 - 1e-12)
    for alpha in (0.0, 0.3, 0.7, 1.0):
        assert _energy_product(energy, w, balance_scales(energy, w, alpha)) >= best


def test_channel_energy_reads_the_covariance_diagonal() -> None:
    x, _ = _data(d=96)
    xb = x.reshape(-1, 3, K)
    cov = torch.einsum("tbk,tck->kbc", xb, xb) / x.shape[0]
    assert torch.allclose(channel_energy(cov), x.pow(2).mean(0))
    s = balance_scales(channel_energy(cov), torch.randn(8, 96, dtype=torch.float64))
    xs = (x / s).reshape(-1, 3, K)
    cov_s = torch.einsum("tbk,tck->kbc", xs, xs) / x.shape[0]
    assert torch.allclose(balance_covariance(cov, s), cov_s)


def test_dead_channels_get_finite_scales_and_bad_input_is_refused() -> None:
    energy = torch.ones(64, dtype=torch.float64)
    energy[3] = 0.0
    w = torch.randn(8, 64, dtype=torch.float64)
    w[:, 5] = 0.0
    s = balance_scales(energy, w)
    assert torch.isfinite(s).all() and (s > 0).all()
    with pytest.raises(ValueError, match="alpha"):
        balance_scales(energy, w, 1.5)
    with pytest.raises(ValueError, match="agree"):
        balance_scales(energy[:32], w)
    energy[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        balance_scales(energy, w)


@pytest.mark.parametrize("with_inter", [False, True])
def test_scaled_transform_fuses_exactly(with_inter: bool) -> None:
    x, w = _data(d=96)
    s = balance_scales(x.pow(2).mean(0), w)
    r_inter = torch.linalg.qr(torch.randn(K, 3, 3, dtype=torch.float64))[0] if with_inter else None
    t = BlockRotation(K, r_inter, hadamard_matrix(K), dtype=torch.float64, channel_scale=s)
    w_fused = t.fuse_inverse(w)
    ref = x @ w.T
    assert torch.allclose(t(x) @ w_fused.T, ref, rtol=1e-10, atol=1e-10 * ref.abs().max())
    # GPTQ's Hessian of the transformed inputs is T H Tᵀ, with T now not orthogonal
    h = x.T @ x / x.shape[0]
    tx = t(x)
    assert torch.allclose(t.conjugate_hessian(h), tx.T @ tx / x.shape[0], rtol=1e-9, atol=1e-9)


def test_channel_scale_is_validated() -> None:
    with pytest.raises(ValueError, match="channel_scale"):
        BlockRotation(K, None, None, channel_scale=torch.ones(33))
    with pytest.raises(ValueError, match="positive"):
        BlockRotation(K, None, None, channel_scale=-torch.ones(32))
    with pytest.raises(ValueError, match="needs"):
        BlockRotation(K, None, None)
    only_scale = BlockRotation(K, None, None, channel_scale=torch.full((64,), 2.0))
    assert torch.equal(only_scale(torch.ones(3, 64)), torch.full((3, 64), 0.5))


def test_block_mass_permutation_evens_out_the_blocks() -> None:
    """Every block gets ``block`` channels, each channel once; the blocks' squared masses
    (the proxy of the balancing docstring) fall, to within the largest mass of the ideal
    equal share; bad input is refused."""
    from torq.rotations.balance import block_mass_permutation

    gen = torch.Generator().manual_seed(0)
    mass = torch.exp(2 * torch.randn(256, generator=gen, dtype=torch.float64))
    perm = block_mass_permutation(mass, 32)
    assert perm.dtype == torch.int64 and torch.equal(torch.sort(perm).values, torch.arange(256))
    before = mass.reshape(8, 32).sum(1)
    after = mass[perm].reshape(8, 32).sum(1)
    assert float(after.pow(2).sum()) < float(before.pow(2).sum())
    ideal = float(mass.sum()) / 8
    assert float((after - ideal).abs().max()) <= float(mass.max())
    with pytest.raises(ValueError, match="multiple of 32"):
        block_mass_permutation(mass[:100], 32)
    with pytest.raises(ValueError, match="NaN"):
        block_mass_permutation(torch.full((32,), float("nan")), 32)
