"""The Triton MXFP4 kernels against torq's fake-quant reference.

On a machine without a GPU they run in Triton's interpreter (see conftest.py); on a GPU
the same tests run the compiled kernels, and the ``cuda`` tests below add bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torq.formats import fake_quantize, get_format, quantize
from torq.kernels import (
    KernelConfig,
    MXFP4Weight,
    PackedMXFP4Linear,
    mxfp4_linear,
    quantize_activation,
    reference_linear,
)
from torq.kernels.dispatch import apply_block_transform
from torq.rotations.hadamard import hadamard_matrix

pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A kernel and the reference add the same exact products in a different order.
FP32_ACCUMULATION_RTOL = 1e-5


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def _special_activation(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k).roll(7)
    x[0, : min(k, 32)] = 0.0  # an all-zero block
    if m > 1:
        x[1, 3] = float("nan")  # a NaN block
    if m > 2:
        x[2, -1] = float("inf")  # an Inf block
    if m > 3:
        x[3, :5] = -0.0
        x[3, 5:9] = torch.tensor([1e-40, -3e-39, 2.5, -2.75])  # subnormals, ties
    if m > 4:
        x[4] *= 1e30  # scales near the top of the range
    return x


@pytest.mark.parametrize(("m", "k"), [(1, 32), (5, 96), (33, 100), (70, 320)])
def test_quantize_prepass_is_bit_exact(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = _special_activation(m, k, gen).to(DEVICE)
    codes, scales = quantize_activation(x)
    ref = quantize(x, get_format("mxfp4"))
    assert torch.equal(codes.cpu(), ref.codes.cpu())
    assert torch.equal(scales.cpu(), ref.scales.cpu())


def _signed_permutation(gen: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(32, generator=gen)
    signs = torch.randint(0, 2, (32,), generator=gen) * 2.0 - 1.0
    return torch.eye(32)[perm] * signs[:, None]


def test_quantize_prepass_with_exact_block_transform() -> None:
    """A signed permutation is exact in any precision: codes must match bit for bit."""
    gen = torch.Generator().manual_seed(1)
    t = _signed_permutation(gen)
    x = torch.randn(19, 128, generator=gen)
    codes, scales = quantize_activation(x.to(DEVICE), t.to(DEVICE))
    ref = quantize(apply_block_transform(x, t), get_format("mxfp4"))
    assert torch.equal(codes.cpu(), ref.codes)
    assert torch.equal(scales.cpu(), ref.scales)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 40, 96), (3, 64, 256), (16, 17, 320), (17, 50, 160), (40, 130, 100), (131, 9, 64)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(m: int, n: int, k: int, with_bias: bool) -> None:
    """Decode (≤ 16 tokens, fused quantization) and prefill (pre-pass + matmul) paths; shapes
    that are not multiples of the tiles; every output element written (poisoned with NaN)."""
    gen = torch.Generator().manual_seed(m + n + k)
    weight = MXFP4Weight.from_float(torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(m, k, generator=gen) * 3
    ref = reference_linear(x, weight, bias)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), k)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    y = mxfp4_linear(
        x.to(DEVICE),
        dev_weight,
        None if bias is None else bias.to(DEVICE),
        backend="triton",
        out=out,
    )
    assert y.data_ptr() == out.data_ptr()
    assert not torch.isnan(y).any()
    assert _rel_err(y.cpu(), ref) < FP32_ACCUMULATION_RTOL


def test_split_k_decode_path() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = MXFP4Weight.from_float(torch.randn(48, 512, generator=gen))
    x = torch.randn(2, 512, generator=gen)
    ref = reference_linear(x, weight)
    cfg = KernelConfig(block_m=16, block_n=32, block_k=64, split_k=3)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), 512)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, backend="triton", config=cfg)
    assert _rel_err(y.cpu(), ref) < FP32_ACCUMULATION_RTOL


@pytest.mark.parametrize("m", [1, 2, 24, 300])
def test_linear_with_block_transform(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    weight = MXFP4Weight.from_float(torch.randn(24, 128, generator=gen))
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), 128)
    x = torch.randn(m, 128, generator=gen)
    # exact transform: the same codes, so fp32-accumulation agreement
    t = _signed_permutation(gen)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, block_transform=t.to(DEVICE), backend="triton")
    assert _rel_err(y.cpu(), reference_linear(x, weight, block_transform=t)) < 1e-5
    # a normalized Hadamard: entries are inexact, so an element sitting on a rounding
    # boundary may round the other way; the results still agree closely
    h = hadamard_matrix(32, dtype=torch.float32)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, block_transform=h.to(DEVICE), backend="triton")
    ref = reference_linear(x, weight, block_transform=h)
    assert not torch.isnan(y).any()
    assert _rel_err(y.cpu(), ref) < 2e-2


def test_packed_linear_equals_fake_quant_linear() -> None:
    """The CPU fallback is torq's fake-quant path: fake-quantized weight, activation."""
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(96, 20)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(20, 96, generator=gen))
    layer = PackedMXFP4Linear.from_linear(linear, backend="reference")
    x = torch.randn(4, 7, 96, generator=gen)
    fmt = get_format("mxfp4")
    expected = nn.functional.linear(
        fake_quantize(x, fmt), fake_quantize(linear.weight.detach(), fmt), linear.bias
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    assert layer(x).shape == (4, 7, 20)
    triton_layer = PackedMXFP4Linear.from_linear(linear, backend="triton").to(DEVICE)
    assert _rel_err(triton_layer(x.to(DEVICE)).cpu(), expected.detach()) < 1e-5


def test_packed_memory() -> None:
    weight = MXFP4Weight.from_float(torch.randn(64, 256))
    assert weight.nbytes == 64 * 256 // 2 + 64 * 256 // 32
    # 4.25 bits per weight: 16 / 4.25 = 3.76x smaller than bf16
    assert 64 * 256 * 2 / weight.nbytes == pytest.approx(16 / 4.25)


def test_bad_inputs() -> None:
    weight = MXFP4Weight.from_float(torch.randn(8, 64))
    with pytest.raises(ValueError, match="input width"):
        mxfp4_linear(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="32×32"):
        mxfp4_linear(torch.randn(2, 64), weight, block_transform=torch.eye(16))
    with pytest.raises(ValueError, match="NaN or Inf"):
        MXFP4Weight.from_float(torch.tensor([[float("nan")] * 32]))
    with pytest.raises(ValueError, match="2-D"):
        MXFP4Weight.from_float(torch.randn(64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_bf16_inputs(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    weight = MXFP4Weight.from_float(torch.randn(512, 1024, generator=gen) * 0.02)
    x = torch.randn(m, 1024, generator=gen).bfloat16()
    ref = reference_linear(x.float(), weight).double()
    dev_weight = MXFP4Weight(weight.codes.cuda(), weight.scales.cuda(), 1024)
    y = mxfp4_linear(x.cuda(), dev_weight)
    assert y.dtype == torch.bfloat16
    # only the final bf16 rounding of the output differs
    assert _rel_err(y.float().cpu(), ref.float()) < 4e-3


KERNEL_VARIANTS = [
    KernelConfig(1, 16, 64, kind="gemv_i8", a_mode=1),
    KernelConfig(1, 8, 64, split_k=3, kind="gemv_i8", a_mode=1),
    KernelConfig(1, 16, 64, split_k=2, kind="gemv_i8", a_mode=0),
    KernelConfig(1, 16, 64, split_k=2, kind="gemv_i8", a_mode=1, prefetch=True, pdl=True),
    KernelConfig(1, 8, 64, kind="gemv_i8", a_mode=1, prefetch=True, pdl=True, evict_first=True),
    KernelConfig(2, 8, 64, kind="gemv_i8", a_mode=1, evict_first=True),
    KernelConfig(1, 8, 32, kind="gemv_i8", a_mode=0, prefetch=True),
    KernelConfig(2, 16, 64, kind="gemv_i8", a_mode=1, prefetch=True),
    KernelConfig(4, 8, 32, kind="gemv_i8", a_mode=1),
    KernelConfig(16, 32, 64, a_mode=0),
    KernelConfig(16, 32, 64, a_mode=1),
    KernelConfig(16, 32, 64, a_mode=2),
    KernelConfig(16, 32, 64, split_k=2, a_mode=0),
    KernelConfig(16, 32, 64, a_mode=2, swap_ab=True),
    KernelConfig(0, 0, 32, kind="dequant_gemm"),
    KernelConfig(16, 64, 32, kind="dequant_gemm", a_mode=1),
    KernelConfig(16, 32, 64, kind="dot_scaled", a_mode=0),
    KernelConfig(32, 32, 64, kind="dot_scaled", a_mode=2),
]


VARIANT_CASES = [
    (cfg, shape)
    for cfg in KERNEL_VARIANTS
    for shape in [(1, 40, 96), (5, 50, 160), (33, 20, 224)]
    if not cfg.kind.startswith("gemv") or shape[0] <= cfg.block_m  # gemv: up to block_m tokens
]


@pytest.mark.parametrize(
    ("cfg", "shape"),
    VARIANT_CASES,
    ids=[
        f"{c.kind}-a{c.a_mode}-s{c.split_k}-x{int(c.swap_ab)}-p{int(c.prefetch)}-{s}"
        for c, s in VARIANT_CASES
    ],
)
def test_every_kernel_variant(cfg: KernelConfig, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(11 * m + k)
    weight = MXFP4Weight.from_float(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), k)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, bias.to(DEVICE), backend="triton", config=cfg)
    assert not torch.isnan(y).any()
    assert _rel_err(y.cpu(), reference_linear(x, weight, bias)) < FP32_ACCUMULATION_RTOL


def test_kernel_config_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        KernelConfig(16, 16, 64, kind="cublas")
    with pytest.raises(ValueError, match="dot_scaled"):
        KernelConfig(16, 16, 64, kind="dot_scaled", a_mode=1)
    weight = MXFP4Weight.from_float(torch.randn(8, 64).to(DEVICE))
    with pytest.raises(ValueError, match="takes up to block_m = 1 tokens"):
        mxfp4_linear(
            torch.randn(2, 64, device=DEVICE),
            weight,
            backend="triton",
            config=KernelConfig(1, 16, 64, kind="gemv_i8", a_mode=1),
        )


def test_dequantize_weight_kernel_is_exact() -> None:
    from torq.kernels.launch import dequantize_weight

    gen = torch.Generator().manual_seed(5)
    weight = MXFP4Weight.from_float(torch.randn(37, 100, generator=gen) * 0.1)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), 100)
    w = dequantize_weight(dev_weight, torch.float32).cpu()
    assert torch.equal(w[:, :100], weight.dequantize(torch.float32))
    assert torch.equal(w[:, 100:], torch.zeros(37, 28))


@pytest.mark.parametrize("k", [32, 100, 1024])
def test_int8_prepass_is_exact(k: int) -> None:
    """``2·Q(x)`` and ``s/4`` of the integer GEMV's pre-pass against torq.formats."""
    from torq.formats.constants import E2M1_VALUES
    from torq.kernels.launch import quantize_activation_i8

    gen = torch.Generator().manual_seed(k)
    x = _special_activation(1, k, gen)
    x[0, -1] = float("nan")
    q, s = quantize_activation_i8(x.to(DEVICE))
    ref = quantize(x, get_format("mxfp4"))
    kp = (k + 31) // 32 * 32
    codes = torch.stack([ref.codes & 0xF, ref.codes >> 4], dim=-1).reshape(1, kp).long()
    sign = torch.where(codes >= 8, -1.0, 1.0)
    twice = (2 * torch.tensor(E2M1_VALUES)[codes & 7] * sign).to(torch.int8)
    nan_blocks = (ref.scales == 255).repeat_interleave(32, dim=1)
    assert torch.equal(q.cpu(), torch.where(nan_blocks, 0, twice))
    scale = torch.exp2(ref.scales.double() - 127) / 4
    scale[ref.scales == 255] = float("nan")
    assert torch.equal(s.cpu().double().nan_to_num(-1.0), scale.nan_to_num(-1.0))


@pytest.mark.parametrize("split_k", [2, 5])
def test_split_k_gemv_workspace_resets(split_k: int) -> None:
    """The split-K integer GEMV leaves its workspace zeroed, so back-to-back calls (and
    calls with other weights of the same width) give the same results as one alone."""
    from torq.kernels.launch import gemv_workspace

    gen = torch.Generator().manual_seed(split_k)
    cfg = KernelConfig(1, 8, 64, split_k=split_k, kind="gemv_i8", a_mode=1)
    weights = [MXFP4Weight.from_float(torch.randn(24, 320, generator=gen)) for _ in range(2)]
    xs = [torch.randn(1, 320, generator=gen) for _ in range(2)]
    dev = [MXFP4Weight(w.codes.to(DEVICE), w.scales.to(DEVICE), 320) for w in weights]
    for _ in range(2):
        for w, wd, x in zip(weights, dev, xs, strict=True):
            y = mxfp4_linear(x.to(DEVICE), wd, backend="triton", config=cfg)
            assert _rel_err(y.cpu(), reference_linear(x, w)) < FP32_ACCUMULATION_RTOL
    ws, count = gemv_workspace(torch.device(DEVICE), 24)
    assert not ws.any() and not count.any()


@pytest.mark.parametrize("a_mode", [0, 1])
def test_gemv_i8_with_block_transform(a_mode: int) -> None:
    """The 32×32 block transform inside the integer GEMV: in its pre-pass (a_mode 1) or
    in the matmul (a_mode 0)."""
    gen = torch.Generator().manual_seed(3 + a_mode)
    k = 1024
    weight = MXFP4Weight.from_float(torch.randn(40, k, generator=gen))
    x = torch.randn(1, k, generator=gen)
    h = hadamard_matrix(32, dtype=torch.float32)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), k)
    cfg = KernelConfig(1, 16, 512, split_k=2, kind="gemv_i8", a_mode=a_mode)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, None, h.to(DEVICE), backend="triton", config=cfg)
    ref = reference_linear(x, weight, block_transform=h)
    # the transform's float32 sums may round a few elements to the other side of a
    # rounding boundary; everything else is exact
    assert _rel_err(y.cpu(), ref) < 2e-2
    # a signed permutation is exact and not symmetric: T must not be applied as Tᵀ
    t = _signed_permutation(gen)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, None, t.to(DEVICE), backend="triton", config=cfg)
    ref = reference_linear(x, weight, block_transform=t)
    assert _rel_err(y.cpu(), ref) < FP32_ACCUMULATION_RTOL


