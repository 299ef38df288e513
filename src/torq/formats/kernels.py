"""Fast MXFP4 fake quantization for float32 on CPU, in pure torch.

Same results as :func:`torq.formats.reference.fake_quantize_reference`, bit for bit
(the tests hold it to that), from far fewer passes over memory:

* The scales are powers of two, so the shared exponent comes straight from the
  float32 bits of each block's amax (an integer max over ``|x|`` bits, where NaN and
  Inf sort above every finite value).
* Rounding to E2M1 happens at the value's own scale, without dividing by the block
  scale: ``(a + M) - M`` rounds ``a`` to nearest-even on a multiple of ``ulp(M)``, and
  with ``M = 2**(22 + max(e(a), e(X)))`` that ulp is the E2M1 grid step ``2**(e - 1)``
  times the scale, the subnormal range (step ``X / 2``) included.
* Saturation at ``6X`` is one ``minimum`` before rounding; a NaN cap turns a block
  holding NaN/Inf into NaN; the sign is or-ed back at the end, which keeps -0.
* Rows are processed in chunks that stay in cache, with reused scratch buffers, so
  each pass costs cache rather than DRAM bandwidth.

``M`` overflows for blocks whose amax exceeds 2**106; those few blocks are redone by
the reference.
"""

from __future__ import annotations

import torch

from torq.formats.config import FormatSpec
from torq.formats.constants import (
    E2M1_EMAX,
    F32_ABS_MASK,
    F32_EXP_MASK,
    F32_MANTISSA_BITS,
    F32_SIGN_MASK,
)
from torq.formats.reference import mx_quantize_blocks, mx_scale_values

# Elements per chunk: two int32 scratch buffers of this size stay in L2/L3.
CHUNK_ELEMENTS = 1 << 18

_MANTISSA_MASK = (1 << F32_MANTISSA_BITS) - 1
_HALF_MANTISSA = 1 << (F32_MANTISSA_BITS - 1)  # significand 1.5: E2M1's max is 1.5 * 2**2
_QUIET_NAN = 0x7FC00000
# (a + 2**(22 + k)) - 2**(22 + k) rounds a to a multiple of 2**(k - 1).
_MAGIC_SHIFT = (F32_MANTISSA_BITS - 1) << F32_MANTISSA_BITS
# Largest biased block exponent whose magic number 2**(22 + e) is still finite.
_MAX_FAST_EXPONENT = 254 - (F32_MANTISSA_BITS - 1)
_ONE_BINADE = 1 << F32_MANTISSA_BITS
_THREE_QUARTER_MANTISSA = 3 << (F32_MANTISSA_BITS - 2)  # significand 1.75


def _scale_fields(amax_bits: torch.Tensor, scale_mode: str) -> torch.Tensor:
    """Biased exponent of each block scale X, shifted into the float32 exponent field.

    Integer form of :func:`torq.formats.reference.mx_scale_exponent`; a subnormal or
    zero amax has field 0, so the clamp at 0 is the E8M0 floor 2**-127.
    """
    field = amax_bits & F32_EXP_MASK
    if scale_mode == "paper":
        return field
    shifted = field - E2M1_EMAX * _ONE_BINADE
    if scale_mode == "rceil":
        above_max_significand = (amax_bits & _MANTISSA_MASK) > _HALF_MANTISSA
        shifted = shifted + above_max_significand.to(torch.int32) * _ONE_BINADE
    elif scale_mode == "nearest":
        nearer_eight = (amax_bits & _MANTISSA_MASK) >= _THREE_QUARTER_MANTISSA
        shifted = shifted + nearer_eight.to(torch.int32) * _ONE_BINADE
    return shifted.clamp_(min=0)


def _saturation_caps(amax_bits: torch.Tensor, scale_fields: torch.Tensor) -> torch.Tensor:
    """``6X`` per block as float32 bits (1.5 * 2**(e + 2)), NaN for non-finite blocks."""
    capped = scale_fields.clamp(max=254 * _ONE_BINADE - E2M1_EMAX * _ONE_BINADE)
    six_x = (capped + E2M1_EMAX * _ONE_BINADE) | _HALF_MANTISSA
    return torch.where(amax_bits >= F32_EXP_MASK, _QUIET_NAN, six_x)


