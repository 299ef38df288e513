"""``mxfp4_linear``: one W4A4 product, dispatched to a Triton launch or the fake-quant
reference (paper Algorithm 3, option B).

On CUDA tensors (or in Triton's interpreter) it picks a launch by token count
(:func:`~torq.kernels.config.default_config`) and runs it through
:mod:`torq.kernels.launch`; elsewhere it runs :func:`reference_linear`, the same arithmetic
in float32, so the same model code runs everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torq.formats import FormatSpec, fake_quantize, get_format
from torq.kernels.config import BF16_PREFILL_CONFIG, BLOCK, Backend, KernelConfig, default_config
from torq.kernels.launch import (
    check_block_transform,
    fusable_in_prepass,
    interpreter_enabled,
    launch_gemv_i8,
    launch_tensor_core,
    launch_vendor_gemm,
    triton_available,
)
from torq.kernels.weight import MXFP4Weight

# MXFP4 with the nearest block-scale rule (the activations of torq's default recipe, and of
# compressed-tensors' loaders)
MXFP4_NEAREST = FormatSpec("mxfp4", 32, "nearest")


def use_triton(x: torch.Tensor, backend: Backend) -> bool:
    """Resolve ``backend`` for an input: Triton on CUDA (or in the interpreter), else reference."""
    if backend == "reference":
        return False
    runnable = triton_available() and (x.is_cuda or interpreter_enabled())
    if backend == "triton":
        if not runnable:
            raise RuntimeError(
                "the Triton backend needs Triton and a CUDA tensor (or TRITON_INTERPRET=1 "
                "for Triton's CPU interpreter)"
            )
        return True
    return runnable and x.is_cuda


def apply_block_transform(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Multiply every block of 32 along the last dim by ``t``: ``y_b = t · x_b``."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"a block transform needs a width divisible by {BLOCK}, got {k}")
    blocks = x.reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    return (blocks @ t.to(x.dtype).T).reshape(x.shape)


def reference_linear(
    x: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None = None,
    block_transform: torch.Tensor | None = None,
    nearest: bool = False,
) -> torch.Tensor:
    """The fake-quant definition of :func:`mxfp4_linear`, computed in float32."""
    if block_transform is not None:
        x = apply_block_transform(x, block_transform)
    xq = fake_quantize(x.float(), MXFP4_NEAREST if nearest else get_format("mxfp4"))
    w = weight.dequantize(torch.float32).to(x.device)
    out = F.linear(xq, w, None if bias is None else bias.float())
    return out.to(x.dtype)


def fp8_prefill_usable(x: torch.Tensor, weight: MXFP4Weight) -> str | None:
    """Why the FP8 prefill path cannot run on ``x`` and ``weight`` (None: it can).

    It needs FP8 tensor cores (compute capability 8.9 or later) or Triton's interpreter
    on a CPU, ``torch._scaled_mm``, an output width divisible by 16, and a weight whose
    rows are exact in E4M3 (:meth:`MXFP4Weight.fp8_rows`)."""
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no _scaled_mm"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        return "FP8 tensor cores need compute capability 8.9 or later"
    if not x.is_cuda and not interpreter_enabled():
        return "the FP8 path runs on CUDA (or in Triton's interpreter)"
    if weight.out_features % 16:
        return f"the FP8 GEMM needs an output width divisible by 16, got {weight.out_features}"
    if not weight.fp8_rows()[2]:
        return "a row's block scales span more than 2**14, so E4M3 cannot hold it exactly"
    return None


def mxfp4_linear(
    x: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None = None,
    block_transform: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    rotation: nn.Module | None = None,
    nearest: bool = False,
) -> torch.Tensor:
    """``y = Q(T x) · Q(W)ᵀ + bias`` for packed MXFP4 ``W`` (paper Algorithm 3, option B).

    ``x [..., K]``; ``block_transform`` is an optional ``32×32`` matrix ``T`` applied to every
    block of 32 of ``x`` before quantization (a 32-point Hadamard, TORQ's intra-block
    rotation). The output has ``x``'s dtype. ``backend="auto"`` runs Triton on CUDA tensors
    and the reference elsewhere. ``out`` (2-D ``[tokens, N]``, ``x``'s dtype, contiguous) receives
    the result when given. ``rotation`` is an online transform applied to ``x`` first (a
    TORQ :class:`~torq.rotations.transform.BlockRotation`, or any module); with the
    integer GEMV and its pre-pass (``gemv_i8``, ``a_mode`` 1) a ``BlockRotation`` runs
    inside the pre-pass kernel, elsewhere as its torch module. ``nearest``: the activation's
    block scales by the nearest rule (:class:`torq.formats.FormatSpec`), not OCP's.
    """
    check_block_transform(block_transform)
    fusable = block_transform is None and fusable_in_prepass(rotation)
    if x.shape[-1] != weight.in_features:
        raise ValueError(
            f"input width {x.shape[-1]} does not match the weight's {weight.in_features} inputs"
        )
    if not use_triton(x, backend):
        if rotation is not None:
            x = rotation(x)
        y = reference_linear(x, weight, bias, block_transform, nearest)
        if out is not None:
            out.copy_(y.reshape(out.shape))
            return out
        return y
    lead = x.shape[:-1]
    m = x[..., 0].numel()
    n = weight.out_features
    cfg = config or default_config(m, n, weight.in_features, block_transform is not None)
    if cfg.kind == "fp8_gemm":
        reason = fp8_prefill_usable(x, weight)
        if reason is not None and config is not None:
            raise ValueError(f"fp8_gemm cannot run here: {reason}")
        if reason is not None or (x.is_cuda and x.dtype != torch.bfloat16):
            # automatic choice: bf16 activations only (the FP8 GEMM's output is bf16)
            cfg = BF16_PREFILL_CONFIG
    fuse_rotation = fusable and cfg.kind == "gemv_i8" and cfg.a_mode == 1
    if rotation is not None and not fuse_rotation:
        x = rotation(x)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if out is not None and (
        tuple(out.shape) != (m, n) or out.dtype != x.dtype or not out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {(m, n)}")
    gemv = cfg.kind == "gemv_i8"
    if gemv and m > cfg.block_m:
        raise ValueError(f"the gemv kernel takes up to block_m = {cfg.block_m} tokens, got {m}")
    fused_quant = cfg.a_mode == 0
    if gemv and fused_quant and block_transform is not None and cfg.block_k < 512:
        raise ValueError(f"{cfg.kind} with a block transform needs block_k >= 512")
    result = out
    if cfg.kind == "gemv_i8":
        if out is None:
            out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        fused = rotation if fuse_rotation else None
        launch_gemv_i8(x2, weight, bias, block_transform, cfg, out, fused, nearest)
        return out if result is not None else out.reshape(*lead, n)
    if cfg.kind in ("fp8_gemm", "dequant_gemm"):  # vendor GEMMs: no copy without `out`
        y = launch_vendor_gemm(x2, weight, bias, block_transform, cfg, nearest)
        if out is None:
            return y.reshape(*lead, n)
        out.copy_(y)
        return out
    if cfg.split_k > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    elif out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    launch_tensor_core(x2, weight, bias, block_transform, cfg, out, nearest)
    if result is not None:
        if result is not out:
            result.copy_(out)
        return result
    return out.to(x.dtype).reshape(*lead, n)