def _torq_rotation(n_blocks: int, gen: torch.Generator, scale: bool = True):
    from torq.rotations.transform import BlockRotation

    r_inter = torch.linalg.qr(torch.randn(32, n_blocks, n_blocks, generator=gen))[0]
    r_intra = torch.linalg.qr(torch.randn(32, 32, generator=gen))[0]
    cs = torch.rand(n_blocks * 32, generator=gen) + 0.5 if scale else None
    return BlockRotation(32, r_inter, r_intra, channel_scale=cs)


@pytest.mark.parametrize(("n_blocks", "scale"), [(3, True), (7, False), (20, True)])
def test_torq_prepass_matches_the_module(n_blocks: int, scale: bool) -> None:
    """TORQ's transform fused into the pre-pass gives the codes and scales of the torch
    module followed by the plain pre-pass, except where float32 sums in another order
    land on the other side of a rounding boundary."""
    from torq.kernels.launch import quantize_activation_i8, quantize_activation_torq_i8

    gen = torch.Generator().manual_seed(n_blocks)
    rot = _torq_rotation(n_blocks, gen, scale).to(DEVICE)
    x = torch.randn(2, n_blocks * 32, generator=gen).to(DEVICE)
    q, s = quantize_activation_torq_i8(x, rot)
    q_ref, s_ref = quantize_activation_i8(rot(x))
    assert (q.cpu() != q_ref.cpu()).float().mean() < 2e-3
    # a flip moves one E2M1 step: at most 4 in units of 2·E2M1 (from 8 to 12)
    assert (q.cpu().int() - q_ref.cpu().int()).abs().max() <= 4
    assert torch.equal(s.cpu(), s_ref.cpu()) or (s.cpu() != s_ref.cpu()).sum() <= 1