def check_fast_path_tensors(
    x: torch.Tensor, out: torch.Tensor | None, block_size: int
) -> torch.Tensor:
    """Validate the operands of a fast path and return ``out`` (new if ``None``).

    Both must be contiguous float32 CPU tensors of the same size, a multiple of the
    block size, and ``out`` must not be ``x``.
    """
    for name, t in (("x", x), ("out", out)):
        if t is not None and (
            t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"
        ):
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    if x.numel() % block_size:
        raise ValueError(f"size {x.numel()} is not a multiple of the block size {block_size}")
    if out is None:
        return torch.empty_like(x)
    if out.numel() != x.numel() or (x.numel() and out.data_ptr() == x.data_ptr()):
        raise ValueError("out must be a separate tensor with as many elements as x")
    return out


def mxfp4_fake_quantize_chunked(
    x: torch.Tensor, fmt: FormatSpec, out: torch.Tensor | None = None
) -> torch.Tensor:
    """MXFP4 quantize-dequantize (paper eq. 1, OCP rule per ``fmt.scale_mode``) of a
    contiguous float32 CPU tensor whose size is a multiple of the block size, in
    blocks of ``fmt.block_size`` consecutive elements. Writes into ``out`` if given.
    """
    out = check_fast_path_tensors(x, out, fmt.block_size)
    block = fmt.block_size
    n = x.numel()
    if n == 0:
        return out
    x_bits = x.view(-1).view(torch.int32)
    out_bits = out.view(-1).view(torch.int32)
    chunk = max(block, CHUNK_ELEMENTS // block * block)
    magnitude_buf = torch.empty(min(chunk, n), dtype=torch.int32)
    work_buf = torch.empty_like(magnitude_buf)
    amax_fields = torch.empty(n // block, 1, dtype=torch.int32)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        length = stop - start
        xi = x_bits[start:stop]
        magnitude = torch.bitwise_and(xi, F32_ABS_MASK, out=magnitude_buf[:length])
        magnitude = magnitude.view(-1, block)
        amax_bits = magnitude.amax(dim=-1, keepdim=True)
        torch.bitwise_and(amax_bits, F32_EXP_MASK, out=amax_fields[start // block : stop // block])
        fields = _scale_fields(amax_bits, fmt.scale_mode)
        caps = _saturation_caps(amax_bits, fields)
        magnitude_f = magnitude.view(torch.float32)
        torch.minimum(magnitude_f, caps.view(torch.float32), out=magnitude_f)
        magic = torch.bitwise_and(magnitude, F32_EXP_MASK, out=work_buf[:length].view(-1, block))
        torch.maximum(magic, fields, out=magic).add_(_MAGIC_SHIFT)
        magic_f = magic.view(torch.float32)
        magnitude_f.add_(magic_f).sub_(magic_f)
        sign = torch.bitwise_and(xi, F32_SIGN_MASK, out=work_buf[:length])
        torch.bitwise_or(magnitude.view(-1), sign, out=out_bits[start:stop])
    _redo_huge_blocks(x, out, amax_fields, fmt)
    return out


def _redo_huge_blocks(
    x: torch.Tensor, out: torch.Tensor, amax_fields: torch.Tensor, fmt: FormatSpec
) -> None:
    """Recompute with the reference the blocks whose magic number would overflow."""
    huge = (amax_fields > _MAX_FAST_EXPONENT << F32_MANTISSA_BITS) & (amax_fields < F32_EXP_MASK)
    if not bool(huge.any()):
        return
    index = huge.view(-1).nonzero().view(-1)
    blocks = x.view(-1, fmt.block_size)[index].unsqueeze(0)
    mx = mx_quantize_blocks(blocks, fmt)
    values = mx.q * mx_scale_values(mx.exponent, mx.is_nan, torch.float32)
    out.view(-1, fmt.block_size)[index] = values.squeeze(0)
