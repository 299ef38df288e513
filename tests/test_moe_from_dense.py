"""``benchmarks.moe_from_dense``: a dense model's MLPs split into experts, as Mixtral (Llama)
and Qwen2-MoE (Qwen2, with its shared expert); the exact variant computes the dense model's
function, the sparse one routes each token to its top-k experts by a fitted router."""

from __future__ import annotations

import pytest
import torch
from benchmarks import moe_from_dense as moe

from tests.conftest import tiny_model


@pytest.mark.parametrize(("dense_type", "moe_type"), [("llama", "mixtral"), ("qwen2", "qwen2_moe")])
def test_the_exact_variant_computes_the_dense_model(dense_type, moe_type) -> None:
    dense = tiny_model(dense_type, intermediate_size=256).eval()
    built = moe.build(dense, experts=4, top_k=None)
    assert built.config.model_type == moe_type and built.config.num_experts_per_tok == 4
    ids = torch.randint(0, dense.config.vocab_size, (2, 24))
    with torch.no_grad():
        want, got = dense(input_ids=ids).logits, built(input_ids=ids).logits
    # the same sums in another order: float32 rounding, nothing more
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if moe_type == "qwen2_moe":  # 4 routed slices of 32 and the rest (128) shared
        assert built.config.moe_intermediate_size == 32
        assert built.config.shared_expert_intermediate_size == 128
    # the router gives every expert 1/E: its weights are zero
    assert not built.model.layers[0].mlp.gate.weight.any()


def test_the_sparse_variant_routes_each_token_to_its_top_k(tmp_path) -> None:
    dense = tiny_model("llama", intermediate_size=256).eval()
    calib = torch.randint(0, dense.config.vocab_size, (4, 32))
    built = moe.build(dense, experts=4, top_k=2, calib=calib)
    router = built.model.layers[0].mlp.gate
    assert router.weight.abs().sum() > 0 and built.config.num_experts_per_tok == 2
    x = torch.randn(5, dense.config.hidden_size)
    _, weights, chosen = router(x)
    assert chosen.shape == (5, 2) and torch.allclose(weights.sum(-1), torch.ones(5))
    ids = torch.randint(0, dense.config.vocab_size, (1, 24))
    with torch.no_grad():
        want, got = dense(input_ids=ids).logits, built(input_ids=ids).logits
    assert torch.isfinite(got).all() and not torch.allclose(got, want, atol=1e-3)
    from transformers import AutoModelForCausalLM

    built.save_pretrained(tmp_path / "m")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, got)


def test_experts_must_split_the_neurons_into_blocks() -> None:
    with pytest.raises(SystemExit, match="do not split into 3 experts"):
        moe.expert_widths(256, 3, shared=False)
    assert moe.expert_widths(4864, 8, shared=True) == (512, 768)
    assert moe.expert_widths(1536, 8, shared=False) == (192, 0)
