"""Kernel launch configurations: which kernel runs for how many tokens, with what tiles.

The defaults are the fastest launches of ``benchmarks/kernel_speed.py`` on an H100 for the
Llama-3-8B layer shapes (``docs/research/kernels-and-gpus.md`` §4); :data:`TUNED_CONFIGS`
holds per-shape winners of that sweep. :mod:`torq.kernels.dispatch` picks a launch with
:func:`default_config`, :mod:`torq.kernels.launch` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

BLOCK = 32
# the activations' block-scale rules the pre-passes compute (:class:`torq.formats.FormatSpec`):
# OCP's, and the nearest rule of torq's default recipe and of compressed-tensors' loaders
SCALE_RULES: tuple[str, ...] = ("ocp", "nearest")
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
      ``evict_first`` (``gemv_i8``): weight loads have the evict-first cache hint.
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


# Defaults: the fastest launches of benchmarks/kernel_speed.py on an H100 for the Llama-3-8B
# layer shapes (docs/research/kernels-and-gpus.md §4).
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
TORQ_PREPASS_TILE = (2, 128)  # the fastest of benchmarks/kernel_speed.py's sweep on an H100

# Launches measured fastest for (tokens, N, K), filled by benchmarks/kernel_speed.py's sweep.
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
