"""Bit-exact agreement with torchao's MXFP4 (FLOOR scale mode) and NVFP4, and the three
documented places where torq departs from torchao: MXFP4 blocks with the smallest scale
2**-127 and blocks holding +-Inf (torq follows the OCP rule), and NVFP4 tensors whose
amax / 2688 underflows (torq floors the tensor scale instead of dividing by zero)."""

from __future__ import annotations

import logging

import pytest
import torch

import torq.formats as tf
from tests.formats.formats_testing import (
    assert_bits_equal,
    brute_force_e2m1,
    edge_blocks,
    non_finite_blocks,
    random_activations,
)
from torq.formats.constants import NVFP4_MIN_TENSOR_SCALE, NVFP4_TENSOR_SCALE_DIVISOR

pytest.importorskip("torchao.prototype.mx_formats")
logging.getLogger("torchao").setLevel(logging.ERROR)

from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (  # noqa: E402
    NVFP4Tensor,
    per_tensor_amax_to_scale,
)

FP4 = torch.float4_e2m1fn_x2
RANDOM = random_activations(rows=256, width=768, seed=0)  # 6 x 196,608 = 1.18M values
# Below this tensor amax, amax / (448 * 6) is under 2**-121 and torq floors the scale.
NVFP4_SMALLEST_EXACT_AMAX = NVFP4_TENSOR_SCALE_DIVISOR * NVFP4_MIN_TENSOR_SCALE