def test_packed_linear_with_torq_rotation() -> None:
    """A packed layer whose online transform is TORQ's rotation: the fused pre-pass on the
    one-token GEMV path against the fake-quant reference of ``W' · Q(T x)``."""
    gen = torch.Generator().manual_seed(9)
    rot = _torq_rotation(8, gen).to(DEVICE)
    lin = nn.Linear(256, 48).to(DEVICE)
    layer = PackedMXFP4Linear.from_linear(lin, input_transform=rot, backend="triton")
    x = torch.randn(1, 256, generator=gen).to(DEVICE)
    y = layer(x)
    ref = reference_linear(rot(x).cpu(), layer.weight_packed, lin.bias.detach().cpu())
    assert _rel_err(y.cpu(), ref) < 2e-2
    # the reference backend runs the same transform as a module
    layer.backend = "reference"
    assert _rel_err(layer(x).cpu(), ref) < 1e-6


@pytest.mark.parametrize(("rows", "m", "k"), [(2, 2, 96), (4, 3, 224), (4, 4, 64)])
def test_gemv_on_several_tokens(rows: int, m: int, k: int) -> None:
    """The integer GEMV on 2–4 tokens (one weight lookup shared by the tokens): against the
    reference, with a bias, a padded width, fewer tokens than rows, and the prefetch."""
    gen = torch.Generator().manual_seed(rows * 100 + m)
    weight = MXFP4Weight.from_float(torch.randn(37, k, generator=gen))
    bias = torch.randn(37, generator=gen)
    x = torch.randn(m, k, generator=gen)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), k)
    for prefetch in (False, True):
        cfg = KernelConfig(rows, 16, 64, kind="gemv_i8", a_mode=1, prefetch=prefetch)
        y = mxfp4_linear(x.to(DEVICE), dev_weight, bias.to(DEVICE), backend="triton", config=cfg)
        assert y.shape == (m, 37)
        assert _rel_err(y.cpu(), reference_linear(x, weight, bias)) < FP32_ACCUMULATION_RTOL


