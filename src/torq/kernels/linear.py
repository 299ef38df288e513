"""Packed MXFP4 linear layers: real W4A4 inference on GPUs, the fake-quant reference elsewhere.

:class:`PackedMXFP4Linear` holds only the packed weight (two E2M1 codes per byte, one E8M0
scale byte per 32 inputs) and computes ``y = Q(T x) · Q(W')ᵀ + b`` (the paper's
Algorithm 3, option B). On a CUDA device it runs the Triton kernels of
:mod:`torq.kernels.triton_mxfp4`: for one token an int8 pre-pass (with TORQ's online
transform fused in, when the layer has one) and an integer ``dp4a`` GEMV (2–4 tokens:
the same GEMV on several rows); for 5–255 tokens a tensor-core matmul; for more, both
operands' MXFP4 values as E4M3 with power-of-two row scales and the vendor's FP8 GEMM
(exact; GPUs with FP8 tensor cores), else as bf16 and the vendor's bf16 GEMM. On a CPU
it runs the reference: :func:`torq.formats.fake_quantize` on the activation and the
dequantized weight, which is the same arithmetic, so the same model code runs everywhere.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from torq.formats import dequantize, fake_quantize, get_format, quantize
from torq.formats.packed import PackedTensor
from torq.rotations.transform import BlockRotation

BLOCK = 32
# Up to this many tokens the default is a decode launch (1–4 tokens: gemv_i8).
DECODE_MAX_TOKENS = 16
# From this many tokens the default is the prefill path (the operands' MXFP4 values as
# E4M3 or bf16 and the vendor GEMM). Between the two the tensor-core decode launch is
# used; this boundary is an estimate (the scratch decode costs about as much as the
# decode launch at a few hundred tokens), not a measurement.
PREFILL_MIN_TOKENS = 256
# Scale bytes above this (block amax >= 2**115) overflow the kernel's bf16 decode.
MAX_KERNEL_SCALE_BYTE = 240
# FP8 prefill path: a row is written as Q(row) · 2**(FP8_ROW_HEADROOM − r), r its largest
# block exponent (at least FP8_MIN_ROW_EXPONENT); E4M3 holds it exactly when its block
# exponents lie within FP8_EXACT_SPAN of r (triton_mxfp4 repeats the first two).
FP8_ROW_HEADROOM = 6
FP8_MIN_ROW_EXPONENT = -120
FP8_EXACT_SPAN = 14

Backend = Literal["auto", "triton", "reference"]


KERNEL_KINDS = ("gemv_i8", "fp8_gemm", "dequant_gemm", "dot", "dot_scaled")


@dataclass(frozen=True)
class KernelConfig:
    """One kernel launch: which kernel, its tiles, and where the activation comes from.

    * ``kind``: ``"gemv_i8"`` (up to ``block_m`` = 1, 2 or 4 tokens, exact int8 ``dp4a``
      block dot products on the CUDA cores; ``a_mode`` 1: an int8 pre-pass quantizes the
      activation once, 0: each program quantizes its own K range, one token only),
      ``"dequant_gemm"`` (prefill: the weight is decoded to a bf16 scratch buffer and the
      vendor GEMM multiplies it with the activation's MXFP4 values; ``a_mode`` 1 there
      selects K permuted within blocks, and ``block_m`` / ``block_n`` the decode kernel's
      tile), ``"fp8_gemm"`` (prefill on GPUs with FP8 tensor cores: both operands'
      MXFP4 values written as E4M3 with one power-of-two scale per row, multiplied by the
      vendor's row-scaled FP8 GEMM; ``block_m`` × ``block_k`` is the activation pre-pass's
      tile, ``w_tile`` the weight decode's, ``fast_accum`` the GEMM's accumulation mode),
      ``"dot"`` (tensor cores, both operands decoded by hand) or ``"dot_scaled"``
      (tensor cores, the weight through Triton's ``tl.dot_scaled``).
    * ``a_mode``: 0, the matmul quantizes the raw activation itself (one launch); 1, a
      pre-pass packs it and the matmul decodes it; 2, a pre-pass writes its dequantized
      MXFP4 values (exact in bf16) and the matmul reads them.
    * ``swap_ab`` (``dot`` only): compute ``outᵀ = W · Aᵀ`` so that the decoded weight is
      the matrix unit's register operand.
    * ``split_k > 1`` splits the reduction over programs (atomic float32 adds).
    * ``prefetch`` (``gemv_i8``): load the next weight tile before multiplying the current
      one. ``pdl`` (``gemv_i8``; Hopper or later, else ignored): programmatic dependent
      launch, so the GEMV starts streaming its weights while the pre-pass runs.
      ``evict_first`` (``gemv_i8``): weight loads carry the evict-first cache hint.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    kind: str = "dot"
    a_mode: int = 0
    swap_ab: bool = False
    prefetch: bool = False
    pdl: bool = False
    w_tile: tuple[int, int] = (32, 256)
    fast_accum: bool = False
    evict_first: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KERNEL_KINDS:
            raise ValueError(f"unknown kernel kind {self.kind!r}")
        if self.a_mode not in (0, 1, 2):
            raise ValueError(f"a_mode must be 0, 1 or 2, got {self.a_mode}")
        if self.kind in ("dot_scaled",) and self.a_mode == 1:
            raise ValueError("dot_scaled reads the activation as values (a_mode 0 or 2)")
        if self.block_k % BLOCK:
            raise ValueError(f"block_k must be a multiple of {BLOCK}")
        if self.kind == "gemv_i8" and self.block_m not in (1, 2, 4):
            raise ValueError(f"gemv_i8 takes 1, 2 or 4 tokens (block_m), got {self.block_m}")
        if self.kind == "gemv_i8" and self.block_m > 1 and (self.a_mode, self.split_k) != (1, 1):
            raise ValueError("gemv_i8 on several tokens needs its pre-pass (a_mode 1), split_k 1")


# Defaults: the fastest launches of benchmarks/kernels.py on an H100 (docs/RESULTS.md §4)
# for the Llama-3-8B layer shapes.
GEMV_CONFIG = KernelConfig(
    block_m=1,
    block_n=4,
    block_k=4096,
    num_warps=4,
    kind="gemv_i8",
    a_mode=1,
    pdl=True,
    evict_first=True,
)
# 2–4 tokens: the integer GEMV with the weight lookups shared by the tokens (block_m is
# set to 2 or 4 by default_config).
ROWS_CONFIG = replace(GEMV_CONFIG, block_m=4, block_n=16, block_k=1024, prefetch=True)
DECODE_CONFIG = KernelConfig(block_m=16, block_n=32, block_k=256, split_k=4, num_warps=4, a_mode=2)
# Prefill: the FP8 path where it applies (see fp8_prefill_usable), else the bf16 one. One
# activation row per program, read once (block_k is widened to the row by default_config,
# up to FP8_ONE_TILE_MAX), and the exact (promoted) accumulation of the FP8 GEMM.
PREFILL_CONFIG = KernelConfig(
    block_m=1, block_n=0, block_k=4096, num_warps=8, kind="fp8_gemm", w_tile=(32, 512)
)
FP8_ONE_TILE_MAX = 16384
BF16_PREFILL_CONFIG = KernelConfig(
    block_m=16, block_n=512, block_k=32, kind="dequant_gemm", a_mode=1
)
QUANT_CONFIG = KernelConfig(block_m=32, block_n=0, block_k=128, num_warps=4, num_stages=1)


# (output blocks per program, input blocks per step) of the fused TORQ pre-pass.
TORQ_PREPASS_TILE = (2, 128)  # the fastest of benchmarks/kernels.py's sweep on an H100

# Launches measured fastest for (tokens, N, K), filled by benchmarks/kernels.py's sweep.
TUNED_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {}


def tuned_needs_plain_input(cfg: KernelConfig | None) -> bool:
    """Whether a launch cannot take a block transform (a gemv that quantizes in the matmul
    with fewer than 16 blocks of 32 per tile)."""
    if cfg is None or cfg.block_k >= 512:
        return False
    return cfg.kind == "gemv_i8" and cfg.a_mode == 0


def default_config(
    tokens: int, out_features: int, in_features: int, has_block_transform: bool
) -> KernelConfig:
    """The launch used for ``tokens`` rows unless the caller passes one."""
    tuned = TUNED_CONFIGS.get((tokens, out_features, in_features))
    transform_ok = not has_block_transform or not tuned_needs_plain_input(tuned)
    if tuned is not None and transform_ok:
        return tuned
    if tokens == 1:
        return GEMV_CONFIG
    if tokens <= 4:
        return replace(ROWS_CONFIG, block_m=2 if tokens == 2 else 4)
    if tokens <= DECODE_MAX_TOKENS or tokens < PREFILL_MIN_TOKENS:
        return DECODE_CONFIG
    kp = (in_features + BLOCK - 1) // BLOCK * BLOCK
    return replace(PREFILL_CONFIG, block_k=min(FP8_ONE_TILE_MAX, 1 << (kp - 1).bit_length()))


@functools.cache
def triton_importable() -> bool:
    """Whether Triton can be imported here (its kernels then run on CUDA or, with
    ``TRITON_INTERPRET=1``, in Triton's CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor, backend: Backend) -> bool:
    """Resolve ``backend`` for an input: Triton on CUDA (or in the interpreter), else reference."""
    if backend == "reference":
        return False
    runnable = triton_importable() and (x.is_cuda or interpreter_enabled())
    if backend == "triton":
        if not runnable:
            raise RuntimeError(
                "the Triton backend needs Triton and a CUDA tensor (or TRITON_INTERPRET=1 "
                "for Triton's CPU interpreter)"
            )
        return True
    return runnable and x.is_cuda


@dataclass
class MXFP4Weight:
    """A weight ``W [N, K]`` in packed MXFP4: ``codes uint8 [N, Kp/2]``, ``scales uint8
    [N, Kp/32]`` (E8M0), ``Kp = ceil(K/32)·32``; padding elements are code 0."""

    codes: torch.Tensor
    scales: torch.Tensor
    in_features: int
    # FP8 prefill path (fp8_rows): each row's shift r_n (int32 [N]), its scale
    # 2**(r_n − 6) (float32 [1, N]) and whether every row's values are exact in E4M3 after
    # it; computed on first use when not given, then cached.
    fp8_row_exponents: torch.Tensor | None = None
    fp8_exact: bool | None = None
    fp8_row_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> MXFP4Weight:
        """Quantize a float weight with the OCP scale rule (method notes, section 1)."""
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in], got shape {tuple(weight.shape)}")
        if not torch.isfinite(weight).all():
            raise ValueError("the weight holds NaN or Inf; refusing to pack it")
        packed = quantize(weight.detach(), get_format("mxfp4"))
        if int(packed.scales.max()) > MAX_KERNEL_SCALE_BYTE:
            raise ValueError("weight magnitudes of 2**115 or more are outside the kernel's range")
        packed_weight = cls(
            packed.codes.contiguous(), packed.scales.contiguous(), int(weight.shape[1])
        )
        packed_weight.fp8_rows()
        return packed_weight

    def fp8_rows(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Row shifts of the FP8 prefill path: ``(r int32 [N], scale float32 [1, N], exact)``.

        ``r_n`` is row ``n``'s largest block exponent (at least −120); the row is written
        in E4M3 as ``Q(W)_n · 2**(6 − r_n)`` and multiplied back by ``scale_n =
        2**(r_n − 6)``. E4M3 holds E2M1 values times ``2**j`` exactly for ``j`` in [−8, 6],
        so the row is exact iff every block holding a nonzero code has a scale of at least
        ``2**(r_n − 14)``; ``exact`` says whether that holds for every row (checked once per
        weight, cached)."""
        if self.fp8_row_exponents is None or self.fp8_exact is None:
            n = self.out_features
            exponents = self.scales.to(torch.int32) - 127
            rows = exponents.amax(dim=1).clamp(min=FP8_MIN_ROW_EXPONENT)
            nonzero = (self.codes.view(n, -1, 16) & 0x77).ne(0).any(dim=-1)
            low = exponents < rows[:, None] - FP8_EXACT_SPAN
            self.fp8_row_exponents = rows.to(torch.int32).contiguous()
            self.fp8_exact = not bool((low & nonzero).any())
        if self.fp8_row_scale is None:
            biased = self.fp8_row_exponents - FP8_ROW_HEADROOM + 127
            self.fp8_row_scale = (biased << 23).view(torch.float32).reshape(1, -1)
        return self.fp8_row_exponents, self.fp8_row_scale, self.fp8_exact

    def to_packed_tensor(self) -> PackedTensor:
        return PackedTensor(
            fmt=get_format("mxfp4"),
            codes=self.codes,
            scales=self.scales,
            tensor_scale=None,
            shape=(self.out_features, self.in_features),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.to_packed_tensor(), dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel()


def _check_block_transform(t: torch.Tensor | None) -> None:
    if t is not None and tuple(t.shape) != (BLOCK, BLOCK):
        raise ValueError(f"the block transform must be {BLOCK}×{BLOCK}, got {tuple(t.shape)}")


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
) -> torch.Tensor:
    """The fake-quant definition of :func:`mxfp4_linear`, computed in float32."""
    if block_transform is not None:
        x = apply_block_transform(x, block_transform)
    xq = fake_quantize(x.float(), get_format("mxfp4"))
    w = weight.dequantize(torch.float32).to(x.device)
    out = F.linear(xq, w, None if bias is None else bias.float())
    return out.to(x.dtype)


def _activation_2d(
    x: torch.Tensor, block_transform: torch.Tensor | None
) -> tuple[torch.Tensor, int, int, int]:
    """Check a pre-pass input: ``(x contiguous, M, K, Kp)`` with ``Kp`` K padded to 32."""
    _check_block_transform(block_transform)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation pre-pass on a 2-D ``x [M, K]``: (optional block transform, then)
    MXFP4 codes ``uint8 [M, Kp/2]`` and E8M0 scales ``uint8 [M, Kp/32]`` (paper eq. 1).

    With ``values_dtype``, it returns instead the dequantized values ``[M, Kp]`` in that
    dtype (exact in bf16 and float32) and an empty scale tensor; ``permuted`` writes each
    block of 32 as its even elements, then its odd ones (see :func:`dequantize_weight`)."""
    from torq.kernels import triton_mxfp4 as tk

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
    from torq.kernels import triton_mxfp4 as tk

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 prefill path's activation pre-pass on ``x [M, K]``: (optional block transform,
    then) the MXFP4 values ``Q(x)`` (paper eq. 1) as ``float8_e4m3fn [M, Kp]`` times
    ``2**(6 − r_m)`` and the row scales ``2**(r_m − 6)``, float32 ``[M, 1]``, with ``r_m``
    the row's largest block exponent: ``values · scale == Q(x)`` exactly for every block
    whose scale is at least ``2**(r_m − 14)``; the few smaller ones (a token whose blocks
    span more than 2**14) are rounded onto E4M3's subnormals. ``block``: rows per program
    and the K tile."""
    from torq.kernels import triton_mxfp4 as tk

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
        num_warps=num_warps,
    )
    return out, scale


