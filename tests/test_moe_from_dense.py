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


def test_coactivation_groups_put_neurons_that_fire_together_in_one_expert() -> None:
    # 4 planted groups of 8 neurons: each token's output is carried by one group alone
    gen = torch.Generator().manual_seed(0)
    planted = torch.randperm(32, generator=gen).reshape(4, 8)
    which = torch.randint(0, 4, (400,), generator=gen)
    mass = torch.zeros(400, 32)
    for t, g in enumerate(which.tolist()):
        mass[t, planted[g]] = torch.rand(8, generator=gen) + 0.5
    groups = moe.coactivation_groups(mass, experts=4, width=8)
    assert sorted(tuple(g.tolist()) for g in groups) == sorted(
        tuple(sorted(p.tolist())) for p in planted
    )
    # with a shared expert, it takes the neurons every token uses (largest mean mass)
    always = torch.full((400, 4), 5.0)
    shared_mass = torch.cat([mass, always], 1)
    groups = moe.coactivation_groups(shared_mass, experts=4, width=8)
    assert len(groups) == 5 and groups[-1].tolist() == [32, 33, 34, 35]
    assert sorted(torch.cat(groups).tolist()) == list(range(36))


def test_balanced_assignment_fills_every_expert_to_its_capacity() -> None:
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    # every row prefers column 0, which takes only two: the two best go there
    assert moe.balanced_assignment(scores, capacity=2).tolist() == [0, 0, 1, 1]
