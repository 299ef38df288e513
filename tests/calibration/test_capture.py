"""Layer-wise calibration capture on tiny models of every architecture."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_model
from torq.calibration.capture import (
    BlockStatistics,
    ExpertsStatistics,
    calibration_arithmetic,
    capture_layer_inputs,
)
from torq.calibration.data import CaptureSettings
from torq.driver import calibrate_layerwise


def test_block_covariance_matches_direct_computation() -> None:
    torch.manual_seed(0)
    st = BlockStatistics(width=12, block_size=4, reservoir=10, seed=0)
    xs = [torch.randn(2, 7, 12) for _ in range(3)]
    for x in xs:
        st.update(x)
    allx = torch.cat([x.reshape(-1, 12) for x in xs]).double().reshape(-1, 3, 4)
    expected = torch.stack([allx[:, :, k].T @ allx[:, :, k] for k in range(4)]) / allx.shape[0]
    assert torch.allclose(st.covariance(), expected)
    assert st.count == 42
    assert st.sample.shape == (10, 12)
    # Every reservoir row is one of the rows seen.
    rows = torch.cat([x.reshape(-1, 12) for x in xs])
    assert all(((rows - s).abs().sum(-1) == 0).any() for s in st.sample)


def test_float32_products_sum_in_float64_to_float32s_precision() -> None:
    """``products=float32`` (the "tf32" arithmetic; TF32 itself only on a GPU) keeps float64
    sums: the statistics agree with the exact ones to float32's precision, not bit for bit."""
    gen = torch.Generator().manual_seed(0)
    exact = BlockStatistics(64, 32, 4, seed=0, hessian=True, cross=True)
    fast = BlockStatistics(64, 32, 4, seed=0, hessian=True, cross=True, products=torch.float32)
    for _ in range(3):
        x = torch.randn(2, 50, 64, generator=gen)
        ref = x + 0.1 * torch.randn(x.shape, generator=gen)
        exact.update(x, ref)
        fast.update(x, ref)
    for a, b in (
        (exact.covariance(), fast.covariance()),
        (exact.hessian(), fast.hessian()),
        (exact.cross_term(), fast.cross_term()),
    ):
        assert b.dtype == torch.float64 and not torch.equal(a, b)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert torch.equal(exact.sample, fast.sample)  # the same tokens kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tf32_statistics_are_exact_to_tf32s_rounding() -> None:
    """On a GPU, the "tf32" arithmetic's statistics differ from the CPU's float64 ones by
    TF32's rounding (a 10-bit significand, unit roundoff 2⁻¹¹ ≈ 4.9e-4, each product's
    operands rounded once): norm-wise within a few unit roundoffs, and visibly more than
    float32's, so TF32 did run; the exact arithmetic on the GPU is float64's."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 512, 256, generator=gen) * 3.0 for _ in range(3)]
    refs = [x + 0.1 * torch.randn(x.shape, generator=gen) for x in xs]

    def stats(device: str, arithmetic: str) -> BlockStatistics:
        products = torch.float32 if arithmetic == "tf32" else torch.float64
        st = BlockStatistics(
            256, 32, 4, seed=0, hessian=True, cross=True, device=device, products=products
        )
        with calibration_arithmetic(arithmetic):
            for x, ref in zip(xs, refs, strict=True):
                st.update(x.to(device), ref.to(device))
        return st

    cpu, exact, tf32 = stats("cpu", "exact"), stats("cuda", "exact"), stats("cuda", "tf32")
    for name in ("covariance", "hessian", "cross_term"):
        want = getattr(cpu, name)().cpu()
        scale = float(torch.linalg.norm(want))
        gpu_exact = float(torch.linalg.norm(getattr(exact, name)().cpu() - want)) / scale
        gpu_tf32 = float(torch.linalg.norm(getattr(tf32, name)().cpu() - want)) / scale
        assert gpu_exact < 1e-12, name
        assert 1e-6 < gpu_tf32 < 4 * 2.0**-11, (name, gpu_tf32)


def test_calibration_arithmetic_sets_tf32_and_puts_it_back() -> None:
    before = torch.backends.cuda.matmul.allow_tf32
    with calibration_arithmetic("tf32"):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with calibration_arithmetic("exact"):
            assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before
    with (
        pytest.raises(ValueError, match="arithmetic must be one of exact, tf32"),
        calibration_arithmetic("bf16"),
    ):
        pass
    with pytest.raises(ValueError, match="arithmetic must be one of exact, tf32"):
        CaptureSettings(arithmetic="fp16")


def test_reservoir_is_roughly_uniform() -> None:
    st = BlockStatistics(width=4, block_size=4, reservoir=200, seed=1)
    for i in range(50):
        st.update(torch.full((40, 4), float(i)))
    firsts = st.sample[:, 0]
    # 2000 items, 200 kept: the first and second halves are each near 100.
    assert 60 < int((firsts < 25).sum()) < 140


def test_layerwise_replay_reproduces_the_model(arch: str) -> None:
    """With a no-op solver, the layer-by-layer replay gives the float model's hidden states."""
    model = tiny_model(arch)
    windows = torch.randint(0, model.config.vocab_size, (3, 16))
    seen_groups: list[list[str]] = []
    last_layer_cov: dict[str, torch.Tensor] = {}

    def solver(li, layer, groups, stats):
        seen_groups.append([g.name for g in groups])
        for g in groups:
            st = stats[g.name]
            if isinstance(st, ExpertsStatistics):  # every token in; each its top-k experts
                k = model.config.num_experts_per_tok
                assert st.input.count == 3 * 16
                assert sum(d.count for d in st.down) == st.down_shared.count == 3 * 16 * k
            else:
                assert st.count == 3 * 16
        if li == model.config.num_hidden_layers - 1:
            last_layer_cov["qkv"] = stats["q_proj+k_proj+v_proj"].covariance()
        return {}

    records, times = calibrate_layerwise(
        copy.deepcopy(model), windows, solver, block_size=16, reservoir=8, progress=False
    )
    assert len(records) == model.config.num_hidden_layers
    assert times.forward_seconds > 0
    expected = {"q_proj+k_proj+v_proj", "o_proj"}
    # fused MoE experts are one group of their own (their input and down_proj inputs)
    expected |= {"gate_proj+up_proj", "down_proj"} if arch != "qwen3_moe" else {"experts"}
    assert set(seen_groups[0]) == expected
    # The last layer's q/k/v input statistics equal those of an ordinary full forward.
    inputs: list[torch.Tensor] = []
    q_proj = model.model.layers[-1].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(lambda m, a: inputs.append(a[0].reshape(-1, 64)))
    with torch.no_grad():
        model(input_ids=windows)
    handle.remove()
    x = torch.cat(inputs).double().reshape(-1, 4, 16)
    direct = torch.einsum("tbk,tck->kbc", x, x) / x.shape[0]
    torch.testing.assert_close(last_layer_cov["qkv"], direct, rtol=1e-4, atol=1e-6)
    hidden, kwargs = capture_layer_inputs(model, windows)
    assert len(hidden) == 3 and len(kwargs) == model.config.num_hidden_layers


