"""The kernels' activation pre-passes with the nearest block-scale rule (torq's default
recipe, and compressed-tensors' loaders): one binade up when a block's amax has a
significand of at least 1.75. Each path against :mod:`torq.formats`' reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_mxfp4 import (
    DEVICE,
    FP32_ACCUMULATION_RTOL,
    KERNEL_VARIANTS,
    _rel_err,
    _special_activation,
    _torq_rotation,
)
from torq.formats import FormatSpec, fake_quantize, quantize
from torq.kernels import MXFP4Weight, PackedMXFP4Linear, mxfp4_linear, quantize_activation
from torq.kernels import reference_linear as reference

pytest.importorskip("triton")

NEAREST = FormatSpec("mxfp4", 32, "nearest")


def _activation(m: int, k: int, seed: int) -> torch.Tensor:
    """The special values of the OCP tests, and block maxima on both sides of 1.75."""
    x = _special_activation(m, k, torch.Generator().manual_seed(seed))
    edges = torch.tensor([1.75, 1.7499999, 3.5, -7.0, 1.875, 0.875 * 2**-100, 1.75 * 2**100])
    for i in range(min(k // 32, len(edges))):
        row = (5 + i) % m
        if torch.isfinite(x[row, i * 32 : (i + 1) * 32]).all():
            x[row, i * 32 : (i + 1) * 32] = x[row, i * 32 : (i + 1) * 32].clamp(-1.0, 1.0) * 0.5
            x[row, i * 32 + 7] = edges[i]
    return x


@pytest.mark.parametrize(("m", "k"), [(1, 32), (9, 96), (33, 256)])
def test_prepass_codes_and_scales_are_the_nearest_rule_bit_for_bit(m: int, k: int) -> None:
    x = _activation(m, k, m * 7 + k).to(DEVICE)
    codes, scales = quantize_activation(x, nearest=True)
    ref = quantize(x.cpu(), NEAREST)
    assert torch.equal(codes.cpu(), ref.codes) and torch.equal(scales.cpu(), ref.scales)
    ocp, _ = quantize_activation(x)
    assert not torch.equal(ocp.cpu(), codes.cpu())  # the rules differ on these blocks


@pytest.mark.parametrize("k", [32, 160, 1024])
def test_int8_prepass_is_the_nearest_rule(k: int) -> None:
    from torq.kernels.launch import quantize_activation_i8

    x = _activation(1, k, k)
    q, s = quantize_activation_i8(x.to(DEVICE), nearest=True)
    ref = fake_quantize(x, NEAREST)
    kp = (k + 31) // 32 * 32
    scale = s.cpu().double().repeat_interleave(32, dim=1)[:, :k] * 4
    values = q.cpu().double()[:, :k] / 2 * scale
    ok = ~ref.isnan()
    assert torch.equal(values[ok], ref.double()[ok]) and kp == q.shape[1]


@pytest.mark.parametrize("n_blocks", [3, 20])
def test_torq_prepass_with_the_nearest_rule_matches_the_module(n_blocks: int) -> None:
    """TORQ's transform fused into the pre-pass, nearest rule: the codes of the module
    followed by the plain nearest pre-pass, but for float32 sums in another order."""
    from torq.kernels.launch import quantize_activation_i8, quantize_activation_torq_i8

    gen = torch.Generator().manual_seed(n_blocks)
    rot = _torq_rotation(n_blocks, gen, True).to(DEVICE)
    x = torch.randn(8, n_blocks * 32, generator=gen).to(DEVICE)
    q, s = quantize_activation_torq_i8(x, rot, nearest=True)
    q_ref, s_ref = quantize_activation_i8(rot(x), nearest=True)
    assert (q.cpu() != q_ref.cpu()).float().mean() < 2e-3
    assert torch.equal(s.cpu(), s_ref.cpu()) or (s.cpu() != s_ref.cpu()).sum() <= 1
    _, s_ocp = quantize_activation_torq_i8(x, rot)
    assert not torch.equal(s_ocp.cpu(), s.cpu())  # some blocks took the binade up


@pytest.mark.parametrize(("m", "k"), [(1, 32), (6, 96), (9, 1000)])
def test_fp8_prepass_with_the_nearest_rule(m: int, k: int) -> None:
    """The FP8 path's values times the row scale are the nearest rule's MXFP4 values for
    every block within 2**14 of its row's largest (the OCP test's reading)."""
    from torq.kernels.launch import quantize_activation_fp8

    x = _activation(m, k, m + k)
    values, scale = quantize_activation_fp8(x.to(DEVICE), block=(2, 64), nearest=True)
    got = (values.float().cpu() * scale.cpu())[:, :k]
    ref = fake_quantize(x, NEAREST)
    packed = quantize(x, NEAREST)
    exponents = packed.scales.to(torch.int32) - 127
    finite = packed.scales != 255
    rows = torch.where(finite, exponents, -200).amax(dim=1).clamp(min=-120)
    near = (exponents >= rows[:, None] - 14).repeat_interleave(32, dim=1)[:, :k]
    ok = ~ref.isnan() & near
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got[ok], ref[ok])


VARIANTS = [
    (cfg, shape)
    for cfg in KERNEL_VARIANTS
    for shape in [(1, 24, 64), (33, 16, 96)]
    if not cfg.kind.startswith("gemv") or shape[0] <= cfg.block_m
]


@pytest.mark.parametrize(
    ("cfg", "shape"),
    VARIANTS,
    ids=[f"{c.kind}-a{c.a_mode}-s{c.split_k}-x{int(c.swap_ab)}-{s}" for c, s in VARIANTS],
)
def test_every_kernel_variant_with_the_nearest_rule(cfg, shape) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(13 * m + k)
    weight = MXFP4Weight.from_float(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).clamp(-1.5, 1.5)
    x[:, ::64] = 1.875  # every other block's amax: a significand past 1.75
    dev = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), k)
    y = mxfp4_linear(x.to(DEVICE), dev, backend="triton", config=cfg, nearest=True)
    ref = reference(x, weight, nearest=True)
    assert _rel_err(y.cpu(), ref) < FP32_ACCUMULATION_RTOL
    assert _rel_err(ref, reference(x, weight)) > 1e-3  # and the OCP rule is another


def test_packed_layer_computes_its_rule() -> None:
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(128, 24)
    layer = PackedMXFP4Linear.from_linear(lin)
    near = PackedMXFP4Linear(layer.weight_packed, lin.bias.detach(), nearest=True)
    x = torch.randn(3, 128, generator=gen)
    bias = lin.bias.detach()
    assert torch.equal(near(x), reference(x, layer.weight_packed, bias, nearest=True))
    assert torch.equal(layer(x), reference(x, layer.weight_packed, bias))
    assert "nearest" in repr(near) and "nearest" not in repr(layer)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 32), (37, 64, 224)])
def test_fp8_prefill_with_the_nearest_rule(m: int, n: int, k: int) -> None:
    from tests.kernels.test_triton_mxfp4 import FP8_RTOL
    from torq.kernels import KernelConfig

    gen = torch.Generator().manual_seed(m * n + k)
    weight = MXFP4Weight.from_float(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen).clamp(-1.5, 1.5) * 2
    x[:, ::64] = 1.875 * 2  # a block amax with a significand past 1.75
    dev = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), k)
    cfg = KernelConfig(2, 0, 64, kind="fp8_gemm", w_tile=(16, 64))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    xd = x.to(DEVICE, dtype)
    y = mxfp4_linear(xd, dev, backend="triton", config=cfg, nearest=True)
    ref = reference(x.to(dtype).float(), weight, nearest=True)
    assert _rel_err(y.float().cpu(), ref) < FP8_RTOL
    assert _rel_err(ref, reference(x.to(dtype).float(), weight)) > 10 * FP8_RTOL


def test_grouped_experts_decode_with_the_nearest_rule() -> None:
    """The experts' grouped integer GEMVs (one launch a projection for every chosen expert)
    with nearest-rule activations: the numbers of the fake-quant reference, expert by
    expert."""
    from tests.conftest import tiny_model
    from torq.kernels import PackedMXFP4Experts
    from torq.surgery import QuantConfig
    from torq.surgery.qlinear import QuantExperts

    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    cfg = QuantConfig.from_names("mxfp4", "mxfp4", scale_mode="nearest")
    packed = PackedMXFP4Experts.from_quant_experts(QuantExperts(experts, cfg), backend="triton")
    assert packed.nearest
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, packed.hidden_size, generator=gen)
    x[:, ::32] = 7.5  # every block's amax with a significand past 1.75
    x = x.to(DEVICE)
    top = torch.tensor([[0, 1], [2, 0]]).to(DEVICE)
    w = torch.rand(2, 2, generator=gen).to(DEVICE)
    packed = packed.to(DEVICE)
    grouped = packed.grouped(x, top, w)
    packed.backend = "reference"  # the fake-quant definition, the nearest rule's
    each = packed.run(x, packed.routes(top), w)
    assert _rel_err(grouped.cpu(), each.cpu()) < 1e-5
