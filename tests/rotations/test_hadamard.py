"""Kronecker factors of the Hadamard constructions and their factored online application."""

from __future__ import annotations

import pytest
import torch

from torq.methods.hadamard import FACTORED_ABOVE, hadamard_rotation
from torq.rotations.hadamard import hadamard_factors, hadamard_matrix
from torq.rotations.transform import BlockRotation

F64 = torch.float64


@pytest.mark.parametrize("n", [12, 32, 128, 576, 896, 1536, 4864])
def test_factors_multiply_back_to_the_same_matrix(n: int) -> None:
    factors = hadamard_factors(n)
    assert 1 <= len(factors) <= 2
    kron = factors[0]
    for f in factors[1:]:
        kron = torch.kron(kron, f)
    # The exact matrix hadamard_matrix builds, not merely some Hadamard matrix of order n.
    torch.testing.assert_close(kron, hadamard_matrix(n), rtol=0, atol=1e-15)
    raw = hadamard_factors(n, normalized=False)
    kron_raw = raw[0]
    for f in raw[1:]:
        kron_raw = torch.kron(kron_raw, f)
    assert torch.equal(kron_raw, hadamard_matrix(n, normalized=False))


def test_factors_of_the_model_widths_are_much_smaller() -> None:
    # The widths the full-width Hadamards meet (SmolLM2, Qwen2.5-0.5B, their MLPs).
    orders = {n: [f.shape[0] for f in hadamard_factors(n)] for n in (576, 896, 1536, 4864)}
    assert orders == {576: [8, 72], 896: [4, 224], 1536: [4, 384], 4864: [8, 608]}


def test_no_factors_without_a_construction() -> None:
    with pytest.raises(ValueError, match="18"):
        hadamard_factors(18)


@pytest.mark.parametrize("n", [576, 1536])
@pytest.mark.parametrize("with_scale", [False, True])
def test_factored_forward_equals_the_dense_one(n: int, with_scale: bool) -> None:
    g = torch.Generator().manual_seed(n)
    scale = torch.rand(n, generator=g, dtype=F64) + 0.5 if with_scale else None
    h = hadamard_matrix(n)
    dense = BlockRotation(n, None, h, dtype=F64, channel_scale=scale)
    factored = BlockRotation(
        n, None, h, dtype=F64, channel_scale=scale, intra_factors=hadamard_factors(n)
    )
    assert factored.n_factors == 2
    x = torch.randn(3, 5, n, generator=g, dtype=F64)
    want = (x if scale is None else x / scale) @ h
    torch.testing.assert_close(factored(x), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(dense(x), want, rtol=0, atol=1e-12)
    # Several groups along the width, and no tokens at all.
    two = BlockRotation(n, None, h, dtype=F64, intra_factors=hadamard_factors(n))
    x2 = torch.randn(4, 2 * n, generator=g, dtype=F64)
    torch.testing.assert_close(two(x2), (x2.view(4, 2, n) @ h).view(4, 2 * n), rtol=0, atol=1e-12)
    assert two(torch.empty(0, n, dtype=F64)).shape == (0, n)


def test_factored_forward_in_float32_and_through_autograd() -> None:
    n = 1536
    t = hadamard_rotation(n)
    assert t.n_factors == 2
    x = torch.randn(7, n, requires_grad=True)
    y = t(x)
    ref = (x.detach().double() @ hadamard_matrix(n)).float()
    torch.testing.assert_close(y.detach(), ref, rtol=0, atol=1e-5)
    # Orthogonal: the gradient of ½‖T x‖² is x.
    (0.5 * y.pow(2).sum()).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x.detach(), rtol=0, atol=1e-5)


def test_small_groups_stay_dense() -> None:
    assert hadamard_rotation(FACTORED_ABOVE).n_factors == 0
    assert hadamard_rotation(32).n_factors == 0


def test_factor_errors() -> None:
    h = hadamard_matrix(12)
    with pytest.raises(ValueError, match="r_intra"):
        BlockRotation(
            12, None, None, channel_scale=torch.ones(12), intra_factors=[torch.eye(3), torch.eye(4)]
        )
    with pytest.raises(ValueError, match="not r_intra"):
        BlockRotation(12, None, h, intra_factors=[torch.eye(3), torch.eye(4)])
    with pytest.raises(ValueError, match="at most two"):
        BlockRotation(12, None, h, intra_factors=[torch.eye(2), torch.eye(2), torch.eye(3)])


def test_factors_follow_the_module_to_another_dtype() -> None:
    t = hadamard_rotation(576).to(F64)
    assert t.intra_factor0.dtype == F64 and t.intra_factor1.dtype == F64
    x = torch.randn(2, 576, dtype=F64)
    y = t(x)
    assert y.dtype == F64
    # The buffers were built in float32, so they carry float32's rounding of 1/√n.
    torch.testing.assert_close(y, x @ hadamard_matrix(576), rtol=0, atol=1e-6)
