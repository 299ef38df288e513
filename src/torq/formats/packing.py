"""Bit-level representations: 4-bit element codes, scale bytes, nibble packing.

Layouts (all pure torch, on the device of the input):

* E2M1 code (OCP MX v1.0, section 5.3.3): bit 3 is the sign, bits 0-2 index the
  magnitude in ``E2M1_VALUES`` = {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.
* INT4 code (MXINT4): the two's complement nibble of ``k``, standing for ``k / 4``.
* E8M0 byte (OCP MX v1.0, section 5.4.1): unbiased exponent + 127; 0xFF is NaN.
* E4M3 byte (NVFP4 block scale): the bits of ``torch.float8_e4m3fn``.
* Packing: two codes per byte, element ``2i`` in the LOW nibble and element ``2i + 1``
  in the HIGH nibble (the order torchao's ``pack_uint4`` uses).
"""

from __future__ import annotations

import torch

from torq.formats.constants import (
    E2M1_EMAX,
    E2M1_EMIN,
    E2M1_MANTISSA_BITS,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    E8M0_BIAS,
    E8M0_NAN,
    F32_EXP_BIAS,
    F32_MANTISSA_BITS,
    F32_MIN_NORMAL_EXP,
    F32_MIN_SUBNORMAL_EXP,
    F64_EXP_BIAS,
    F64_MANTISSA_BITS,
    INT4_FRACTION_BITS,
)


def exact_pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**exponent`` built from its IEEE bits, so it is exact on every device.

    ``exponent`` is an integer tensor in [-149, 127] for float32 (2**-127 is a float32
    subnormal, which E8M0's smallest scale needs) and in [-1022, 1023] for float64.
    Library ``pow``/``exp2`` are not guaranteed exact, least of all for subnormals.
    """
    if dtype == torch.float64:
        biased = exponent.to(torch.int64) + F64_EXP_BIAS
        return torch.bitwise_left_shift(biased, F64_MANTISSA_BITS).view(torch.float64)
    if dtype != torch.float32:
        raise TypeError(f"exact_pow2 builds float32 or float64, not {dtype}")
    e = exponent.to(torch.int32)
    normal = torch.bitwise_left_shift(e + F32_EXP_BIAS, F32_MANTISSA_BITS)
    subnormal = torch.bitwise_left_shift(
        torch.ones_like(e), (e - F32_MIN_SUBNORMAL_EXP).clamp(0, F32_MANTISSA_BITS - 1)
    )
    return torch.where(e >= F32_MIN_NORMAL_EXP, normal, subnormal).view(torch.float32)


def floor_log2(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(floor(log2 a), a / 2**floor(log2 a))`` for finite ``a > 0``, exactly.

    Uses ``frexp`` (exact, subnormals included) rather than ``log2``, whose rounding
    can cross an integer.
    """
    mantissa, exponent = torch.frexp(a)
    return exponent - 1, mantissa * 2


def e2m1_binade_step(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For magnitudes ``a`` in [0, 6]: the E2M1 binade (0, 1 or 2, with everything
    below 1 in binade 0, as the subnormals share the first binade's step) and the grid
    step there, ``2**(binade - 1)``, in ``a``'s dtype."""
    log2_floor, _ = floor_log2(a)
    binade = log2_floor.clamp(E2M1_EMIN, E2M1_EMAX) - E2M1_EMIN
    power = torch.bitwise_left_shift(torch.ones_like(binade), binade)
    return binade, power.to(a.dtype) * 2.0 ** (E2M1_EMIN - E2M1_MANTISSA_BITS)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``uint8 [..., 2n]`` into bytes ``uint8 [..., n]``.

    Element ``2i`` goes to the low nibble and element ``2i + 1`` to the high nibble.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack, got {codes.shape[-1]}")
    low = codes[..., 0::2]
    high = codes[..., 1::2]
    return torch.bitwise_or(low & 0x0F, torch.bitwise_left_shift(high & 0x0F, 4))


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``uint8 [..., n]`` to codes ``uint8 [..., 2n]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = torch.bitwise_right_shift(packed, 4)
    return torch.stack((low, high), dim=-1).flatten(-2)


def encode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of values already on the E2M1 grid (signed, -0 kept); NaN gives 0.

    The magnitude index is ``binade * 2**mantissa_bits + |q| / step``: the exponent
    field and the mantissa bit side by side, the subnormal 0.5 included. A NaN element
    only occurs in a block whose scale is NaN, which already carries the NaN, so its
    code is 0.
    """
    magnitude = q.abs()
    binade, step = e2m1_binade_step(magnitude)
    index = (magnitude / step).to(torch.int32) + binade * (1 << E2M1_MANTISSA_BITS)
    code = torch.where(torch.signbit(q), index + E2M1_SIGN_BIT, index)
    code = torch.where(torch.isnan(q), 0, code)
    return code.to(torch.uint8)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 element values (in units of the block scale) of 4-bit codes."""
    magnitudes = torch.tensor(E2M1_VALUES, device=codes.device, dtype=dtype)
    table = torch.cat((magnitudes, -magnitudes))
    return table[codes.long() & 0x0F]


def encode_int4(q: torch.Tensor) -> torch.Tensor:
    """Two's complement nibbles of ``k`` for values ``q = k / 4`` on the MXINT4 grid."""
    k = (q * 2**INT4_FRACTION_BITS).to(torch.int32)
    return (k & 0x0F).to(torch.uint8)


def decode_int4(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXINT4 element values ``k / 4`` (in units of the block scale) of 4-bit codes."""
    k = ((codes.to(torch.int32) & 0x0F) ^ 0x08) - 0x08
    return k.to(dtype) * 2.0**-INT4_FRACTION_BITS


def encode_e8m0(exponent: torch.Tensor, is_nan: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of unbiased exponents in [-127, 127]; ``is_nan`` blocks get 0xFF."""
    biased = exponent.to(torch.int32) + E8M0_BIAS
    return torch.where(is_nan, E8M0_NAN, biased).to(torch.uint8)


def decode_e8m0(scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The scale ``2**(byte - 127)`` of E8M0 bytes, exactly; byte 0xFF gives NaN."""
    biased = scale_bytes.to(torch.int32)
    scale = exact_pow2(biased.clamp(max=E8M0_NAN - 1) - E8M0_BIAS, dtype)
    return torch.where(biased == E8M0_NAN, torch.nan, scale)


def encode_e4m3(scale: torch.Tensor) -> torch.Tensor:
    """Bytes of FP8 E4M3 values (a ``torch.float8_e4m3fn`` tensor)."""
    return scale.view(torch.uint8)


def decode_e4m3(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Float32 values of FP8 E4M3 bytes (0x7F / 0xFF are NaN)."""
    return scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)