def dequantize_weight_fp8(
    weight: MXFP4Weight, block: tuple[int, int] = (32, 256), num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed weight as ``float8_e4m3fn [N, Kp]`` with its row scales ``float32 [1, N]``
    (:meth:`MXFP4Weight.fp8_rows`): ``values · scale == Q(W)`` exactly when
    ``fp8_rows()`` says so. ``block``: the decode kernel's (rows, K) tile."""
    from torq.kernels import triton_mxfp4 as tk

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


def _transposed(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(dtype).T.contiguous()


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
) -> torch.Tensor:
    """``y = Q(T x) · Q(W)ᵀ + bias`` for packed MXFP4 ``W`` (paper Algorithm 3, option B).

    ``x [..., K]``; ``block_transform`` is an optional ``32×32`` matrix ``T`` applied to every
    block of 32 of ``x`` before quantization (a 32-point Hadamard, TORQ's intra-block
    rotation). The output has ``x``'s dtype. ``backend="auto"`` runs Triton on CUDA tensors
    and the reference elsewhere. ``out`` (2-D ``[tokens, N]``, ``x``'s dtype, contiguous) receives
    the result when given. ``rotation`` is an online transform applied to ``x`` first (a
    TORQ :class:`~torq.rotations.transform.BlockRotation`, or any module); with the
    integer GEMV and its pre-pass (``gemv_i8``, ``a_mode`` 1) a ``BlockRotation`` runs
    inside the pre-pass kernel, elsewhere as its torch module.
    """
    _check_block_transform(block_transform)
    fusable = block_transform is None and fusable_in_prepass(rotation)
    if x.shape[-1] != weight.in_features:
        raise ValueError(
            f"input width {x.shape[-1]} does not match the weight's {weight.in_features} inputs"
        )
    if not use_triton(x, backend):
        if rotation is not None:
            x = rotation(x)
        y = reference_linear(x, weight, bias, block_transform)
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
        _launch_gemv_i8(
            x2, weight, bias, block_transform, cfg, out, rotation if fuse_rotation else None
        )
        return out if result is not None else out.reshape(*lead, n)
    if cfg.kind in ("fp8_gemm", "dequant_gemm"):  # vendor GEMMs: no copy without `out`
        y = _launch_vendor_gemm(x2, weight, bias, block_transform, cfg)
        if out is None:
            return y.reshape(*lead, n)
        out.copy_(y)
        return out
    if cfg.split_k > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    elif out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(x2, weight, bias, block_transform, cfg, out)
    if result is not None:
        if result is not out:
            result.copy_(out)
        return result
    return out.to(x.dtype).reshape(*lead, n)


# Split-K workspaces of the integer GEMV, per (device, output width): a float32 [N]
# accumulator and an int32 counter per output tile, both zero between launches (the last
# program of each tile resets them). Launches on one device with the same width therefore
# must not run concurrently on two streams; use split_k=1 there.
_GEMV_WORKSPACES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _gemv_workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer GEMV's pre-pass on ``x [M, K]``: ``2·Q(x)`` as int8 ``[M, Kp]`` and the
    block scales over four, float32 ``[M, Kp/32]`` (paper eq. 1; NaN/Inf blocks: codes 0,
    scale NaN). A 32×32 ``block_transform`` ``T`` (``y_b = T x_b``) runs in the structured
    pre-pass of :func:`quantize_activation_torq_i8`, as its intra-block rotation ``Tᵀ``."""
    from torq.kernels import triton_mxfp4 as tk

    _check_block_transform(block_transform)
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D activation, got shape {tuple(x.shape)}")
    if block_transform is not None:
        return _structured_prepass(x, None, None, block_transform, pdl, transpose_intra=True)
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
    )
    return q, s


def fusable_in_prepass(rotation: nn.Module | None) -> bool:
    """Whether :func:`quantize_activation_torq_i8` can run ``rotation`` inside the integer
    GEMV's pre-pass: a :class:`BlockRotation` of 32-element blocks (the MX block the kernel
    quantizes) without a channel permutation (the pre-pass has no gather). Any other
    transform runs as its torch module before the plain pre-pass."""
    return (
        isinstance(rotation, BlockRotation)
        and rotation.block_size == BLOCK
        and getattr(rotation, "channel_perm", None) is None
    )


def quantize_activation_torq_i8(
    x: torch.Tensor,
    rotation: BlockRotation,
    pdl: bool = False,
    tile: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TORQ's online transform ``T x`` (channel scale, inter-block, intra-block; Section 5,
    Algorithm 3) fused into the integer GEMV's pre-pass: one kernel gives ``2·Q(T x)`` as
    int8 ``[M, d]`` and the block scales over four ``[M, d/32]``, as
    :func:`quantize_activation_i8` does for ``x``. ``tile``: output blocks per program and
    input blocks per step (default :data:`TORQ_PREPASS_TILE`)."""
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
        x, rotation.channel_scale, rotation.r_inter, rotation.r_intra, pdl, tile
    )


