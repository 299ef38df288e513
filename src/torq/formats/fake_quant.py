"""Quantize-dequantize ("fake quantization"), the hot path of every evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torq.formats.config import FormatSpec, as_format
from torq.formats.cpu_kernel import load_kernel, mxfp4_fake_quantize_compiled
from torq.formats.kernels import mxfp4_fake_quantize_chunked
from torq.formats.reference import check_input, fake_quantize_reference

_FAST_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fake_quantize(
    x: torch.Tensor, fmt: FormatSpec | str, tensor_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize ``x`` to ``fmt`` and back along its last dim: the paper's eq. 1
    (Section 4), ``z_hat_b = s_b * Q(z_b / s_b)``, per block of the last dim.

    * Any leading shape, any float dtype (float32, bfloat16, float16, float64), any
      device; returns a new tensor of the same shape, dtype and device, detached from
      autograd. A width that is not a multiple of the block size is padded internally
      with zeros and the padding dropped on return.
    * ``tensor_scale`` (NVFP4 only): a static FP32 tensor scale calibrated beforehand
      (``amax / (448 · 6)`` of calibration activations), used instead of ``x``'s own; values
      past the calibrated amax then saturate (block scale 448, elements ±6), as in
      compressed-tensors' NVFP4 activations (``input_global_scale = 1 / tensor_scale``).
    * MXFP4 (method notes, section 1): one E8M0 scale per block of 32 elements,
      ``X = 2^(floor(log2 amax) - 2)`` (``scale_mode="ocp"``, torchao's FLOOR), or
      ``2^floor(log2 amax)`` (``"paper"``) or ``2^ceil(log2(amax / 6))`` (``"rceil"``),
      clamped to [2**-127, 2**127]; an all-zero block gets 2**-127. Elements ``x / X``
      are rounded to the nearest E2M1 value, ties to even, saturating at +-6; the sign
      of zero is kept.
    * NVFP4: blocks of 16, an FP8 E4M3 block scale and one FP32 scale computed from
      the amax of the whole tensor passed in (see
      :func:`torq.formats.reference.nvfp4_quantize_blocks`); computed in float32, so
      float64 inputs are rounded to float32 first.
    * MXINT4: blocks of 32, ``X = 2^floor(log2 amax)``, elements ``k / 4`` with ``k``
      in [-7, 7], ties to even; zero is +0.
    * NaN / Inf: in MXFP4 and MXINT4 a NaN or +-Inf makes its block's scale NaN and
      the whole block NaN. In NVFP4 it makes the tensor scale NaN and the whole
      tensor NaN.

    Float32/bfloat16/float16 MXFP4 on CPU takes a fast path (a compiled kernel, or
    chunked integer arithmetic in torch when no compiler is available); everything
    else runs :func:`torq.formats.reference.fake_quantize_reference`. All paths give
    the same bits.
    """
    spec = as_format(fmt)
    check_input(x)
    if tensor_scale is not None and spec.name != "nvfp4":
        raise ValueError(f"a tensor scale is NVFP4's; format {spec.name!r} has none")
    with torch.no_grad():
        x = x.detach()
        if spec.name == "mxfp4" and x.device.type == "cpu" and x.dtype in _FAST_CPU_DTYPES:
            return _mxfp4_cpu(x, spec)
        return fake_quantize_reference(x, spec, tensor_scale)


def _mxfp4_cpu(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    width = x.shape[-1]
    pad = (-width) % spec.block_size
    flat = x.to(torch.float32)
    if pad:
        flat = F.pad(flat.reshape(-1, width), (0, pad))
    flat = flat.contiguous()
    if load_kernel() is not None:
        y = mxfp4_fake_quantize_compiled(flat, spec)
    else:
        y = mxfp4_fake_quantize_chunked(flat, spec)
    if pad:
        y = y[:, :width]
    return y.reshape(x.shape).to(x.dtype)