def test_gemv_on_several_tokens_with_torq_rotation() -> None:
    gen = torch.Generator().manual_seed(21)
    rot = _torq_rotation(4, gen).to(DEVICE)
    weight = MXFP4Weight.from_float(torch.randn(24, 128, generator=gen))
    x = torch.randn(3, 128, generator=gen)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), 128)
    cfg = KernelConfig(4, 8, 64, kind="gemv_i8", a_mode=1)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, backend="triton", config=cfg, rotation=rot)
    ref = reference_linear(rot(x.to(DEVICE)).cpu(), weight)
    assert _rel_err(y.cpu(), ref) < 1e-3


def test_a_rotation_of_other_blocks_runs_before_the_plain_prepass() -> None:
    """``--rotation-block 16`` gives a ``BlockRotation`` of 16-element blocks, which the
    fused pre-pass (32-element blocks) cannot take: the GEMV runs it as its module first
    (it raised before), as it does a permuted one."""
    from torq.kernels.launch import fusable_in_prepass
    from torq.rotations.transform import BlockRotation

    gen = torch.Generator().manual_seed(16)
    h = hadamard_matrix(16)
    rot16 = BlockRotation(16, None, h / h[0].norm(), channel_scale=torch.rand(128) + 0.5)
    assert not fusable_in_prepass(rot16) and fusable_in_prepass(_torq_rotation(4, gen))
    assert not fusable_in_prepass(None) and not fusable_in_prepass(nn.Identity())
    weight = MXFP4Weight.from_float(torch.randn(24, 128, generator=gen))
    x = torch.randn(1, 128, generator=gen)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), 128)
    cfg = KernelConfig(1, 8, 64, kind="gemv_i8", a_mode=1)
    rot16 = rot16.to(DEVICE)
    y = mxfp4_linear(x.to(DEVICE), dev_weight, backend="triton", config=cfg, rotation=rot16)
    ref = reference_linear(rot16(x.to(DEVICE)).cpu(), weight)
    assert _rel_err(y.cpu(), ref) < 1e-3