def torchao_mxfp4(
    x: torch.Tensor, mode: ScaleCalculationMode = ScaleCalculationMode.FLOOR
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's quantize-dequantize, scale bytes and packed codes."""
    scale, data = to_mx(x, FP4, 32, mode)
    values = to_dtype(data, scale, FP4, 32, x.dtype)
    return values, scale.view(torch.uint8), data.view(torch.uint8)


def torchao_nvfp4(
    x: torch.Tensor, floor_tensor_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's NVFP4 with a per-tensor scale from the tensor's own amax, optionally
    floored at 2**-121 as torq does."""
    tensor_scale = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    if floor_tensor_scale:
        tensor_scale = tensor_scale.clamp(min=NVFP4_MIN_TENSOR_SCALE)
    nv = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=tensor_scale)
    return (
        nv.dequantize(x.dtype),
        nv.scale.view(torch.uint8),
        nv.qdata.view(torch.uint8),
        tensor_scale,
    )


def test_random_data_has_a_million_values() -> None:
    assert sum(x.numel() for x in RANDOM.values()) >= 1_000_000


@pytest.mark.parametrize("dist", sorted(RANDOM))
def test_mxfp4_matches_torchao_on_random_data(dist: str) -> None:
    x = RANDOM[dist]
    values, scale_bytes, codes = torchao_mxfp4(x)
    assert_bits_equal(tf.fake_quantize(x, "mxfp4"), values)
    packed = tf.quantize(x, "mxfp4")
    assert torch.equal(packed.scales, scale_bytes)
    assert torch.equal(packed.codes, codes)
    assert_bits_equal(tf.dequantize(packed), values)


@pytest.mark.parametrize("dist", ["normal", "cauchy", "mixed_exponents"])
def test_mxfp4_bfloat16_matches_torchao(dist: str) -> None:
    x = RANDOM[dist][:64].bfloat16()
    values, scale_bytes, _ = torchao_mxfp4(x)
    assert_bits_equal(tf.fake_quantize(x, "mxfp4"), values)
    assert torch.equal(tf.quantize(x, "mxfp4").scales, scale_bytes)


@pytest.mark.parametrize("dist", ["normal", "student_t3", "mixed_exponents"])
def test_mxfp4_rceil_matches_torchao_rceil_on_random_data(dist: str) -> None:
    x = RANDOM[dist][:64]
    values, scale_bytes, codes = torchao_mxfp4(x, ScaleCalculationMode.RCEIL)
    spec = tf.get_format("mxfp4", "rceil")
    assert_bits_equal(tf.fake_quantize(x, spec), values)
    packed = tf.quantize(x, spec)
    assert torch.equal(packed.scales, scale_bytes)
    assert torch.equal(packed.codes, codes)


@pytest.mark.parametrize("dist", sorted(RANDOM))
def test_nvfp4_matches_torchao_on_random_data(dist: str) -> None:
    x = RANDOM[dist]
    values, scale_bytes, codes, tensor_scale = torchao_nvfp4(x)
    assert_bits_equal(tf.fake_quantize(x, "nvfp4"), values)
    packed = tf.quantize(x, "nvfp4")
    assert torch.equal(packed.scales, scale_bytes)
    assert torch.equal(packed.codes, codes)
    assert packed.tensor_scale is not None
    assert_bits_equal(packed.tensor_scale, tensor_scale)
    assert_bits_equal(tf.dequantize(packed), values)


def test_nvfp4_bfloat16_matches_torchao() -> None:
    x = RANDOM["student_t3"][:64].bfloat16()
    values, scale_bytes, codes, _ = torchao_nvfp4(x)
    assert_bits_equal(tf.fake_quantize(x, "nvfp4"), values)
    packed = tf.quantize(x, "nvfp4")
    assert torch.equal(packed.scales, scale_bytes)
    assert torch.equal(packed.codes, codes)


def _smallest_scale_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows (one block each) with E8M0 byte 0 that hold a non-zero value."""
    amax = x.abs().amax(dim=-1)
    return (amax > 0) & (amax < 2.0**-124)


def test_mxfp4_edge_cases_match_torchao() -> None:
    """Zeros, -0, ties, saturation, the E8M0 top end, tiny and subnormal values."""
    x = edge_blocks(32)
    keep = ~_smallest_scale_rows(x)
    values, scale_bytes, codes = torchao_mxfp4(x)
    packed = tf.quantize(x, "mxfp4")
    assert_bits_equal(tf.fake_quantize(x, "mxfp4")[keep], values[keep])
    assert_bits_equal(tf.dequantize(packed)[keep], values[keep])
    assert torch.equal(packed.scales, scale_bytes)
    assert torch.equal(packed.codes[keep], codes[keep])


def test_mxfp4_ties_round_to_even_codes() -> None:
    x = edge_blocks(32)[2:4]  # amax 4, so X = 1 and the values are midpoints
    expected = torch.tensor([4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    y = tf.fake_quantize(x, "mxfp4")
    assert_bits_equal(y[0, :8], expected)
    assert_bits_equal(y[1, :8], -expected)
    assert_bits_equal(y, torchao_mxfp4(x)[0])


def test_mxfp4_smallest_scale_follows_ocp_not_torchao() -> None:
    """Deviation 1: blocks with amax < 2**-124 (E8M0 byte 0, scale 2**-127).

    torchao divides such a block by 2**-126 (its scale is clamped to the smallest
    normal float32, a workaround for Triton) but multiplies back by 2**-127, so it
    returns half the OCP result: Q(x * 2**126) * 2**-127. torq divides by the scale
    the byte encodes: Q(x * 2**127) * 2**-127. Both store byte 0.
    """
    x = edge_blocks(32)
    rows = _smallest_scale_rows(x)
    assert int(rows.sum()) >= 3
    tiny = x[rows].double()
    values, scale_bytes, _ = torchao_mxfp4(x)
    ours = tf.fake_quantize(x, "mxfp4")
    ocp = brute_force_e2m1(tiny * 2.0**127) * 2.0**-127
    torchao_rule = brute_force_e2m1(tiny * 2.0**126) * 2.0**-127
    assert_bits_equal(ours[rows], ocp.float())
    assert_bits_equal(values[rows], torchao_rule.float())
    assert not torch.equal(ours[rows], values[rows])
    assert torch.all(scale_bytes[rows] == 0)
    assert torch.all(tf.quantize(x, "mxfp4").scales[rows] == 0)


def test_mxfp4_non_finite_blocks() -> None:
    """NaN: identical to torchao (scale byte 0xFF, whole block NaN); torq stores code 0.

    Deviation 2, +-Inf: the OCP/method-notes rule makes the block scale NaN, so torq
    returns a NaN block with byte 0xFF. torchao reads the scale from Inf's exponent
    field (byte 253 = 2**126), keeps the Inf and flushes the rest of the block to 0.
    """
    x = non_finite_blocks(32)
    values, scale_bytes, _ = torchao_mxfp4(x)
    ours = tf.fake_quantize(x, "mxfp4")
    packed = tf.quantize(x, "mxfp4")
    assert torch.isnan(ours).all()
    assert torch.equal(packed.scales, torch.full((3, 1), 0xFF, dtype=torch.uint8))
    assert torch.all(packed.codes == 0)
    assert_bits_equal(ours[0], values[0])
    assert scale_bytes.view(-1).tolist() == [0xFF, 253, 253]
    assert values[1, 0] == float("inf") and values[2, 0] == float("-inf")
    assert torch.all(values[1:, 1:] == 0)


def test_nvfp4_edge_cases_match_torchao() -> None:
    x = edge_blocks(16)
    values, scale_bytes, codes, _ = torchao_nvfp4(x)
    packed = tf.quantize(x, "nvfp4")
    assert_bits_equal(tf.fake_quantize(x, "nvfp4"), values)
    assert torch.equal(packed.scales, scale_bytes)
    assert torch.equal(packed.codes, codes)


@pytest.mark.parametrize("row", range(len(edge_blocks(16))))
def test_nvfp4_edge_blocks_as_their_own_tensor_match_torchao(row: int) -> None:
    """Each edge block alone, so its amax sets the tensor scale too. For the tiny
    blocks torchao is handed torq's floored tensor scale (see the all-zero test)."""
    x = edge_blocks(16)[row : row + 1]
    values, scale_bytes, codes, tensor_scale = torchao_nvfp4(x, floor_tensor_scale=True)
    packed = tf.quantize(x, "nvfp4")
    assert_bits_equal(tf.fake_quantize(x, "nvfp4"), values)
    assert torch.equal(packed.scales, scale_bytes)
    assert torch.equal(packed.codes, codes)
    assert packed.tensor_scale is not None
    assert_bits_equal(packed.tensor_scale, tensor_scale)
    if x.abs().amax() >= NVFP4_SMALLEST_EXACT_AMAX:
        assert_bits_equal(tf.fake_quantize(x, "nvfp4"), torchao_nvfp4(x)[0])


def test_nvfp4_all_zero_tensor() -> None:
    """Deviation 3: torchao divides by a zero tensor scale and returns NaN; torq
    floors the tensor scale at 2**-121 and returns zeros (with -0 kept)."""
    x = torch.zeros(2, 32)
    x[1, 3] = -0.0
    values, *_ = torchao_nvfp4(x)
    assert torch.isnan(values).all()
    ours = tf.fake_quantize(x, "nvfp4")
    assert_bits_equal(ours, x)
    packed = tf.quantize(x, "nvfp4")
    assert packed.tensor_scale is not None and packed.tensor_scale.item() == NVFP4_MIN_TENSOR_SCALE


@pytest.mark.parametrize("row", range(3))
def test_nvfp4_non_finite_tensor_is_all_nan_like_torchao(row: int) -> None:
    x = torch.cat([torch.randn(3, 32), non_finite_blocks(32)[row : row + 1]])
    values, *_ = torchao_nvfp4(x)
    ours = tf.fake_quantize(x, "nvfp4")
    assert torch.isnan(ours).all()
    assert_bits_equal(ours, values)
    packed = tf.quantize(x, "nvfp4")
    assert packed.tensor_scale is not None and torch.isnan(packed.tensor_scale)
    assert torch.all(packed.codes == 0)
    assert torch.isnan(tf.dequantize(packed)).all()


@pytest.mark.slow
def test_mxfp4_and_nvfp4_match_torchao_on_ten_million_values() -> None:
    """Issue 30: bit for bit against torchao on more than 10⁷ values of every distribution
    above (a second seed, 2048 × 1024 each: 12.6M values), a slab of rows at a time, plus
    the edge blocks torchao and torq treat alike."""
    big = random_activations(rows=2048, width=1024, seed=1)
    assert sum(x.numel() for x in big.values()) >= 10_000_000
    for dist, x in big.items():
        for rows in torch.split(x, 256):
            values, scale_bytes, codes = torchao_mxfp4(rows)
            packed = tf.quantize(rows, "mxfp4")
            assert torch.equal(packed.scales, scale_bytes), dist
            assert torch.equal(packed.codes, codes), dist
            assert_bits_equal(tf.fake_quantize(rows, "mxfp4"), values)
            if float(rows.abs().max()) >= NVFP4_SMALLEST_EXACT_AMAX:
                nv_values, _, _, _ = torchao_nvfp4(rows)
                assert_bits_equal(tf.fake_quantize(rows, "nvfp4"), nv_values)
    edges = edge_blocks(32)
    keep = ~_smallest_scale_rows(edges)
    values, _, _ = torchao_mxfp4(edges)
    assert_bits_equal(tf.fake_quantize(edges, "mxfp4")[keep], values[keep])


@pytest.mark.parametrize("dist", sorted(RANDOM))
def test_mxfp8_matches_torchao_floor_bit_for_bit(dist: str) -> None:
    """MXFP8 (the precision budget's 8-bit format): torq's OCP rule and E4M3 rounding give
    torchao's FLOOR mode values, scale bytes and element bytes, on random activations with
    blocks of every binade; the rows with a block at the smallest scale (E8M0 byte 0) left
    out, where torchao departs from OCP as for MXFP4 (below)."""
    x = RANDOM[dist]
    x = x[~(tf.quantize(x, "mxfp8").scales == 0).any(dim=1)]
    assert x.shape[0] >= 128
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    values = to_dtype(data, scale, torch.float8_e4m3fn, 32, x.dtype)
    packed = tf.quantize(x, "mxfp8")
    assert_bits_equal(tf.fake_quantize(x, "mxfp8"), values)
    assert torch.equal(packed.scales, scale.view(torch.uint8).reshape(packed.scales.shape))
    assert torch.equal(packed.codes, data.view(torch.uint8).reshape(packed.codes.shape))
