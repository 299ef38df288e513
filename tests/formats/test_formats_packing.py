"""Bit-level encodings and nibble packing."""

from __future__ import annotations

import math

import pytest
import torch

import torq.formats as tf
from torq.formats.packing import (
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    decode_int4,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0,
    encode_int4,
    exact_pow2,
    pack_nibbles,
    unpack_nibbles,
)


def test_nibble_order_low_first() -> None:
    codes = torch.tensor([[0x1, 0x2, 0xA, 0xF]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0xFA]]


def test_pack_unpack_round_trip() -> None:
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(every_byte)), every_byte)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_nibbles(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        unpack_nibbles(torch.zeros(4, dtype=torch.int8))


def test_e2m1_codes_are_the_ocp_encoding() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert values[:8].tolist() == expected
    assert values[8:].tolist() == [-v for v in expected]
    assert math.copysign(1.0, values[8].item()) == -1.0  # code 8 is -0
    assert torch.equal(encode_e2m1(values), codes)
    assert torch.equal(encode_e2m1(values.double()), codes)
    assert encode_e2m1(torch.tensor([float("nan")])).item() == 0


def test_int4_codes_are_twos_complement() -> None:
    k = torch.arange(-8, 8)
    codes = encode_int4(k / 4)
    assert codes.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.equal(decode_int4(codes), k.float() / 4)


def test_e8m0_bytes() -> None:
    exponent = torch.tensor([-127, -1, 0, 1, 127, 5])
    is_nan = torch.tensor([False, False, False, False, False, True])
    scale_bytes = encode_e8m0(exponent, is_nan)
    assert scale_bytes.tolist() == [0, 126, 127, 128, 254, 255]
    scales = decode_e8m0(scale_bytes)
    assert scales[:5].tolist() == [math.ldexp(1.0, e) for e in (-127, -1, 0, 1, 127)]
    assert math.isnan(scales[5].item())
    assert decode_e8m0(scale_bytes, torch.float64)[0].item() == 2.0**-127


def test_exact_pow2_over_the_whole_range() -> None:
    e32 = torch.arange(-149, 128)
    assert exact_pow2(e32, torch.float32).tolist() == [math.ldexp(1.0, int(e)) for e in e32]
    e64 = torch.arange(-1022, 1024)
    assert exact_pow2(e64, torch.float64).tolist() == [math.ldexp(1.0, int(e)) for e in e64]
    with pytest.raises(TypeError):
        exact_pow2(e32, torch.float16)


def test_e4m3_bytes_round_trip() -> None:
    every_byte = torch.arange(256, dtype=torch.uint8)
    values = decode_e4m3(every_byte)
    assert values[0x38].item() == 1.0 and values[0x7E].item() == 448.0
    assert torch.isnan(values[[0x7F, 0xFF]]).all()
    finite = ~torch.isnan(values)
    again = encode_e4m3(values[finite].to(torch.float8_e4m3fn))
    assert torch.equal(again, every_byte[finite])


@pytest.mark.parametrize("name", tf.FORMAT_NAMES)
def test_packed_layout(name: str) -> None:
    spec = tf.get_format(name)
    x = torch.randn(2, 3, 50)
    p = tf.quantize(x, spec)
    n_blocks = math.ceil(50 / spec.block_size)
    assert p.shape == (2, 3, 50)
    assert p.codes.shape == (2, 3, n_blocks * spec.block_size // 2)
    assert p.scales.shape == (2, 3, n_blocks)
    assert p.codes.dtype == p.scales.dtype == torch.uint8
    assert (p.tensor_scale is not None) == (name == "nvfp4")
    padding = unpack_nibbles(p.codes)[..., 50:]
    assert torch.all(padding == 0)


def test_packed_codes_decode_to_the_fake_quantized_values() -> None:
    x = torch.randn(4, 64)
    p = tf.quantize(x, "mxfp4")
    values = decode_e2m1(unpack_nibbles(p.codes)).view(4, 2, 32)
    scales = decode_e8m0(p.scales).unsqueeze(-1)
    assert torch.equal((values * scales).view(4, 64), tf.fake_quantize(x, "mxfp4"))


def test_nvfp4_weights_pack_again_exactly_from_their_tensor_scale() -> None:
    """``encode_nvfp4_exact``: a weight on NVFP4's grid, by rounding (the same codes and scales
    as packing the original) or by GPTQ (blocks whose largest code is not 6), packs again
    from its tensor scale alone and unpacks to itself bit for bit, where quantizing it again
    (what torq did before) need not; a wrong tensor scale or a value off the grid gives
    ``None``."""
    from torq.formats.config import get_format
    from torq.formats.packed import dequantize, encode_nvfp4_exact, quantize
    from torq.surgery.gptq import gptq_quantize
    from torq.surgery.qlinear import nvfp4_weight_tensor_scale

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * torch.exp(torch.randn(1, 256, generator=gen))
    w[3, 7] = 40.0
    w[5, :16] = 1e-9  # a block far below the tensor's scale: its E4M3 scale clamps
    w[6, 16:32] = 0.0
    g = nvfp4_weight_tensor_scale(w)
    rtn = tf.fake_quantize(w, "nvfp4")
    p = encode_nvfp4_exact(rtn, g)
    assert p is not None and torch.equal(dequantize(p), rtn)
    ref = quantize(w, "nvfp4")
    assert torch.equal(p.codes, ref.codes) and torch.equal(p.scales, ref.scales)
    x = torch.randn(512, 256, generator=gen)
    gptq, _ = gptq_quantize(w, x.T @ x, get_format("nvfp4"))
    p = encode_nvfp4_exact(gptq, g)
    assert p is not None and torch.equal(dequantize(p), gptq)
    blocks = dequantize(p).reshape(64, 16, 16)
    codes_max = (blocks.abs() / (p.tensor_scale * decode_e4m3(p.scales))[..., None]).amax(-1)
    assert bool((codes_max < 6).any())  # GPTQ left blocks whose largest code is below 6
    # the tensor's largest value moved from code 6 to 4 under the same scale (as GPTQ may
    # leave it): re-quantizing takes another tensor scale and changes the weight; the
    # tensor scale kept packs it exactly
    moved = rtn.clone()
    moved[3, 7] = moved[3, 7] * (4.0 / 6.0)
    assert not torch.equal(dequantize(quantize(moved, "nvfp4")), moved)
    p = encode_nvfp4_exact(moved, g)
    assert p is not None and torch.equal(dequantize(p), moved)
    assert encode_nvfp4_exact(gptq, g * 1.001) is None
    off = gptq.clone()
    off[0, 0] = off[0, 0] * 1.01 + 1e-3
    assert encode_nvfp4_exact(off, g) is None