def test_gemv_rows_config_validation() -> None:
    with pytest.raises(ValueError, match="1, 2 or 4 tokens"):
        KernelConfig(3, 16, 64, kind="gemv_i8", a_mode=1)
    with pytest.raises(ValueError, match="pre-pass"):
        KernelConfig(4, 16, 64, kind="gemv_i8", a_mode=0)
    with pytest.raises(ValueError, match="pre-pass"):
        KernelConfig(2, 16, 64, split_k=2, kind="gemv_i8", a_mode=1)


@pytest.mark.parametrize(("m", "k"), [(1, 32), (6, 96), (9, 1000)])
def test_fp8_activation_prepass(m: int, k: int) -> None:
    """E4M3 values times the row scale are the MXFP4 values exactly for every block within
    2**14 of its row's largest; smaller blocks (these rows span 2**20) are within half an
    E4M3 subnormal step; NaN blocks stay NaN; every element is written."""
    from torq.kernels.launch import quantize_activation_fp8

    gen = torch.Generator().manual_seed(m + k)
    x = _special_activation(m, k, gen)
    values, scale = quantize_activation_fp8(x.to(DEVICE), block=(2, 64))
    assert values.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (m, 1)
    got = (values.float().cpu() * scale.cpu())[:, :k]
    ref = fake_quantize(x, get_format("mxfp4"))
    assert torch.equal(got.isnan(), ref.isnan())
    pad = values.float().cpu()[:, k:]  # zero, or NaN in a NaN block
    assert ((pad == 0) | (pad.isnan() & ref[:, -1:].isnan())).all()
    packed = quantize(x, get_format("mxfp4"))
    exponents = packed.scales.to(torch.int32) - 127
    finite = packed.scales != 255
    rows = torch.where(finite, exponents, -200).amax(dim=1).clamp(min=-120)
    near = (exponents >= rows[:, None] - 14).repeat_interleave(32, dim=1)[:, :k]
    ok = ~ref.isnan()
    assert torch.equal(got[ok & near], ref[ok & near])
    step = torch.ldexp(torch.ones(m, 1), rows[:, None] - 6 - 9)  # a subnormal step, scaled
    far = ok & ~near
    assert ((got - ref).abs() <= step / 2)[far].all()
    assert far.any() or k < 64