def _structured_prepass(
    x: torch.Tensor,
    channel_scale: torch.Tensor | None,
    r_inter: torch.Tensor | None,
    r_intra: torch.Tensor | None,
    pdl: bool,
    tile: tuple[int, int] | None = None,
    transpose_intra: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    from torq.kernels import triton_mxfp4 as tk

    m, d = x.shape
    if d % BLOCK:
        raise ValueError(f"an online transform needs a width divisible by {BLOCK}, got {d}")
    x = x.contiguous()
    nb = d // BLOCK
    q = torch.empty((m, d), dtype=torch.int8, device=x.device)
    s = torch.empty((m, nb), dtype=torch.float32, device=x.device)
    blocks_per_program, chunk = tile or TORQ_PREPASS_TILE
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
    )
    return q, s


def _pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs a Hopper or later GPU and a Triton with grid
    dependency control; elsewhere (the interpreter included) ``KernelConfig.pdl`` is off."""
    from torq.kernels import triton_mxfp4 as tk

    if interpreter_enabled() or tk.gdc_wait is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _launch_gemv_i8(
    x2: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None,
    block_transform: torch.Tensor | None,
    cfg: KernelConfig,
    out: torch.Tensor,
    rotation: BlockRotation | None = None,
) -> None:
    from torq.kernels import triton_mxfp4 as tk

    k = x2.shape[1]
    n = weight.out_features
    words = weight.codes.view(torch.int32)
    fused = cfg.a_mode == 0
    pdl = cfg.pdl and _pdl_supported(x2.device)
    if fused:
        xq, xs = x2, x2
    elif rotation is not None:
        q8, xs = quantize_activation_torq_i8(x2, rotation, pdl=pdl)
        xq = q8.view(torch.int32)
    else:
        q8, xs = quantize_activation_i8(x2, block_transform, pdl=pdl)
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
    ws, count = _gemv_workspace(x2.device, n) if cfg.split_k > 1 else (out, out)
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
        **options,
    )


def _launch_vendor_gemm(
    x2: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None,
    block_transform: torch.Tensor | None,
    cfg: KernelConfig,
) -> torch.Tensor:
    """The prefill paths: both operands' MXFP4 values in a format the vendor GEMM takes,
    then the vendor GEMM. ``fp8_gemm``: E4M3 with power-of-two row scales and the
    row-scaled FP8 GEMM (bf16 output on CUDA); ``dequant_gemm``: bf16 (float32 for float32
    inputs) and ``F.linear``. Returns ``[M, N]`` in ``x2``'s dtype."""
    if cfg.kind == "fp8_gemm":
        a, a_scale = quantize_activation_fp8(
            x2, block_transform, (cfg.block_m, cfg.block_k), cfg.num_warps
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
    a, _ = quantize_activation(x2, block_transform, values_dtype=values_dtype, permuted=permuted)
    block = (cfg.block_m or 32, cfg.block_n or 256)
    w_values = dequantize_weight(weight, values_dtype, block=block, permuted=permuted)
    b = None if bias is None else bias.to(values_dtype)
    return F.linear(a, w_values, b).to(x2.dtype)


def _launch(
    x2: torch.Tensor,
    weight: MXFP4Weight,
    bias: torch.Tensor | None,
    block_transform: torch.Tensor | None,
    cfg: KernelConfig,
    out: torch.Tensor,
) -> None:
    from torq.kernels import triton_mxfp4 as tk

    m, k = x2.shape
    n = weight.out_features
    dot_bf16 = not interpreter_enabled()
    even_k = k % cfg.block_k == 0  # then no tile needs a mask along K
    t_t = _transposed(block_transform, x2.dtype)
    if cfg.a_mode == 0:
        a, a_scales, stride_as = x2, x2, 0
    elif cfg.a_mode == 1:
        a, a_scales = quantize_activation(x2, block_transform)
        stride_as = a_scales.stride(0)
    else:
        values_dtype = torch.bfloat16 if dot_bf16 else torch.float32
        a, a_scales = quantize_activation(x2, block_transform, values_dtype=values_dtype)
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
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


class PackedMXFP4Linear(nn.Module):
    """A linear layer stored as packed MXFP4 (4.25 bits per weight) with W4A4 arithmetic.

    ``input_transform`` is the online transform ``T`` whose inverse was fused into the
    weight (``W' = W Tᵀ``): a ``32×32`` block matrix (``block_transform``) runs inside the
    kernel; a general module (for example TORQ's per-position inter-block rotation) runs
    before it in torch.
    """

    def __init__(
        self,
        weight: MXFP4Weight,
        bias: torch.Tensor | None = None,
        block_transform: torch.Tensor | None = None,
        input_transform: nn.Module | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        _check_block_transform(block_transform)
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.backend: Backend = backend
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("bias", bias)
        self.register_buffer("block_transform", block_transform)
        self.input_transform = input_transform
        # the FP8 prefill path's row shifts, derived from the scales (not saved; recomputed
        # when a state dict is loaded)
        self._set_fp8_rows(weight)

    def _set_fp8_rows(self, weight: MXFP4Weight) -> None:
        rows, scale, exact = weight.fp8_rows()
        self.register_buffer("fp8_row_exponents", rows, persistent=False)
        self.register_buffer("fp8_row_scale", scale, persistent=False)
        self.fp8_exact = exact

    def _load_from_state_dict(
        self, state_dict: dict[str, torch.Tensor], prefix: str, *args: object, **kwargs: object
    ) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[arg-type]
        # only when this layer's codes or scales were loaded (a model-wide load that leaves
        # this layer alone, e.g. one whose layers are offloaded to disk, keeps its rows)
        if f"{prefix}codes" in state_dict or f"{prefix}scales" in state_dict:
            self._set_fp8_rows(MXFP4Weight(self.codes, self.scales, self.in_features))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        block_transform: torch.Tensor | None = None,
        input_transform: nn.Module | None = None,
        backend: Backend = "auto",
    ) -> PackedMXFP4Linear:
        """Pack ``linear``'s (already transform-fused) weight; the bias stays in float."""
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(
            MXFP4Weight.from_float(linear.weight),
            bias,
            block_transform,
            input_transform,
            backend,
        )

    @property
    def weight_packed(self) -> MXFP4Weight:
        return MXFP4Weight(
            self.codes,
            self.scales,
            self.in_features,
            self.fp8_row_exponents,
            self.fp8_exact,
            self.fp8_row_scale,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return mxfp4_linear(
            x,
            self.weight_packed,
            bias,
            self.block_transform,
            backend=self.backend,
            rotation=self.input_transform,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, block_transform={self.block_transform is not None}"
        )
