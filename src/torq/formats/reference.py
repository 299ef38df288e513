"""Reference quantization math: plain, device-agnostic torch, the oracle of the fast paths.

Everything here is the definition; :mod:`torq.formats.kernels` only makes it faster.
The TORQ paper's MXFP4 model (Section 4 "Preliminary", eq. 1) is
``z_hat = s_b * Q(z_b / s_b)`` with a per-block power-of-two scale ``s_b`` and ``Q``
the round-to-nearest projection onto the E2M1 codebook. Method notes, section 1, fix
the details: the OCP scale ``X = 2^(floor(log2 amax) - 2)`` by default, ties to even,
saturation at +-6, and scales clamped to the E8M0 range.

Arithmetic runs in float32 for 16- and 32-bit inputs (exact for them, as every step
is a scaling by a power of two or a rounding onto a 3-bit grid) and in float64 for
float64 inputs, so a float64 value is never rounded twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torq.formats.config import FormatSpec
from torq.formats.constants import (
    E2M1_EMAX,
    E2M1_MAX,
    E2M1_MAX_SIGNIFICAND,
    E4M3_EMAX,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    FOUR_OVER_SIX_EXPANSION,
    INT4_EMAX,
    INT4_FRACTION_BITS,
    INT4_MAX_CODE,
    NVFP4_MIN_TENSOR_SCALE,
    NVFP4_TENSOR_SCALE_DIVISOR,
)
from torq.formats.packing import e2m1_binade_step, exact_pow2, floor_log2

# "nearest" scale rule: one binade up when amax / 2**(floor(log2 amax) - 2) >= 7
NEAREST_BUMP_SIGNIFICAND = 1.75


def check_input(x: torch.Tensor) -> None:
    """Reject what the formats do not define: non-tensors, non-float dtypes, 0-d tensors."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("a 0-d tensor has no last dimension to quantize in blocks")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the MX math runs in for inputs of ``dtype`` (see module docstring)."""
    if not dtype.is_floating_point:
        raise TypeError(f"expected a floating-point tensor, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_blocks(x: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """View ``x [..., W]`` as ``[rows, n_blocks, block_size]`` blocks along the last dim.

    A width that is not a multiple of the block size is padded with zeros, which
    leaves every block's amax unchanged; :func:`from_blocks` removes the padding.
    """
    if x.dim() == 0:
        raise ValueError("a 0-d tensor has no last dimension to block")
    width = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, width).to(dtype)
    pad = (-width) % block_size
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(rows, (width + pad) // block_size, block_size)


def from_blocks(blocks: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: drop the padding and restore ``shape``."""
    width = shape[-1]
    rows, n_blocks, block_size = blocks.shape
    flat = blocks.reshape(rows, n_blocks * block_size)
    if flat.shape[-1] != width:
        flat = flat[:, :width]
    return flat.reshape(shape)


@dataclass
class MXBlocks:
    """One MX quantization of blocks: grid values, shared exponents, NaN blocks."""

    q: torch.Tensor  # element values in units of the scale (on the element grid)
    exponent: torch.Tensor  # int32 [rows, n_blocks, 1], unbiased, in [-127, 127]
    is_nan: torch.Tensor  # bool [rows, n_blocks, 1]: block held NaN or +-Inf


def mx_scale_exponent(amax: torch.Tensor, fmt: FormatSpec) -> torch.Tensor:
    """Unbiased E8M0 exponent of each block's shared scale (method notes, section 1).

    * ``mxfp4`` ``ocp``: ``floor(log2 amax) - 2`` (OCP MX v1.0, section 6.3; emax of
      E2M1 is 2). Matches torchao's ``ScaleCalculationMode.FLOOR``.
    * ``mxfp4`` ``paper``: ``floor(log2 amax)``, the paper's eq. 1 read literally.
    * ``mxfp4`` ``rceil``: ``ceil(log2(amax / 6))``, computed exactly as
      ``floor(log2 amax) - 2 + [significand of amax > 1.5]``.
    * ``mxfp4`` ``nearest``: ``floor(log2 amax) - 2 + [significand of amax >= 1.75]``.
    * ``mxint4``: ``floor(log2 amax)`` (the INT4 grid k/4 has emax 0).
    * ``mxfp8``: ``floor(log2 amax) - 8`` (OCP MX v1.0; emax of E4M3 is 8), with
      ``nearest`` one more when amax's significand is at least 1.75.

    An all-zero block gets the smallest scale, 2**-127, and every exponent is clamped
    to the E8M0 range [-127, 127]. Non-finite ``amax`` gives an unspecified exponent;
    callers mark those blocks NaN.
    """
    log2_floor, significand = floor_log2(amax)
    if fmt.name == "mxint4":
        exponent = log2_floor - INT4_EMAX
    elif fmt.name == "mxfp8":
        # nearest: one binade up when amax's significand is at least 1.75 (amax / X would
        # saturate at 448): compressed-tensors' MXFP8 rule, as "nearest" is its MXFP4 one
        exponent = log2_floor - E4M3_EMAX
        if fmt.scale_mode == "nearest":
            exponent = exponent + (significand >= NEAREST_BUMP_SIGNIFICAND).to(torch.int32)
    elif fmt.scale_mode == "ocp":
        exponent = log2_floor - E2M1_EMAX
    elif fmt.scale_mode == "paper":
        exponent = log2_floor
    elif fmt.scale_mode == "nearest":
        bump = significand >= NEAREST_BUMP_SIGNIFICAND
        exponent = log2_floor - E2M1_EMAX + bump.to(torch.int32)
    else:
        exponent = log2_floor - E2M1_EMAX + (significand > E2M1_MAX_SIGNIFICAND).to(torch.int32)
    exponent = torch.where(amax > 0, exponent, E8M0_MIN_EXP)
    return exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Project onto the E2M1 codebook {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign.

    This is ``Q_mxFP4`` of the paper's eq. 1 with the OCP rounding: nearest, ties to
    the even code, saturating at +-6, keeping the sign of zero. Within a binade the
    grid step is constant (see :func:`torq.formats.packing.e2m1_binade_step`), so
    ``round(a / step) * step`` is exact and ``torch.round`` breaks ties to even.
    """
    a = v.abs().clamp(max=E2M1_MAX)
    _, step = e2m1_binade_step(a)
    return torch.copysign(torch.round(a / step) * step, v)


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Project onto the FP8 E4M3 grid (MXFP8's elements): nearest, ties to even, saturating
    at ±448 (OCP MX v1.0 for MXFP8), the sign of zero kept; in ``v``'s dtype."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(v.dtype)


def round_to_int4(v: torch.Tensor) -> torch.Tensor:
    """Project onto the MXINT4 grid ``k / 4``, ``k`` in [-7, 7]: nearest, ties to even.

    Zero is always +0, since two's complement has no -0 code.
    """
    steps = 2.0**INT4_FRACTION_BITS
    k = torch.round(v * steps).clamp(-INT4_MAX_CODE, INT4_MAX_CODE)
    return k / steps + 0.0


def mx_quantize_blocks(blocks: torch.Tensor, fmt: FormatSpec) -> MXBlocks:
    """Quantize MX blocks: shared exponent per block, elements on the grid.

    ``blocks`` is ``[rows, n_blocks, block_size]`` in the compute dtype. A NaN or
    +-Inf anywhere in a block makes its scale NaN, hence the whole block NaN.
    """
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    is_nan = ~torch.isfinite(amax)
    exponent = mx_scale_exponent(amax, fmt)
    inverse_scale = exact_pow2(-exponent, blocks.dtype)
    scaled = blocks * inverse_scale
    if fmt.name == "mxint4":
        q = round_to_int4(scaled)
    elif fmt.name == "mxfp8":
        q = round_to_e4m3(scaled)
    else:
        q = round_to_e2m1(scaled)
    return MXBlocks(q=q, exponent=exponent, is_nan=is_nan)


def mx_scale_values(
    exponent: torch.Tensor, is_nan: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The block scales ``2**exponent`` as floats, NaN where the block is NaN."""
    return torch.where(is_nan, torch.nan, exact_pow2(exponent, dtype))


def nvfp4_tensor_scale(tensor_amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's FP32 per-tensor scale ``amax_tensor / (448 * 6)`` (method notes, sec. 1).

    Floored at ``NVFP4_MIN_TENSOR_SCALE`` = 2**-121, the smallest scale whose element
    multiplier ``(1 / tensor_scale) / block_scale`` stays finite for the smallest
    block scale 2**-6. torchao has no floor: for an all-zero or nearly all-zero tensor
    (amax below 448 * 6 * 2**-121, about 5e-33) its multiplier overflows and it returns
    NaN; here such a tensor quantizes normally. Any NaN or Inf in the tensor makes the
    scale NaN, so every element then dequantizes to NaN, as in torchao.
    """
    amax = tensor_amax.to(torch.float32)
    scale = (amax / NVFP4_TENSOR_SCALE_DIVISOR).clamp(min=NVFP4_MIN_TENSOR_SCALE)
    return torch.where(torch.isfinite(amax), scale, torch.nan)


@dataclass
class NVFP4Blocks:
    """One NVFP4 quantization of blocks: grid values and the two-level scale."""

    q: torch.Tensor  # float32 element values in units of the block's total scale
    block_scale: torch.Tensor  # float8_e4m3fn [rows, n_blocks, 1]
    tensor_scale: torch.Tensor  # float32 0-d


def nvfp4_quantize_blocks(
    blocks: torch.Tensor, tensor_scale: torch.Tensor, four_over_six: bool = False
) -> NVFP4Blocks:
    """Quantize NVFP4 blocks (NVIDIA NVFP4; method notes, section 1), in float32.

    The E4M3 block scale is ``(amax_block / 6) / tensor_scale`` rounded to E4M3 after
    clamping to its normal range [2**-6, 448]; elements are multiplied by
    ``(1 / tensor_scale) / block_scale``, clamped to +-6 and rounded to E2M1. The
    operation order is torchao's ``nvfp4_quantize`` (per-tensor-scale variant), so
    the results agree bit for bit.

    ``four_over_six`` (scale mode ``"4over6"``, "Four Over Six", mit-han-lab/fouroversix):
    each block is also rounded with 1.5 times that block scale (its amax onto 4, where the
    E2M1 grid is finer relative to the amax: 3 and 4 in place of 4 and 6), and keeps
    whichever of the two dequantizes with the less squared error (ties: 6). The tensor
    scale stays NVFP4's ``amax / (448 · 6)``, so a block whose scaled-to-4 scale would pass
    448 gets 448 (its largest elements then saturate, and the error decides); fouroversix
    divides by ``256 · 6`` instead so that no block's does. Either way the result is
    standard NVFP4: any engine dequantizes it.
    """
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    block_scale = (amax / E2M1_MAX) / tensor_scale
    chosen = _nvfp4_round(blocks, block_scale, tensor_scale)
    if not four_over_six:
        return chosen
    four = _nvfp4_round(blocks, block_scale * FOUR_OVER_SIX_EXPANSION, tensor_scale)

    def error(nv: NVFP4Blocks) -> torch.Tensor:
        y = nv.q * nvfp4_scale_values(nv.block_scale, tensor_scale)
        return (y - blocks).square().sum(dim=-1, keepdim=True)

    take_four = error(four) < error(chosen)
    return NVFP4Blocks(
        q=torch.where(take_four, four.q, chosen.q),
        block_scale=torch.where(take_four, four.block_scale, chosen.block_scale),
        tensor_scale=tensor_scale,
    )


def _nvfp4_round(
    blocks: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor
) -> NVFP4Blocks:
    """Blocks rounded to E2M1 under the block scales ``block_scale`` (float32, before
    their rounding to E4M3) and the tensor scale."""
    block_scale_e4m3 = block_scale.clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / tensor_scale) / block_scale_e4m3.to(torch.float32)
    q = round_to_e2m1(blocks * reciprocal)
    return NVFP4Blocks(q=q, block_scale=block_scale_e4m3, tensor_scale=tensor_scale)


def nvfp4_scale_values(block_scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """The total float32 scale of each NVFP4 block: ``tensor_scale * block_scale``."""
    return tensor_scale * block_scale.to(torch.float32)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the whole tensor as float32 (0 for an empty tensor); NaN wins."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().to(torch.float32)


def fake_quantize_reference(
    x: torch.Tensor, fmt: FormatSpec, tensor_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize-dequantize ``x`` along its last dim: the paper's eq. 1, ``s_b * Q(z_b / s_b)``.

    The reference for every format and device; see :func:`torq.formats.fake_quantize`
    (``tensor_scale``: NVFP4's FP32 tensor scale given instead of taken from ``x``).
    """
    if fmt.name == "nvfp4":
        blocks = to_blocks(x, fmt.block_size, torch.float32)
        if tensor_scale is None:
            tensor_scale = nvfp4_tensor_scale(tensor_amax(x))
        else:
            tensor_scale = tensor_scale.to(device=x.device, dtype=torch.float32).reshape(())
        nv = nvfp4_quantize_blocks(blocks, tensor_scale, fmt.scale_mode == "4over6")
        y = nv.q * nvfp4_scale_values(nv.block_scale, nv.tensor_scale)
    else:
        blocks = to_blocks(x, fmt.block_size, compute_dtype(x.dtype))
        mx = mx_quantize_blocks(blocks, fmt)
        y = mx.q * mx_scale_values(mx.exponent, mx.is_nan, blocks.dtype)
    return from_blocks(y, x.shape).to(x.dtype)