def test_fp8_weight_decode_and_exactness_check() -> None:
    from torq.kernels.launch import dequantize_weight_fp8

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 100, generator=gen) * 0.1
    w[5, :32] *= 1e-3  # a 2**10 spread: still exact
    weight = MXFP4Weight.from_float(w)
    assert weight.fp8_exact
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), 100)
    values, scale = dequantize_weight_fp8(dev_weight, block=(16, 64))
    assert torch.equal((values.float() * scale.T).cpu()[:, :100], weight.dequantize())
    assert torch.equal(values.float().cpu()[:, 100:], torch.zeros(40, 28))
    w[7, 32:64] *= 1e-6  # a 2**20 spread: E4M3 cannot hold row 7 with one row scale
    assert not MXFP4Weight.from_float(w).fp8_exact
    assert MXFP4Weight(weight.codes, weight.scales, 100).fp8_rows()[2]  # derived lazily


FP8_RTOL = 4e-3 if DEVICE == "cuda" else FP32_ACCUMULATION_RTOL  # bf16 output on CUDA


@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 32), (5, 48, 100), (37, 64, 224)])
@pytest.mark.parametrize("with_transform", [False, True])
def test_fp8_prefill_matches_reference(m: int, n: int, k: int, with_transform: bool) -> None:
    """The FP8 path against the fake-quant reference: exact products, so float32 accuracy
    in the interpreter and the bf16 output's rounding on a GPU."""
    gen = torch.Generator().manual_seed(m * n + k)
    weight = MXFP4Weight.from_float(torch.randn(n, k, generator=gen) * 0.05)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen) * 3
    t = _signed_permutation(gen) if with_transform and k % 32 == 0 else None
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), k)
    cfg = KernelConfig(2, 0, 64, kind="fp8_gemm", w_tile=(16, 64))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    y = mxfp4_linear(
        x.to(DEVICE, dtype),
        dev_weight,
        bias.to(DEVICE),
        None if t is None else t.to(DEVICE),
        backend="triton",
        config=cfg,
    )
    assert y.dtype == dtype and not torch.isnan(y).any()
    ref = reference_linear(x.to(dtype).float(), weight, bias, t)
    assert _rel_err(y.float().cpu(), ref) < FP8_RTOL


