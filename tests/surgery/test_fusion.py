"""Residual-stream and head rotations fused into the weights: the same function in float."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_model
from torq.driver import apply_method
from torq.errors import TorqError
from torq.methods import MethodContext, get_method
from torq.methods.quarot import apply_quarot_rotations
from torq.rotations.hadamard import hadamard_matrix
from torq.surgery import QuantConfig, QuantLinear
from torq.surgery.fusion import (
    fold_rmsnorms,
    random_hadamard,
    rotate_heads,
    rotate_residual,
    untie_embeddings,
)

DENSE = ["llama", "qwen2", "qwen3", "mistral", "granite"]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch", DENSE)
def test_each_step_preserves_the_function(arch) -> None:
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    ref = _logits(model, ids)
    q = copy.deepcopy(model)
    untie_embeddings(q)
    assert q.get_output_embeddings().weight.data_ptr() != q.get_input_embeddings().weight.data_ptr()
    fold_rmsnorms(q)
    assert _rel(_logits(q, ids), ref) < 1e-5
    rotate_residual(q, random_hadamard(q.config.hidden_size, seed=3))
    assert _rel(_logits(q, ids), ref) < 1e-5
    rotate_heads(q, hadamard_matrix(q.config.head_dim))
    assert _rel(_logits(q, ids), ref) < 1e-5
    # the rotation really moved the weights
    assert not torch.allclose(q.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_random_signs_flip_channels_before_the_hadamard() -> None:
    """QuaRot's ``Q = diag(s) H / √n``: ``x Q = (x ⊙ s) H / √n``. With the signs after the
    Hadamard they would only flip output signs, which a sign-symmetric quantizer ignores,
    and the seed would change nothing."""
    n = 64
    q0, q1 = random_hadamard(n, seed=0), random_hadamard(n, seed=1)
    assert torch.allclose(q0 @ q0.T, torch.eye(n, dtype=q0.dtype), atol=1e-12)
    x = torch.randn(8, n, dtype=torch.float64)
    signs = torch.sign(q0[:, 0]) * torch.sign(hadamard_matrix(n)[:, 0])
    assert torch.allclose(x @ q0, (x * signs) @ hadamard_matrix(n))
    # different seeds give rotated vectors with different magnitudes, not just signs
    assert not torch.allclose((x @ q0).abs(), (x @ q1).abs())


@pytest.mark.parametrize("arch", DENSE)
def test_quarot_method_is_exact_in_float(arch) -> None:
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    ref = _logits(model, ids)
    q = copy.deepcopy(model)
    record = apply_method(get_method("quarot"), q, QuantConfig(None, None), MethodContext())
    assert _rel(_logits(q, ids), ref) < 1e-4
    downs = [m for n, m in q.named_modules() if n.endswith("down_proj")]
    assert downs and all(
        isinstance(m, QuantLinear) and m.input_transform is not None for m in downs
    )
    assert record["residual_width"] == model.config.hidden_size


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma2", "qwen3_moe"])
def test_unsupported_architectures_are_refused(arch) -> None:
    with pytest.raises(TorqError, match="residual-stream rotation"):
        apply_quarot_rotations(tiny_model(arch))


def test_rotation_must_be_orthogonal() -> None:
    model = tiny_model("llama")
    untie_embeddings(model)
    fold_rmsnorms(model)
    with pytest.raises(ValueError, match="orthogonal"):
        rotate_residual(model, torch.ones(64, 64))
