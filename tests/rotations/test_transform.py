"""The structured online transform and the fusion of its inverse into the weights."""

from __future__ import annotations

import pytest
import torch

from torq.rotations.transform import BlockRotation

F64 = torch.float64


def _random_orthogonal(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*shape, shape[-1], generator=g, dtype=F64))
    return q


def _dense(t: BlockRotation, d: int) -> torch.Tensor:
    """The d×d matrix of T: column j is T applied to the j-th unit vector."""
    return t(torch.eye(d, dtype=F64)).T


@pytest.mark.parametrize(("use_inter", "use_intra"), [(True, True), (True, False), (False, True)])
def test_structured_transform_is_orthogonal_and_fuses_exactly(
    use_inter: bool, use_intra: bool
) -> None:
    k, b = 8, 6
    d = k * b
    t = BlockRotation(
        k,
        _random_orthogonal(k, b, seed=1) if use_inter else None,
        _random_orthogonal(k, seed=2) if use_intra else None,
        dtype=F64,
    )
    dense = _dense(t, d)
    assert torch.allclose(dense @ dense.T, torch.eye(d, dtype=F64), atol=1e-12)
    x = torch.randn(5, 3, d, dtype=F64)
    assert torch.allclose(t(x), x @ dense.T, atol=1e-12)
    w = torch.randn(7, d, dtype=F64)
    w_fused = t.fuse_inverse(w)
    assert torch.allclose(w_fused, w @ dense.T, atol=1e-12)
    # W' (T x) = W x: the transformed layer computes the same function in full precision.
    assert torch.allclose(t(x) @ w_fused.T, x @ w.T, atol=1e-10)


def test_inter_block_acts_per_position() -> None:
    """Y[:, k] = R_k X[:, k]: position k of every block mixes only with position k."""
    k, b = 4, 3
    r = _random_orthogonal(k, b, seed=3)
    t = BlockRotation(k, r, None, dtype=F64)
    x = torch.randn(b * k, dtype=F64)
    y = t(x).reshape(b, k)
    xm = x.reshape(b, k)
    for pos in range(k):
        assert torch.allclose(y[:, pos], r[pos] @ xm[:, pos])


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("use_intra", [True, False])
def test_forward_matches_the_definition_with_a_channel_scale(
    requires_grad: bool, use_intra: bool
) -> None:
    """The three-pass forward (position-major copy with the scale divided in, batched R_k,
    transposed intra product) against ``Z[t] = (R_k (X[t] ⊘ S))_k R_intra`` written out;
    also through autograd, and with no tokens."""
    k, b = 8, 5
    r = _random_orthogonal(k, b, seed=4)
    intra = _random_orthogonal(k, seed=5) if use_intra else None
    scale = torch.rand(k * b, dtype=F64) + 0.5
    t = BlockRotation(k, r, intra, dtype=F64, channel_scale=scale)
    x = torch.randn(2, 3, k * b, dtype=F64, requires_grad=requires_grad)
    xs = (x / scale).reshape(2, 3, b, k)
    y = torch.stack([r[pos] @ xs[..., pos].unsqueeze(-1) for pos in range(k)], -1)[..., 0, :]
    expect = (y if intra is None else y @ intra).reshape(2, 3, k * b)
    got = t(x)
    assert got.shape == x.shape and got.is_contiguous()
    assert torch.allclose(got, expect, atol=1e-12)
    if requires_grad:
        got.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    assert t(torch.zeros(0, k * b, dtype=F64)).shape == (0, k * b)


def test_shape_errors() -> None:
    t = BlockRotation(4, None, torch.eye(4))
    with pytest.raises(ValueError, match="width"):
        t(torch.randn(2, 6))
    with pytest.raises(ValueError):
        BlockRotation(4)
    with pytest.raises(ValueError):
        BlockRotation(4, torch.randn(3, 2, 2))