def test_fp8_prefill_refuses_and_falls_back() -> None:
    """An explicit FP8 launch on a weight it cannot hold exactly is refused; the automatic
    prefill choice falls back to the bf16 path and stays exact."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(32, 64, generator=gen)
    w[3, 32:] *= 1e-7
    weight = MXFP4Weight.from_float(w)
    dev_weight = MXFP4Weight(weight.codes.to(DEVICE), weight.scales.to(DEVICE), 64)
    x = torch.randn(300, 64, generator=gen)
    with pytest.raises(ValueError, match="fp8_gemm cannot run here"):
        mxfp4_linear(
            x.to(DEVICE),
            dev_weight,
            backend="triton",
            config=KernelConfig(4, 0, 64, kind="fp8_gemm"),
        )
    y = mxfp4_linear(x.to(DEVICE), dev_weight, backend="triton")  # 300 tokens: prefill
    assert _rel_err(y.cpu(), reference_linear(x, weight)) < FP32_ACCUMULATION_RTOL
    odd = MXFP4Weight.from_float(torch.randn(40, 64, generator=gen))
    from torq.kernels.dispatch import fp8_prefill_usable

    assert "divisible by 16" in str(fp8_prefill_usable(x.to(DEVICE), odd))


def test_packed_layer_refreshes_fp8_rows_on_load() -> None:
    """The FP8 row shifts are derived, not saved: loading another layer's weights must
    recompute them (stale shifts would scale rows wrongly)."""
    gen = torch.Generator().manual_seed(8)
    a = PackedMXFP4Linear.from_linear(nn.Linear(64, 32, bias=False))
    b_lin = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        b_lin.weight.mul_(1e3 * torch.rand(32, 1, generator=gen))
    b = PackedMXFP4Linear.from_linear(b_lin)
    assert not torch.equal(a.fp8_row_exponents, b.fp8_row_exponents)
    b.load_state_dict(a.state_dict())
    assert "fp8_row_exponents" not in a.state_dict()
    assert torch.equal(b.fp8_row_exponents, a.fp8_row_exponents) and b.fp8_exact


def test_default_launch_per_token_count() -> None:
    """1 token: the integer GEMV; 2–4: its multi-token form; more: the tensor-core and
    prefill paths."""
    from torq.kernels.config import default_config

    picks = {m: default_config(m, 4096, 4096, False) for m in (1, 2, 3, 4, 5, 300)}
    assert (picks[1].kind, picks[1].block_m) == ("gemv_i8", 1)
    assert (picks[2].kind, picks[2].block_m) == ("gemv_i8", 2)
    assert (picks[3].block_m, picks[4].block_m) == (4, 4)
    assert picks[5].kind == "dot"
    assert picks[300].kind == "fp8_gemm"
    assert picks[300].block_k == 4096  # one activation tile per row
    assert default_config(300, 4096, 14336, False).block_k == 16384
    assert default_config(300, 64, 100, False).block_k == 128
    assert default_config(300, 64, 40000, False).block_k == 16384  # two passes over K
