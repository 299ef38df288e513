"""Launches of the Triton W4A4 kernels (:mod:`torq.kernels.triton_mxfp4`): the activation
pre-passes (paper eq. 1, with TORQ's online transform of Algorithm 3 fused in where it can
be), the weight decodes of the prefill paths, and the matmuls. Each function here runs
one given :class:`~torq.kernels.config.KernelConfig`; choosing it is
:mod:`torq.kernels.dispatch`'s job.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

import torq.kernels.config as kernel_config
from torq.kernels.config import BLOCK, QUANT_CONFIG, KernelConfig
from torq.kernels.weight import MXFP4Weight
from torq.rotations.transform import BlockRotation


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported here (its kernels then run on CUDA or, with
    ``TRITON_INTERPRET=1``, in Triton's CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreter_enabled() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``), where inline PTX and
    bf16 dots are unavailable."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_block_transform(t: torch.Tensor | None) -> None:
    """Refuse an online block transform that is not one 32×32 matrix (the MX block)."""
    if t is not None and tuple(t.shape) != (BLOCK, BLOCK):
        raise ValueError(f"the block transform must be {BLOCK}×{BLOCK}, got {tuple(t.shape)}")


def _activation_2d(
    x: torch.Tensor, block_transform: torch.Tensor | None
) -> tuple[torch.Tensor, int, int, int]:
    """Check a pre-pass input: ``(x contiguous, M, K, Kp)`` with ``Kp`` K padded to 32."""
    check_block_transform(block_transform)
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D activation, got shape {tuple(x.shape)}")
    m, k = x.shape
    return x.contiguous(), m, k, (k + BLOCK - 1) // BLOCK * BLOCK


def quantize_activation(
    x: torch.Tensor,
    block_transform: torch.Tensor | None = None,
    config: KernelConfig = QUANT_CONFIG,
    values_dtype: torch.dtype | None = None,
    permuted: bool = False,
    nearest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation pre-pass on a 2-D ``x [M, K]``: (optional block transform, then)
    MXFP4 codes ``uint8 [M, Kp/2]`` and E8M0 scales ``uint8 [M, Kp/32]`` (paper eq. 1; the
    OCP scale rule, or with ``nearest`` the nearest rule, as in every pre-pass below).

    With ``values_dtype``, it returns instead the dequantized values ``[M, Kp]`` in that
    dtype (exact in bf16 and float32) and an empty scale tensor; ``permuted`` writes each
    block of 32 as its even elements, then its odd ones (see :func:`dequantize_weight`)."""
    import torq.kernels.triton_mxfp4 as tk

    x, m, k, kp = _activation_2d(x, block_transform)
    if values_dtype is not None:
        codes = torch.empty((m, kp), dtype=values_dtype, device=x.device)
        scales = torch.empty((0, 1), dtype=torch.uint8, device=x.device)
    else:
        codes = torch.empty((m, kp // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty((m, kp // BLOCK), dtype=torch.uint8, device=x.device)
    t_t = _transposed(block_transform, x.dtype)
    grid = (tk.cdiv(m, config.block_m), tk.cdiv(kp, config.block_k))
    tk._mx_quantize_kernel[grid](
        x,
        t_t if t_t is not None else x,
        codes,
        scales,
        m,
        k,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        HAS_T=t_t is not None,
        WRITE_VALUES=values_dtype is not None,
        PERMUTED=permuted,
        BM=config.block_m,
        BK=config.block_k,
        NEAREST=nearest,
        num_warps=config.num_warps,
    )
    return codes, scales


def dequantize_weight(
    weight: MXFP4Weight,
    dtype: torch.dtype = torch.bfloat16,
    block: tuple[int, int] = (32, 256),
    permuted: bool = False,
) -> torch.Tensor:
    """The packed weight decoded to ``[N, Kp]`` in ``dtype`` (exact in bf16) by a Triton
    kernel; the padding columns are zero. ``permuted`` writes each block of 32 as its even
    elements, then its odd ones (no nibble interleaving); pair it with an activation
    written in the same order (:func:`quantize_activation`), since a product over K does
    not depend on the order of K."""
    import torq.kernels.triton_mxfp4 as tk

    n = weight.out_features
    kp = weight.codes.shape[1] * 2
    out = torch.empty((n, kp), dtype=dtype, device=weight.codes.device)
    grid = (tk.cdiv(n, block[0]), tk.cdiv(kp, block[1]))
    tk._mx_dequantize_kernel[grid](
        weight.codes,
        weight.scales,
        out,
        n,
        kp,
        weight.codes.stride(0),
        weight.scales.stride(0),
        out.stride(0),
        PERMUTED=permuted,
        BR=block[0],
        BK=block[1],
    )
    return out


def quantize_activation_fp8(
    x: torch.Tensor,
    block_transform: torch.Tensor | None = None,
    block: tuple[int, int] = (4, 1024),
    num_warps: int = 4,
    nearest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 prefill path's activation pre-pass on ``x [M, K]``: (optional block transform,
    then) the MXFP4 values ``Q(x)`` (paper eq. 1) as ``float8_e4m3fn [M, Kp]`` times
    ``2**(6 − r_m)`` and the row scales ``2**(r_m − 6)``, float32 ``[M, 1]``, with ``r_m``
    the row's largest block exponent: ``values · scale == Q(x)`` exactly for every block
    whose scale is at least ``2**(r_m − 14)``; the few smaller ones (a token whose blocks
    span more than 2**14) are rounded onto E4M3's subnormals. ``block``: rows per program
    and the K tile."""
    import torq.kernels.triton_mxfp4 as tk

    x, m, k, kp = _activation_2d(x, block_transform)
    out = torch.empty((m, kp), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    out_bytes = out.view(torch.uint8)
    t_t = _transposed(block_transform, x.dtype)
    tk._mx_quantize_fp8_kernel[(tk.cdiv(m, block[0]),)](
        x,
        t_t if t_t is not None else x,
        out_bytes,
        scale,
        m,
        k,
        x.stride(0),
        out_bytes.stride(0),
        HAS_T=t_t is not None,
        ONE_TILE=kp <= block[1],
        HW_FP8=not interpreter_enabled(),
        BM=block[0],
        BK=block[1],
        NEAREST=nearest,
        num_warps=num_warps,
    )
    return out, scale


def dequantize_weight_fp8(
    weight: MXFP4Weight, block: tuple[int, int] = (32, 256), num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed weight as ``float8_e4m3fn [N, Kp]`` with its row scales ``float32 [1, N]``
    (:meth:`MXFP4Weight.fp8_rows`): ``values · scale == Q(W)`` exactly when
    ``fp8_rows()`` says so. ``block``: the decode kernel's (rows, K) tile."""
    import torq.kernels.triton_mxfp4 as tk

    rows, scale, _ = weight.fp8_rows()
    n = weight.out_features
    kp = weight.codes.shape[1] * 2
    out = torch.empty((n, kp), dtype=torch.float8_e4m3fn, device=weight.codes.device)
    out_bytes = out.view(torch.uint8)
    grid = (tk.cdiv(n, block[0]), tk.cdiv(kp, block[1]))
    tk._mx_weight_fp8_kernel[grid](
        weight.codes,
        weight.scales,
        rows,
        out_bytes,
        n,
        kp,
        weight.codes.stride(0),
        weight.scales.stride(0),
        out_bytes.stride(0),
        HW_FP8=not interpreter_enabled(),
        BR=block[0],
        BK=block[1],
        num_warps=num_warps,
    )
    return out, scale


def _transposed(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(dtype).T.contiguous()


# Split-K workspaces of the integer GEMV, per (device, output width): a float32 [N]
# accumulator and an int32 counter per output tile, both zero between launches (the last
# program of each tile resets them). Launches on one device with the same width therefore
# must not run concurrently on two streams; use split_k=1 there.
_GEMV_WORKSPACES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def gemv_workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K decode GEMV's accumulator and tile counter for ``n`` outputs, kept per
    device and size so that a decode step allocates nothing."""
    key = (str(device), n)
    if key not in _GEMV_WORKSPACES:
        _GEMV_WORKSPACES[key] = (
            torch.zeros(n, dtype=torch.float32, device=device),
            torch.zeros(n, dtype=torch.int32, device=device),
        )
    return _GEMV_WORKSPACES[key]


def quantize_activation_i8(
    x: torch.Tensor,
    block_transform: torch.Tensor | None = None,
    block_k: int = 512,
    pdl: bool = False,
    nearest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer GEMV's pre-pass on ``x [M, K]``: ``2·Q(x)`` as int8 ``[M, Kp]`` and the
    block scales over four, float32 ``[M, Kp/32]`` (paper eq. 1; NaN/Inf blocks: codes 0,
    scale NaN). A 32×32 ``block_transform`` ``T`` (``y_b = T x_b``) runs in the structured
    pre-pass of :func:`quantize_activation_torq_i8`, as its intra-block rotation ``Tᵀ``."""
    import torq.kernels.triton_mxfp4 as tk

    check_block_transform(block_transform)
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D activation, got shape {tuple(x.shape)}")
    if block_transform is not None:
        return _structured_prepass(
            x, None, None, block_transform, pdl, transpose_intra=True, nearest=nearest
        )
    x = x.contiguous()
    m, k = x.shape
    kp = (k + BLOCK - 1) // BLOCK * BLOCK
    q = torch.empty((m, kp), dtype=torch.int8, device=x.device)
    s = torch.empty((m, kp // BLOCK), dtype=torch.float32, device=x.device)
    tk._mx_quantize_i8_kernel[(m, tk.cdiv(kp, block_k))](
        x,
        q,
        s,
        m,
        k,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        PDL=pdl,
        BM=1,
        BK=block_k,
        NEAREST=nearest,
    )
    return q, s


def fusable_in_prepass(rotation: nn.Module | None) -> bool:
    """Whether :func:`quantize_activation_torq_i8` can run ``rotation`` inside the integer
    GEMV's pre-pass: a :class:`BlockRotation` of 32-element blocks (the MX block the kernel
    quantizes) without a channel permutation (the pre-pass has no gather). Any other
    transform runs as its torch module before the plain pre-pass
    (:meth:`BlockRotation.kernel_form`)."""
    return isinstance(rotation, BlockRotation) and rotation.kernel_form(BLOCK) != "module"


def quantize_activation_torq_i8(
    x: torch.Tensor,
    rotation: BlockRotation,
    pdl: bool = False,
    tile: tuple[int, int] | None = None,
    nearest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TORQ's online transform ``T x`` (channel scale, inter-block, intra-block; Section 5,
    Algorithm 3) fused into the integer GEMV's pre-pass: one kernel gives ``2·Q(T x)`` as
    int8 ``[M, d]`` and the block scales over four ``[M, d/32]``, as
    :func:`quantize_activation_i8` does for ``x``. ``tile``: output blocks per program and
    input blocks per step (default :data:`torq.kernels.config.TORQ_PREPASS_TILE`)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D activation, got shape {tuple(x.shape)}")
    if rotation.block_size != BLOCK:
        raise ValueError(f"the fused pre-pass needs blocks of {BLOCK}, got {rotation.block_size}")
    if getattr(rotation, "channel_perm", None) is not None:
        raise ValueError("the fused pre-pass has no channel gather: run the permuted transform")
    d = x.shape[1]
    if rotation.n_blocks is not None and d != rotation.n_blocks * BLOCK:
        raise ValueError(
            f"input width {d} does not match the rotation's {rotation.n_blocks} blocks"
        )
    return _structured_prepass(
        x, rotation.channel_scale, rotation.r_inter, rotation.r_intra, pdl, tile, nearest=nearest
    )


def _structured_prepass(
    x: torch.Tensor,
    channel_scale: torch.Tensor | None,
    r_inter: torch.Tensor | None,
    r_intra: torch.Tensor | None,
    pdl: bool,
    tile: tuple[int, int] | None = None,
    transpose_intra: bool = False,
    nearest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    import torq.kernels.triton_mxfp4 as tk

    m, d = x.shape
    if d % BLOCK:
        raise ValueError(f"an online transform needs a width divisible by {BLOCK}, got {d}")
    x = x.contiguous()
    nb = d // BLOCK
    q = torch.empty((m, d), dtype=torch.int8, device=x.device)
    s = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    # read at call time: benchmarks/kernel_speed.py sweeps it
    blocks_per_program, chunk = tile or kernel_config.TORQ_PREPASS_TILE
    tk._mx_quantize_torq_i8_kernel[(m, tk.cdiv(nb, blocks_per_program))](
        x,
        channel_scale if channel_scale is not None else x,
        r_inter if r_inter is not None else x,
        r_intra if r_intra is not None else x,
        q,
        s,
        nb,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        HAS_SCALE=channel_scale is not None,
        HAS_INTER=r_inter is not None,
        HAS_INTRA=r_intra is not None,
        TRANS_INTRA=transpose_intra,
        PDL=pdl,
        BA=blocks_per_program,
        BB=chunk,
        NEAREST=nearest,
    )
    return q, s


def _pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper or later GPU and a Triton with grid
    dependency control; elsewhere (the interpreter included) ``KernelConfig.pdl`` is off."""
    import torq.kernels.triton_mxfp4 as tk

    if interpreter_enabled() or tk.gdc_wait is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_gemv_i8(
    x2: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None,
    block_transform: torch.Tensor | None,
    cfg: KernelConfig,
    out: torch.Tensor,
    rotation: BlockRotation | None = None,
    nearest: bool = False,
) -> None:
    """Decode (few tokens): the activation quantized per MX block (eq. 1, with the online
    transform) inside the GEMV (``a_mode`` 0) or by an int8 pre-pass, then the integer GEMV
    on the packed weight, written into ``out``."""
    import torq.kernels.triton_mxfp4 as tk

    k = x2.shape[1]
    n = weight.out_features
    words = weight.codes.view(torch.int32)
    fused = cfg.a_mode == 0
    pdl = cfg.pdl and _pdl_supported(x2.device)
    if fused:
        xq, xs = x2, x2
    elif rotation is not None:
        q8, xs = quantize_activation_torq_i8(x2, rotation, pdl=pdl, nearest=nearest)
        xq = q8.view(torch.int32)
    else:
        q8, xs = quantize_activation_i8(x2, block_transform, pdl=pdl, nearest=nearest)
        xq = q8.view(torch.int32)
    # launch options shared by both GEMVs
    options = {
        "HAS_BIAS": bias is not None,
        "EVEN_K": k % cfg.block_k == 0,
        "USE_ASM": not interpreter_enabled(),
        "PREFETCH": cfg.prefetch,
        "PDL": pdl,
        "STREAM": cfg.evict_first,
        "BN": cfg.block_n,
        "BK": cfg.block_k,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    }
    bias_arg = bias if bias is not None else x2
    if cfg.block_m > 1:
        tk._mx_gemv_rows_i8_kernel[(tk.cdiv(n, cfg.block_n),)](
            xq,
            xs,
            words,
            weight.scales,
            bias_arg,
            out,
            x2.shape[0],
            n,
            k,
            xq.stride(0),
            xs.stride(0),
            words.stride(0),
            weight.scales.stride(0),
            out.stride(0),
            ROWS=cfg.block_m,
            **options,
        )
        return
    ws, count = gemv_workspace(x2.device, n) if cfg.split_k > 1 else (out, out)
    t = block_transform.contiguous() if fused and block_transform is not None else None
    tk._mx_gemv_i8_kernel[(tk.cdiv(n, cfg.block_n), cfg.split_k)](
        x2,
        xq,
        xs,
        t if t is not None else x2,
        words,
        weight.scales,
        bias_arg,
        out,
        ws,
        count,
        n,
        k,
        words.stride(0),
        weight.scales.stride(0),
        FUSED_QUANT=fused,
        HAS_T=t is not None,
        SPLIT_K=cfg.split_k,
        NEAREST=nearest,
        **options,
    )


def launch_vendor_gemm(
    x2: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None,
    block_transform: torch.Tensor | None,
    cfg: KernelConfig,
    nearest: bool = False,
) -> torch.Tensor:
    """The prefill paths: both operands' MXFP4 values in a format the vendor GEMM takes,
    then the vendor GEMM. ``fp8_gemm``: E4M3 with power-of-two row scales and the
    row-scaled FP8 GEMM (bf16 output on CUDA); ``dequant_gemm``: bf16 (float32 for float32
    inputs) and ``F.linear``. Returns ``[M, N]`` in ``x2``'s dtype."""
    if cfg.kind == "fp8_gemm":
        a, a_scale = quantize_activation_fp8(
            x2, block_transform, (cfg.block_m, cfg.block_k), cfg.num_warps, nearest=nearest
        )
        w, w_scale = dequantize_weight_fp8(weight, cfg.w_tile, cfg.num_warps)
        out_dtype = torch.bfloat16 if x2.is_cuda else x2.dtype
        y = torch._scaled_mm(
            a, w.T, a_scale, w_scale, out_dtype=out_dtype, use_fast_accum=cfg.fast_accum
        )
        if bias is not None:
            y += bias.to(out_dtype)
        return y.to(x2.dtype)
    values_dtype = torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float32
    permuted = cfg.a_mode == 1  # for dequant_gemm, a_mode 1 selects the permuted order
    a, _ = quantize_activation(
        x2, block_transform, values_dtype=values_dtype, permuted=permuted, nearest=nearest
    )
    block = (cfg.block_m or 32, cfg.block_n or 256)
    w_values = dequantize_weight(weight, values_dtype, block=block, permuted=permuted)
    b = None if bias is None else bias.to(values_dtype)
    return F.linear(a, w_values, b).to(x2.dtype)


def launch_tensor_core(
    x2: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None,
    block_transform: torch.Tensor | None,
    cfg: KernelConfig,
    out: torch.Tensor,
    nearest: bool = False,
) -> None:
    """Prefill (many tokens): the activation quantized to MXFP4 (eq. 1) inside the kernel
    (``a_mode`` 0) or by a pre-pass, then the tiled tensor-core matmul that decodes the packed
    weight tile by tile, written into ``out``."""
    import torq.kernels.triton_mxfp4 as tk

    m, k = x2.shape
    n = weight.out_features
    dot_bf16 = not interpreter_enabled()
    even_k = k % cfg.block_k == 0  # then no tile needs a mask along K
    t_t = _transposed(block_transform, x2.dtype)
    if cfg.a_mode == 0:
        a, a_scales, stride_as = x2, x2, 0
    elif cfg.a_mode == 1:
        a, a_scales = quantize_activation(x2, block_transform, nearest=nearest)
        stride_as = a_scales.stride(0)
    else:
        values_dtype = torch.bfloat16 if dot_bf16 else torch.float32
        a, a_scales = quantize_activation(
            x2, block_transform, values_dtype=values_dtype, nearest=nearest
        )
        stride_as = 0
    grid = (tk.cdiv(m, cfg.block_m), tk.cdiv(n, cfg.block_n), cfg.split_k)
    tk._mx_matmul_kernel[grid](
        a,
        a_scales,
        t_t if t_t is not None else x2,
        weight.codes,
        weight.scales,
        bias if bias is not None else x2,
        out,
        m,
        n,
        k,
        a.stride(0),
        stride_as,
        weight.codes.stride(0),
        weight.scales.stride(0),
        out.stride(0),
        A_MODE=cfg.a_mode,
        HAS_T=cfg.a_mode == 0 and t_t is not None,
        HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k,
        DOT_BF16=dot_bf16,
        DOT_SCALED=cfg.kind == "dot_scaled",
        EVEN_K=even_k,
        SWAP_AB=cfg.swap_ab and cfg.kind == "dot",
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        NEAREST=nearest,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