@pytest.mark.parametrize("use_inter", [False, True])
def test_a_channel_permutation_runs_after_the_scale_and_fuses_exactly(use_inter: bool) -> None:
    """``T x = R P_π (x ⊘ s)``: the forward is the definition, ``W T⁻¹`` gathers the scaled
    columns first, so ``(W T⁻¹)(T x) = W x``; with the scale folded away the permutation
    stays online with the rotation; a non-permutation is refused."""
    k, b = 8, 6
    d = k * b
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(d, generator=g)
    scale = torch.exp(torch.randn(d, generator=g, dtype=F64))
    r_inter = _random_orthogonal(k, b, seed=1) if use_inter else None
    r_intra = _random_orthogonal(k, seed=2)
    t = BlockRotation(k, r_inter, r_intra, dtype=F64, channel_scale=scale, channel_perm=perm)
    plain = BlockRotation(k, r_inter, r_intra, dtype=F64)
    x = torch.randn(5, d, generator=g, dtype=F64)
    assert torch.allclose(t(x), plain((x / scale)[:, perm]), atol=1e-12)
    w = torch.randn(7, d, generator=g, dtype=F64)
    assert torch.allclose(t.fuse_inverse(w) @ t(x).T, w @ x.T, atol=1e-10)
    rest = t.without_channel_scale()
    assert rest is not None and torch.equal(rest.channel_perm, perm)
    assert torch.allclose(rest(x / scale), t(x), atol=1e-12)
    with pytest.raises(ValueError, match="permutation"):
        BlockRotation(k, None, r_intra, dtype=F64, channel_perm=torch.zeros(d, dtype=torch.int64))


def test_kernel_form_says_what_the_kernels_can_take() -> None:
    """One shared 32×32 matrix is a block matrix; channel scale or inter-block rotations on
    32-blocks go to the fused pre-pass; a permutation or other blocks stay a module."""
    d = 128
    intra = _random_orthogonal(32, seed=4)
    scale = torch.rand(d, dtype=F64) + 0.5
    inter = _random_orthogonal(32, d // 32, seed=5)
    perm = torch.randperm(d)
    assert BlockRotation(32, None, intra).kernel_form(32) == "block_matrix"
    assert BlockRotation(32, inter, intra).kernel_form(32) == "prepass"
    assert BlockRotation(32, None, intra, channel_scale=scale).kernel_form(32) == "prepass"
    assert BlockRotation(32, None, None, channel_scale=scale).kernel_form(32) == "prepass"
    assert BlockRotation(32, None, intra, channel_perm=perm).kernel_form(32) == "module"
    assert BlockRotation(16, None, intra[:16, :16]).kernel_form(32) == "module"
    assert BlockRotation(16, None, intra[:16, :16]).kernel_form(16) == "block_matrix"


def test_conjugate_hessian_leaves_the_online_module_as_it_is() -> None:
    """``T H Tᵀ`` in H's float64 from a float32 module equals the float64 module's result,
    and the module the layer runs keeps its dtype (the product runs on a cast copy)."""
    k, b = 8, 4
    g = torch.Generator().manual_seed(6)
    r_inter, r_intra = _random_orthogonal(k, b, seed=7), _random_orthogonal(k, seed=8)
    scale = torch.exp(torch.randn(k * b, generator=g, dtype=F64))
    t32 = BlockRotation(k, r_inter, r_intra, dtype=torch.float32, channel_scale=scale)
    t64 = BlockRotation(
        k, t32.r_inter.double(), t32.r_intra.double(), dtype=F64,
        channel_scale=t32.channel_scale.double(),
    )  # fmt: skip
    x = torch.randn(50, k * b, generator=g, dtype=F64)
    h = x.T @ x
    got = t32.conjugate_hessian(h)
    assert got.dtype == F64 and t32.r_inter.dtype == torch.float32
    assert torch.equal(got, t64.conjugate_hessian(h))
    tx = t64(x)
    assert torch.allclose(got, tx.T @ tx, rtol=1e-10, atol=1e-10 * h.abs().max())