def test_the_cross_term_is_taken_over_the_tokens_with_float_inputs_only() -> None:
    """``--gptaq-windows``: batches without the float model's inputs add to the Hessian and
    the covariance, not to GPTAQ's cross term, which is the mean over the batches that had
    them; with none at all it refuses."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 50, 64, generator=gen) for _ in range(3)]
    refs = [x + 0.1 * torch.randn(x.shape, generator=gen) for x in xs]
    partial = BlockStatistics(64, 32, 4, seed=0, hessian=True, cross=True)
    first = BlockStatistics(64, 32, 4, seed=0, hessian=True, cross=True)
    every = BlockStatistics(64, 32, 4, seed=0, hessian=True, cross=True)
    for i, (x, ref) in enumerate(zip(xs, refs, strict=True)):
        partial.update(x, ref if i == 0 else None)
        every.update(x, ref)
    first.update(xs[0], refs[0])
    assert partial.count == 300 and partial.cross_count == 100
    assert torch.equal(partial.hessian(), every.hessian())
    assert torch.equal(partial.cross_term(), first.cross_term())
    none = BlockStatistics(64, 32, 4, seed=0, hessian=True, cross=True)
    none.update(xs[0])
    with pytest.raises(ValueError, match="needs the float model's inputs"):
        none.cross_term()
