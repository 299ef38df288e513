"""GPTQ on the MX grid: RTN when inputs are uncorrelated, better than RTN when they are not."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torq.formats import dequantize, fake_quantize, get_format
from torq.formats.packed import encode_nvfp4_exact
from torq.formats.reference import nvfp4_tensor_scale, tensor_amax
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import BlockRotation
from torq.surgery.gptq import GPTQConfig, damp_reference, gptq_quantize, largest_eigenvalue


def _correlated_inputs(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Inputs near a 32-dimensional subspace, as real activations are: GPTQ can move a
    column's rounding error onto correlated columns."""
    latent = torch.randn(n, 32, generator=gen, dtype=torch.float64)
    mix = torch.randn(32, k, generator=gen, dtype=torch.float64)
    return latent @ mix + 0.1 * torch.randn(n, k, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("fmt_name", ["mxfp4", "mxint4"])
def test_identity_hessian_is_round_to_nearest(fmt_name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 160, generator=gen)
    fmt = get_format(fmt_name)
    q, _ = gptq_quantize(w, torch.eye(160, dtype=torch.float64), fmt)
    assert torch.equal(q, fake_quantize(w, fmt))


@pytest.mark.parametrize("fmt_name", ["mxfp4", "mxint4", "nvfp4"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(fmt_name: str, act_order: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    k = 192
    x = _correlated_inputs(2048, k, gen)
    w = torch.randn(48, k, generator=gen, dtype=torch.float64).float()
    fmt = get_format(fmt_name)
    q, rec = gptq_quantize(w, x.T @ x, fmt, GPTQConfig(act_order=act_order))
    if fmt_name != "nvfp4":  # (NVFP4's tensor scale depends on the whole tensor's amax)
        # on the format's grid: quantizing again changes nothing
        assert torch.equal(fake_quantize(q, fmt), q)
    err_gptq = ((w.double() - q.double()) @ x.T).norm()
    err_rtn = ((w.double() - fake_quantize(w, fmt).double()) @ x.T).norm()
    assert err_gptq < 0.7 * err_rtn
    assert rec["proxy_loss"] > 0


def test_lazy_batches_are_an_exact_reformulation() -> None:
    gen = torch.Generator().manual_seed(4)
    x = _correlated_inputs(1000, 256, gen)
    w = torch.randn(16, 256, generator=gen)
    fmt = get_format("mxfp4")
    q32, _ = gptq_quantize(w, x.T @ x, fmt, GPTQConfig(lazy_batch=32))
    q256, _ = gptq_quantize(w, x.T @ x, fmt, GPTQConfig(lazy_batch=256))
    # the same columns are visited with the same updates; only float64 rounding differs,
    # which can flip a value sitting exactly on a rounding boundary
    assert (q32 != q256).float().mean() < 1e-3


def test_conjugate_hessian_is_t_h_tt() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 64, generator=gen, dtype=torch.float64)
    h = x.T @ x
    q, _ = torch.linalg.qr(torch.randn(32, 2, 2, generator=gen, dtype=torch.float64))
    t = BlockRotation(32, q, hadamard_matrix(32), dtype=torch.float64)
    tx = t(x)
    torch.testing.assert_close(t.conjugate_hessian(h), tx.T @ tx)


def test_dead_inputs_and_bad_hessians() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(500, 64, generator=gen, dtype=torch.float64)
    x[:, 5] = 0.0
    w = torch.randn(8, 64, generator=gen)
    q, _ = gptq_quantize(w, x.T @ x, get_format("mxfp4"))
    assert torch.all(q[:, 5] == 0) and torch.isfinite(q).all()
    with pytest.raises(ValueError, match="hessian must be"):
        gptq_quantize(w, torch.eye(32, dtype=torch.float64), get_format("mxfp4"))
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize(w, torch.full((64, 64), float("nan")), get_format("mxfp4"))
    with pytest.raises(ValueError, match="multiple of 32"):
        GPTQConfig(lazy_batch=100)


@pytest.mark.parametrize("fmt_name", ["mxfp4", "mxint4", "nvfp4"])
def test_mse_scales_round_each_block_no_worse_than_the_rule(fmt_name: str) -> None:
    """MR-GPTQ's MSE-chosen scales: with an identity Hessian GPTQ is round to nearest, so
    each block of each row is rounded with the least ``Σ|w − q|^2.4`` of the three scales
    around the rule's (MX: powers of two; NVFP4: neighbouring E4M3 values), never more than
    with the rule's, and less for some; the weights stay on the grid."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(32, 256, generator=gen) * torch.exp(torch.randn(32, 256, generator=gen))
    fmt = get_format(fmt_name)
    h = torch.eye(256, dtype=torch.float64)
    rule, _ = gptq_quantize(w, h, fmt)
    mse, _ = gptq_quantize(w, h, fmt, GPTQConfig(scale_search="mse"))
    k = fmt.block_size
    err_rule = (w - rule).double().abs().pow(2.4).reshape(32, 256 // k, k).sum(-1)
    err_mse = (w - mse).double().abs().pow(2.4).reshape(32, 256 // k, k).sum(-1)
    assert (err_mse <= err_rule).all()
    assert (err_mse < err_rule).float().mean() > 0.05
    if fmt_name == "nvfp4":  # its tensor scale is the original weight's
        packed = encode_nvfp4_exact(mse, nvfp4_tensor_scale(tensor_amax(w)))
        assert packed is not None and torch.equal(dequantize(packed), mse)
    else:
        assert torch.equal(fake_quantize(mse, fmt), mse)


def test_scale_search_is_checked() -> None:
    with pytest.raises(ValueError, match="scale_search"):
        GPTQConfig(scale_search="best")


@pytest.mark.parametrize("act_order", [False, True])
def test_asymmetric_gptq_is_closer_to_the_float_models_output(act_order: bool) -> None:
    """GPTAQ's loss ‖Q X̃ − W X‖² (X̃: the inputs an earlier quantization left, X: the
    float model's): GPTQ from the shifted target (asymmetry 1) lowers it below GPTQ on X̃
    alone, which only matches Q X̃ to W X̃; asymmetry 0 or no cross term is GPTQ exactly."""
    gen = torch.Generator().manual_seed(3)
    k = 128
    x = _correlated_inputs(4096, k, gen)
    # the quantized model's inputs: the float ones with a structured error
    drift = torch.randn(k, k, generator=gen, dtype=torch.float64) * 0.05
    x_q = x + x @ drift + 0.02 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
    w = torch.randn(40, k, generator=gen, dtype=torch.float64).float()
    fmt = get_format("mxfp4")
    h = x_q.T @ x_q
    cross = (x - x_q).T @ x_q
    plain, _ = gptq_quantize(w, h, fmt, GPTQConfig(act_order=act_order))
    cfg = GPTQConfig(act_order=act_order, asymmetry=1.0, max_shift=10.0)
    asym, rec = gptq_quantize(w, h, fmt, cfg, cross)
    target = x @ w.double().T

    def loss(q: torch.Tensor) -> float:
        return float((x_q @ q.double().T - target).pow(2).sum())

    assert loss(asym) < 0.9 * loss(plain)
    assert rec["asymmetric_shift"] > 0
    assert torch.equal(asym, fake_quantize(asym, fmt))  # on the grid
    same, _ = gptq_quantize(w, h, fmt, GPTQConfig(act_order=act_order), cross)
    assert torch.equal(same, plain)
    # a shift beyond max_shift (the inputs too far apart to trust the float output) is
    # refused: GPTQ's weights, and the record says so
    capped = GPTQConfig(act_order=act_order, asymmetry=1.0, max_shift=rec["asymmetric_shift"] / 2)
    refused, rec2 = gptq_quantize(w, h, fmt, capped, cross)
    assert torch.equal(refused, plain) and rec2["asymmetric_shift_refused"] == 1.0
    # the bound is on the full correction, whatever its weight: GPTAQ's α = 0.25 applies a
    # quarter of it, and is refused at the same bound
    quarter, rec3 = gptq_quantize(
        w, h, fmt, GPTQConfig(act_order=act_order, asymmetry=0.25, max_shift=10.0), cross
    )
    assert rec3["asymmetric_shift"] == pytest.approx(rec["asymmetric_shift"] / 4)
    assert not torch.equal(quarter, plain) and "asymmetric_shift_refused" not in rec3
    capped_quarter = replace(capped, asymmetry=0.25)
    refused_quarter, rec4 = gptq_quantize(w, h, fmt, capped_quarter, cross)
    assert torch.equal(refused_quarter, plain) and rec4["asymmetric_shift_refused"] == 1.0
    with pytest.raises(ValueError, match="cross term"):
        gptq_quantize(w, h, fmt, cfg, cross[:8])
    with pytest.raises(ValueError, match="asymmetry"):
        GPTQConfig(asymmetry=1.5)


def test_qronos_damping_is_a_share_of_the_largest_eigenvalue() -> None:
    """``damp_scale="largest-eigenvalue"`` damps by ``damp · λmax(H)`` (Qronos's reference):
    the power iteration estimates λmax, and the weights equal GPTQ's with the mean-diagonal
    damping that adds the same λ."""
    gen = torch.Generator().manual_seed(5)
    k = 96
    x = _correlated_inputs(2048, k, gen)
    h = x.T @ x
    top = torch.linalg.eigvalsh(h)[-1]
    # thirty iterations, as the reference's: a lower bound within a per cent of λmax
    estimate = float(largest_eigenvalue(h))
    assert 0.99 * float(top) <= estimate <= float(top) * (1 + 1e-12)
    assert float(largest_eigenvalue(h, steps=500)) == pytest.approx(float(top), rel=1e-9)
    assert float(largest_eigenvalue(torch.zeros(4, 4, dtype=torch.float64))) == 0.0
    assert damp_reference(h, "mean-diagonal") == torch.diag(h).mean()
    w = torch.randn(24, k, generator=gen, dtype=torch.float64).float()
    fmt = get_format("mxfp4")
    cfg = GPTQConfig(damp=1e-3, damp_scale="largest-eigenvalue")
    ours, _ = gptq_quantize(w, h, fmt, cfg)
    share = 1e-3 * float(largest_eigenvalue(h) / torch.diag(h).mean())
    same, _ = gptq_quantize(w, h, fmt, GPTQConfig(damp=share))
    assert torch.allclose(ours, same)
    gptq, _ = gptq_quantize(w, h, fmt, GPTQConfig())
    assert not torch.equal(ours, gptq)  # 0.73 % of the mean diagonal here, not GPTQ's 1 %
    with pytest.raises(ValueError, match="damp_scale"):
        GPTQConfig(damp_scale="trace")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_column_loop_as_a_cuda_graph_gives_the_eager_loop_bit_for_bit(fmt, monkeypatch) -> None:
    """On a GPU GPTQ's column loop runs as one CUDA graph per lazy batch: the same weights
    and proxy loss as the loop launched column by column, and the CPU's within float64's
    rounding of the matrix products; k = 300 leaves a partial last batch (eager)."""
    import time

    from torq.surgery import gptq as module

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 300, generator=gen)
    h = _correlated_inputs(2000, 300, gen)
    h = h.T @ h
    spec = get_format(fmt)
    runs: list[int] = []
    replay = module._BatchGraph.run
    monkeypatch.setattr(module._BatchGraph, "run", lambda g, *a: runs.append(1) or replay(g, *a))
    t0 = time.perf_counter()
    graphed, rec_g = gptq_quantize(w.cuda(), h.cuda(), spec)
    t_graph = time.perf_counter() - t0
    assert len(runs) == 2  # the two full batches of 128 columns ran as the graph
    monkeypatch.setattr(module, "USE_CUDA_GRAPHS", False)
    t0 = time.perf_counter()
    eager, rec_e = gptq_quantize(w.cuda(), h.cuda(), spec)
    t_eager = time.perf_counter() - t0
    print(f"{fmt}: graphed {t_graph:.3f} s (capture included), eager {t_eager:.3f} s")
    assert torch.equal(graphed, eager) and rec_g == rec_e
    cpu, _ = gptq_quantize(w, h, spec)
    assert float((graphed.cpu() - cpu).ne(0).float().mean()) < 0.01
