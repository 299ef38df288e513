"""Real (packed) quantization: 4-bit codes two per byte (MXFP8: an E4M3 byte per element),
one scale byte per block."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torq.formats.config import FormatSpec, as_format
from torq.formats.constants import (
    E2M1_MAX,
    E4M3_EMAX,
    E4M3_MAX,
    E4M3_MAX_SIGNIFICAND,
    E4M3_MIN_NORMAL,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
)
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
    floor_log2,
    pack_nibbles,
    unpack_nibbles,
)
from torq.formats.reference import (
    check_input,
    compute_dtype,
    from_blocks,
    mx_quantize_blocks,
    nvfp4_quantize_blocks,
    nvfp4_scale_values,
    nvfp4_tensor_scale,
    round_to_e2m1,
    round_to_e4m3,
    tensor_amax,
    to_blocks,
)


@dataclass
class PackedTensor:
    """A tensor stored in a block-scaled 4-bit format, quantized along its last dim.

    * ``codes``: ``uint8 [..., padded_width // 2]``, two 4-bit codes per byte, element
      ``2i`` in the LOW nibble and ``2i + 1`` in the HIGH nibble. E2M1 codes (mxfp4,
      nvfp4) hold the sign in bit 3 and the magnitude index into
      {0, 0.5, 1, 1.5, 2, 3, 4, 6} in bits 0-2; MXINT4 codes are the two's complement
      nibble of ``k`` for the value ``k / 4``. Padding elements are code 0, and so are
      the elements of a block whose scale is NaN. MXFP8 (8-bit): ``uint8 [...,
      padded_width]``, the bits of each ``torch.float8_e4m3fn`` element.
    * ``scales``: ``uint8 [..., n_blocks]``, an E8M0 byte (mxfp4, mxint4; 0xFF = NaN)
      or the bits of an FP8 E4M3 value (nvfp4).
    * ``tensor_scale``: the FP32 per-tensor scale (0-d) for nvfp4, else ``None``.
    * ``shape``: the original shape; the width is ``shape[-1]``, padded up to a
      multiple of the block size in ``codes``.
    """

    fmt: FormatSpec
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values, for fake-quantized compute (:func:`dequantize`)."""
        return dequantize(self, dtype)

    def to_state(self) -> dict[str, torch.Tensor]:
        """The stored tensors: ``codes``, ``scales`` and, for NVFP4, ``tensor_scale`` (1-D,
        one element), contiguous and on the CPU: what a checkpoint writes under a weight's
        name with these suffixes."""
        out = {"codes": self.codes.cpu().contiguous(), "scales": self.scales.cpu().contiguous()}
        if self.tensor_scale is not None:
            out["tensor_scale"] = self.tensor_scale.cpu().reshape(1).contiguous()
        return out

    @classmethod
    def from_state(
        cls,
        fmt: FormatSpec,
        shape: tuple[int, ...],
        codes: torch.Tensor,
        scales: torch.Tensor,
        tensor_scale: torch.Tensor | None = None,
    ) -> PackedTensor:
        """The inverse of :meth:`to_state`, its tensors checked against ``shape`` (a
        ``ValueError`` names what does not fit)."""
        bs = fmt.block_size
        padded = -(-shape[-1] // bs) * bs
        per_byte = 1 if fmt.name == "mxfp8" else 2
        want_codes = (*shape[:-1], padded // per_byte)
        want_scales = (*shape[:-1], padded // bs)
        if tuple(codes.shape) != want_codes or tuple(scales.shape) != want_scales:
            raise ValueError(
                f"packed codes {tuple(codes.shape)} / scales {tuple(scales.shape)} do not fit "
                f"the shape {shape} (want {want_codes} / {want_scales})"
            )
        if fmt.name == "nvfp4" and tensor_scale is None:
            raise ValueError("an nvfp4 weight needs its tensor scale")
        ts = None if tensor_scale is None else tensor_scale.reshape(())
        return cls(fmt=fmt, codes=codes, scales=scales, tensor_scale=ts, shape=tuple(shape))


def quantize(x: torch.Tensor, fmt: FormatSpec | str) -> PackedTensor:
    """Quantize ``x`` along its last dim into packed codes and block scales.

    The stored form of the paper's eq. 1 (Section 4): per block the scale ``s_b`` as
    a byte and the E2M1 (or INT4) codes of ``Q(z_b / s_b)``; semantics as in
    :func:`torq.formats.fake_quantize`, and ``dequantize(quantize(x, f), x.dtype)``
    equals ``fake_quantize(x, f)`` bit for bit, NaN blocks included.
    """
    spec = as_format(fmt)
    check_input(x)
    with torch.no_grad():
        return _quantize(x.detach(), spec)


def _quantize(x: torch.Tensor, spec: FormatSpec) -> PackedTensor:
    leading = tuple(x.shape[:-1])
    if spec.name == "nvfp4":
        blocks = to_blocks(x, spec.block_size, torch.float32)
        nv = nvfp4_quantize_blocks(
            blocks, nvfp4_tensor_scale(tensor_amax(x)), spec.scale_mode == "4over6"
        )
        codes = encode_e2m1(nv.q)
        scales = encode_e4m3(nv.block_scale)
        tensor_scale: torch.Tensor | None = nv.tensor_scale
    else:
        blocks = to_blocks(x, spec.block_size, compute_dtype(x.dtype))
        mx = mx_quantize_blocks(blocks, spec)
        if spec.name == "mxfp8":
            codes = mx.q.to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            codes = encode_int4(mx.q) if spec.name == "mxint4" else encode_e2m1(mx.q)
        codes = torch.where(mx.is_nan, 0, codes)
        scales = encode_e8m0(mx.exponent, mx.is_nan)
        tensor_scale = None
    n_blocks = blocks.shape[1]
    codes = codes.reshape(*leading, n_blocks * spec.block_size)
    return PackedTensor(
        fmt=spec,
        codes=codes if spec.name == "mxfp8" else pack_nibbles(codes),
        scales=scales.reshape(*leading, n_blocks),
        tensor_scale=tensor_scale,
        shape=tuple(x.shape),
    )


def _e4m3_normals() -> torch.Tensor:
    """Every finite E4M3 value in ``[2**-6, 448]`` (the block scales NVFP4 quantization
    gives, :func:`torq.formats.reference.nvfp4_quantize_blocks`), ascending, float32."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = values.to(torch.float32)
    keep = torch.isfinite(values) & (values >= E4M3_MIN_NORMAL)
    return torch.unique(values[keep])


@torch.no_grad()
def encode_nvfp4_exact(w: torch.Tensor, tensor_scale: torch.Tensor) -> PackedTensor | None:
    """The packed NVFP4 form of a tensor already on NVFP4's grid with the FP32 tensor scale
    ``tensor_scale`` (a weight torq quantized, by rounding or by GPTQ, whose block scales
    were not kept), or ``None`` when no E4M3 block scale reproduces some block exactly.

    Each block ``b`` needs an E4M3 scale ``s`` with ``w = q · fl(g · s)`` bit for bit for
    E2M1 values ``q`` (the arithmetic of :func:`dequantize` and of the fake quantization).
    The scale the rounding chose, ``E4M3((amax_b / 6) / g)``, is tried first; a block whose
    largest code is not 6 (GPTQ's, or one whose scale rounded up past it) is tried against
    every normal E4M3 value, and keeps the first that reproduces it. Every scale that does
    gives the same values, so ``dequantize`` of the result equals ``w`` bit for bit.
    """
    spec = as_format("nvfp4")
    x = w.detach().to(torch.float32)
    if x.numel() == 0 or not bool(torch.isfinite(x).all()):
        return None
    g = tensor_scale.to(torch.float32).reshape(())
    blocks = to_blocks(x, spec.block_size, torch.float32)  # [rows, n_blocks, 16]
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    first = ((amax / E2M1_MAX) / g).clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale = first.to(torch.float32)

    def fits(s: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = g * s
        q = round_to_e2m1(b / total)
        return (q * total == b).all(dim=-1, keepdim=True), q

    ok, q = fits(scale, blocks)
    bad = ~ok.reshape(-1)
    if bool(bad.any()):
        flat_b = blocks.reshape(-1, 1, spec.block_size)
        rest = flat_b[bad]  # [m, 1, 16]
        candidates = _e4m3_normals().reshape(1, -1, 1)  # [1, c, 1]
        found = torch.zeros(rest.shape[0], dtype=torch.bool)
        chosen = torch.zeros(rest.shape[0], 1, 1)
        for start in range(0, rest.shape[0], 4096):  # [4096, 119, 16] floats at a time
            part = rest[start : start + 4096]
            good, _ = fits(candidates, part)  # [m, c, 1]
            good = good[..., 0]
            any_good = good.any(dim=1)
            pick = good.to(torch.int8).argmax(dim=1)
            found[start : start + 4096] = any_good
            chosen[start : start + 4096, 0, 0] = candidates[0, pick, 0]
        if not bool(found.all()):
            return None
        flat_s = scale.reshape(-1, 1, 1).clone()
        flat_s[bad] = chosen
        scale = flat_s.reshape(scale.shape)
        ok, q = fits(scale, blocks)
        if not bool(ok.all()):
            return None
    leading = tuple(x.shape[:-1])
    n_blocks = blocks.shape[1]
    return PackedTensor(
        fmt=spec,
        codes=pack_nibbles(encode_e2m1(q).reshape(*leading, n_blocks * spec.block_size)),
        scales=encode_e4m3(scale.to(torch.float8_e4m3fn)).reshape(*leading, n_blocks),
        tensor_scale=g.clone(),
        shape=tuple(x.shape),
    )


def dequantize(p: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a :class:`PackedTensor` to ``dtype``: ``s_b * code value`` per element.

    Computed in float32 (float64 when ``dtype`` is float64 and the format is MX),
    then cast to ``dtype``; this is the same arithmetic as
    :func:`torq.formats.fake_quantize`.
    """
    spec = p.fmt
    rows = math.prod(p.shape[:-1])
    n_blocks = p.scales.shape[-1]
    raw = p.codes if spec.name == "mxfp8" else unpack_nibbles(p.codes)
    codes = raw.reshape(rows, n_blocks, spec.block_size)
    if spec.name == "nvfp4":
        if p.tensor_scale is None:
            raise ValueError("an nvfp4 PackedTensor needs its tensor_scale")
        q = decode_e2m1(codes, torch.float32)
        scale = nvfp4_scale_values(decode_e4m3(p.scales), p.tensor_scale)
    else:
        work = compute_dtype(dtype)
        if spec.name == "mxfp8":
            q = codes.view(torch.float8_e4m3fn).to(work)
        else:
            q = decode_int4(codes, work) if spec.name == "mxint4" else decode_e2m1(codes, work)
        scale = decode_e8m0(p.scales, work)
    y = q * scale.reshape(rows, n_blocks, 1)
    return from_blocks(y, p.shape).to(dtype)


@torch.no_grad()
def pack_exact(
    w: torch.Tensor, fmt: FormatSpec | str, tensor_scale: torch.Tensor | None = None
) -> PackedTensor | None:
    """The packed form of a weight already on ``fmt``'s grid (quantized by rounding or by
    GPTQ), or ``None`` when no packing gives ``w`` back bit for bit (a weight kept in float,
    or off the grid). MX formats pack by quantizing again, which leaves values on the grid
    where they are; an NVFP4 weight packs with the tensor scale it was quantized with
    (:func:`encode_nvfp4_exact`), since quantizing again would take the quantized weight's
    own amax, another scale. This is how every quantized weight torq holds in float reaches
    its one stored form: checkpoints, the kernels and compressed-tensors take the result.
    The codes and scales are on ``w``'s device (NVFP4's on the CPU)."""
    spec = as_format(fmt)
    x = w.detach()
    if x.numel() == 0 or not bool(torch.isfinite(x).all()):
        return None
    if spec.name == "nvfp4":
        if tensor_scale is None:
            return None
        x = x.cpu()  # the search for exact block scales runs on the CPU
        p = encode_nvfp4_exact(x, tensor_scale.detach().cpu())
    else:
        p = _quantize(x, spec)
        if spec.name == "mxfp8" and not torch.equal(dequantize(p, x.dtype), x):
            p = _mxfp8_fitting(x, spec)
    if p is None or not torch.equal(dequantize(p, x.dtype), x):
        return None
    return p


def _mxfp8_fitting(x: torch.Tensor, spec: FormatSpec) -> PackedTensor:
    """An MXFP8 weight whose values lie on the grid of scales its own amax does not give back
    (GPTQ fixes a block's scale before error feedback moves its later columns; the
    ``nearest`` rule then bumps the block a binade, halving codes below E4M3's smallest
    step), packed with each block's smallest scale that holds its amax,
    ``X = 2^ceil(log2(amax / 448))``: every element is then its value over a scale no larger
    than the one it was rounded with, a power of two times an E4M3 value, at most 448, so on
    the grid."""
    leading = tuple(x.shape[:-1])
    blocks = to_blocks(x, spec.block_size, compute_dtype(x.dtype))
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    log2_floor, significand = floor_log2(amax)
    exponent = log2_floor - E4M3_EMAX + (significand > E4M3_MAX_SIGNIFICAND).to(torch.int32)
    exponent = torch.where(amax > 0, exponent, E8M0_MIN_EXP).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    is_nan = ~torch.isfinite(amax)
    q = round_to_e4m3(blocks * exact_pow2(-exponent, blocks.dtype))
    codes = torch.where(is_nan, 0, q.to(torch.float8_e4m3fn).view(torch.uint8))
    return PackedTensor(
        fmt=spec,
        codes=codes.reshape(*leading, -1),
        scales=encode_e8m0(exponent.to(torch.int32), is_nan).reshape(*leading, -1),
        tensor_scale=None,
        shape=tuple(x.shape),
    )
