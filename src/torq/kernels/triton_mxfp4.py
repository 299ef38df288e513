"""Triton kernels for real MXFP4 × MXFP4 inference (W4A4) on GPUs.

Bit layout (the one :mod:`torq.formats.packing` defines): two E2M1 codes per byte,
element ``2i`` in the low nibble, one E8M0 scale byte per block of 32 along the input
(reduction) dimension. A weight ``W [N, K]`` is stored as ``codes uint8 [N, Kp/2]`` and
``scales uint8 [N, Kp/32]`` with ``Kp = ceil(K/32)·32``.

Kernels (the launcher and the default choice per token count are in
:mod:`torq.kernels.linear`; measurements in ``docs/RESULTS.md`` §4):

* :func:`_mx_gemv_dp4a_kernel`, one token (decode): the activation tile is quantized in
  the kernel; since ``2·Q(x)`` and ``2·Q(W)`` are integers in [−12, 12], each block of 32
  is an exact int32 dot product (``dp4a``), scaled once per block and accumulated in
  float32.
* :func:`_mx_quantize_kernel`, the activation pre-pass: ``x [M, K]`` (any float dtype)
  → optional block-diagonal ``32×32`` transform → packed codes and scale bytes (or their
  dequantized values), with the OCP scale rule of method notes section 1
  (``floor(log2 amax) − 2``, RNE, ±6 saturation, NaN/Inf blocks → scale 0xFF), bit for
  bit as :func:`torq.formats.quantize`.
* :func:`_mx_matmul_kernel`, ``out = Q(x) · Q(W)ᵀ (+ bias)`` on the tensor cores: the
  weight is decoded to bf16 inside the kernel (E2M1 × 2^e is exact in bf16) and multiplied
  with fp32 accumulation, so the result is the exact MXFP4 × MXFP4 product up to the order
  of accumulation (the 2–255-token path).
* :func:`_mx_dequantize_kernel`, the weight side of the prefill path: packed → bf16
  scratch copy for the vendor GEMM.

Everything here runs under ``TRITON_INTERPRET=1`` on a CPU, which is how CI tests it.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2**23: adding and subtracting it rounds a float32 in [0, 2**22) to the nearest
# integer, ties to even, with the hardware's default rounding.
_RNE_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _mx_block_scales(amax, has_nan):
    """E8M0 scale of blocks with maximum magnitude ``amax`` (OCP rule, method notes sec. 1).

    Returns ``(scale_bytes int32, inverse_scale f32, scale f32)``: ``floor(log2 amax) − 2``
    clamped to E8M0's [−127, 127] (``amax`` = 0 or subnormal → −127), and NaN (byte 0xFF)
    for blocks holding NaN or ±Inf.
    """
    e_field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    is_nan = (e_field == 255) | has_nan
    exponent = tl.minimum(tl.maximum(e_field - 129, -127), 125)
    scale_byte = tl.where(is_nan, 255, exponent + 127)
    inv_scale = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**-exponent
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(exponent == -127, 5.877471754111438e-39, scale)  # 2**-127, subnormal
    scale = tl.where(is_nan, float("nan"), scale)
    return scale_byte, inv_scale, scale


@triton.jit
def _e2m1_round(v):
    """Round ``v`` (already divided by its block scale) onto the E2M1 grid: nearest, ties to
    even, saturating at ±6 (paper eq. 1's ``Q``). Returns ``(codes int32, values f32)``."""
    a = tl.minimum(tl.abs(v), 6.0)
    big = a >= 4.0
    mid = a >= 2.0
    # the E2M1 grid step in each binade is 0.5 / 1 / 2; a / step is exact
    inv_step = tl.where(big, 0.5, tl.where(mid, 1.0, 2.0))
    t = (a * inv_step + _RNE_MAGIC) - _RNE_MAGIC
    index = t.to(tl.int32) + tl.where(big, 4, tl.where(mid, 2, 0))
    sign = (v.to(tl.int32, bitcast=True) >> 28) & 8
    step = tl.where(big, 2.0, tl.where(mid, 1.0, 0.5))
    magnitude = t * step
    return index | sign, tl.where(sign != 0, -magnitude, magnitude)


@triton.jit
def _mx_quantize_tile(x, BM: tl.constexpr, BK: tl.constexpr):
    """MXFP4-quantize a ``[BM, BK]`` float32 tile along K in blocks of 32.

    Returns ``(codes int32 [BM, BK//32, 32], scale_bytes int32 [BM, BK//32],
    values float32 [BM, BK//32, 32])``: E2M1 codes (sign in bit 3), E8M0 bytes, and the
    dequantized values ``s_b · Q(x / s_b)`` (paper eq. 1). Same arithmetic as
    :func:`torq.formats.reference.mx_quantize_blocks` with the OCP scale.
    """
    xb = tl.reshape(x, (BM, BK // 32, 32))
    amax = tl.max(tl.abs(xb), axis=2)
    has_nan = tl.max((xb != xb).to(tl.int32), axis=2) > 0
    scale_byte, inv_scale, scale = _mx_block_scales(amax, has_nan)
    codes, q = _e2m1_round(xb * inv_scale[:, :, None])
    codes = tl.where(scale_byte[:, :, None] == 255, 0, codes)
    return codes, scale_byte, q * scale[:, :, None]


@triton.jit
def _e2m1_half_magnitudes(nibbles):
    """E2M1 codes → their values times 2**-14, as float32, through the fp16 bit pattern
    ``(n & 7) << 9 | (n & 8) << 12`` (exact: code 1, the value 0.5, is fp16's subnormal)."""
    half_bits = ((nibbles & 7) << 9) | ((nibbles & 8) << 12)
    return half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e8m0_times_2_14(scale_bytes):
    """E8M0 bytes → ``2**(e + 14)`` in float32 (bits ``(byte + 14) << 23``); bytes above 240
    (block amax ≥ 2**115) overflow to inf, byte 255 is NaN."""
    sb = scale_bytes.to(tl.int32)
    scale = ((tl.minimum(sb, 241) + 14) << 23).to(tl.float32, bitcast=True)
    return tl.where(sb == 255, float("nan"), scale)


@triton.jit
def _pack_codes(codes, BM: tl.constexpr, BK: tl.constexpr):
    """``int32 [BM, BK//32, 32]`` codes → ``uint8 [BM, BK//2]``, element 2i in the low nibble."""
    pairs = tl.reshape(codes, (BM, BK // 2, 2))
    low, high = tl.split(pairs)
    return (low | (high << 4)).to(tl.uint8)


# dp4a decode of eight E2M1 codes (one 32-bit word, element i in nibble i) against eight
# int8 activations (two words): the codes become the int8 values 2·E2M1 through byte
# lookups (``prmt``) into a positive and a negative table, selected per byte by the sign
# bit; two ``dp4a`` give the exact integer dot product. $0: result, $1: the weight word,
# $2 / $3: the activation words of elements 0-3 / 4-7.
_DP4A_E2M1_ASM = tl.constexpr("""{
.reg .b32 c, ch, lp0, lp1, ln0, ln1, p, n, m, sel, zero, ones, w0, w1, acc;
mov.b32 lp0, 0x03020100;
mov.b32 lp1, 0x0C080604;
mov.b32 ln0, 0xFDFEFF00;
mov.b32 ln1, 0xF4F8FAFC;
mov.b32 zero, 0;
mov.b32 ones, 0xFFFFFFFF;
and.b32 c, $1, 0x77777777;
shr.u32 ch, c, 16;
prmt.b32 p, lp0, lp1, c;
prmt.b32 n, ln0, ln1, c;
shr.u32 sel, $1, 1;
and.b32 sel, sel, 0x4444;
prmt.b32 m, zero, ones, sel;
lop3.b32 w0, n, p, m, 0xE4;
prmt.b32 p, lp0, lp1, ch;
prmt.b32 n, ln0, ln1, ch;
shr.u32 sel, $1, 17;
and.b32 sel, sel, 0x4444;
prmt.b32 m, zero, ones, sel;
lop3.b32 w1, n, p, m, 0xE4;
dp4a.s32.s32 acc, w0, $2, 0;
dp4a.s32.s32 $0, w1, $3, acc;
}""")


@triton.jit
def _e2m1_twice(nibbles):
    """E2M1 codes → the integers ``2·value`` in [−12, 12] (int32)."""
    u = nibbles & 7
    big = (2 + (u & 1)) << tl.maximum((u >> 1) - 1, 0)
    v = tl.where(u < 4, u, big)
    return tl.where((nibbles & 8) != 0, -v, v)


@triton.jit
def _mx_gemv_dp4a_kernel(
    x_ptr,
    t_ptr,
    w_ptr,
    w_scales_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_wsn,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    HAS_T: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """One token, exact integer arithmetic: ``out [N] = Q(x) · Q(W)ᵀ + bias``.

    Both operands are MXFP4, so ``2·Q(x)`` and ``2·Q(W)`` are integers in [−12, 12]: each
    block of 32 is an exact int32 dot product (``dp4a``: four int8 products per
    instruction), scaled once by ``s_x · s_w / 4`` and accumulated in float32. ``w_ptr``
    is the packed weight viewed as int32 words (eight codes each, ``stride_wn`` in
    words). Without ``USE_ASM`` (Triton's interpreter) the same integers are computed in
    plain Triton. ``HAS_T`` applies the 32×32 block transform (``t_ptr`` holds ``Tᵀ``) to the
    activation tile first, on the tensor cores (needs ``BK ≥ 512``: 16 blocks per dot).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n[:, None] < N
    kp = (K + 31) // 32 * 32
    k_tiles = tl.cdiv(kp, BK)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    acc = tl.zeros((BN,), dtype=tl.float32)
    byte_shift = 8 * tl.arange(0, 4)
    for tile in range(t_begin, t_end):
        k0 = tile * BK
        offs_k = k0 + tl.arange(0, BK)
        if EVEN_K:
            x = tl.load(x_ptr + offs_k).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        xb = tl.reshape(x, (BK // 32, 32))
        if HAS_T:
            r = tl.arange(0, 32)
            t_t = tl.load(t_ptr + r[:, None] * 32 + r[None, :]).to(tl.float32)
            xb = tl.dot(xb, t_t, input_precision="ieee", out_dtype=tl.float32)
        amax = tl.max(tl.abs(xb), axis=1)
        has_nan = tl.max((xb != xb).to(tl.int32), axis=1) > 0
        _, inv_scale, x_scale = _mx_block_scales(amax, has_nan)
        _, q = _e2m1_round(xb * inv_scale[:, None])
        q2 = (q * 2.0).to(tl.int32)  # [BK/32, 32], integers in [-12, 12]
        offs_w = k0 // 8 + tl.arange(0, BK // 8)
        w_ok = n_ok & ((offs_w[None, :] < kp // 8) | EVEN_K)
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :], mask=w_ok, other=0)
        if USE_ASM:
            xq = tl.reshape(q2 & 0xFF, (BK // 8, 2, 4))
            x_words = tl.sum(xq << byte_shift[None, None, :], axis=2)  # bytes do not overlap
            x_lo, x_hi = tl.split(x_words)
            dots = tl.inline_asm_elementwise(
                asm=_DP4A_E2M1_ASM,
                constraints="=r,r,r,r",
                args=[
                    words,
                    tl.broadcast_to(x_lo[None, :], (BN, BK // 8)),
                    tl.broadcast_to(x_hi[None, :], (BN, BK // 8)),
                ],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:
            nib = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF
            w2 = _e2m1_twice(nib)  # [BN, BK/8, 8]
            x8 = tl.reshape(q2, (BK // 8, 8))
            dots = tl.sum(w2 * x8[None, :, :], axis=2)
        block_dots = tl.sum(tl.reshape(dots, (BN, BK // 32, 4)), axis=2).to(tl.float32)
        offs_s = k0 // 32 + tl.arange(0, BK // 32)
        s_ok = n_ok & ((offs_s[None, :] < kp // 32) | EVEN_K)
        w_sb = tl.load(
            w_scales_ptr + offs_n[:, None] * stride_wsn + offs_s[None, :], mask=s_ok, other=0
        ).to(tl.int32)
        w_scale = (w_sb << 23).to(tl.float32, bitcast=True)
        w_scale = tl.where(w_sb == 0, 5.877471754111438e-39, w_scale)  # 2**-127
        w_scale = tl.where(w_sb == 255, float("nan"), w_scale)
        acc += tl.sum(block_dots * (w_scale * (x_scale * 0.25)[None, :]), axis=1)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        if SPLIT_K == 1 or pid_k == 0:
            acc += bias
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)
    else:
        tl.atomic_add(out_ptr + offs_n, acc, mask=offs_n < N)


@triton.jit
def _mx_dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    N,
    KP,
    stride_cn,
    stride_sn,
    stride_on,
    PERMUTED: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
):
    """Packed MXFP4 ``[N, KP/2]`` → bf16 ``[N, KP]`` (exact): the weight side of the prefill
    path that hands the product to the vendor bf16 GEMM.

    With ``PERMUTED`` each block of 32 is written as its 16 even elements, then its 16 odd
    ones (the low nibbles, then the high nibbles), so no interleaving is needed; the
    activation pre-pass writes the same order, and a product over K does not depend on
    the order of K."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = pid_r * BR + tl.arange(0, BR)
    offs_b = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    offs_s = pid_k * (BK // 32) + tl.arange(0, BK // 32)
    offs_k = pid_k * BK + tl.arange(0, BK)
    r_ok = offs_r[:, None] < N
    packed = tl.load(
        codes_ptr + offs_r[:, None] * stride_cn + offs_b[None, :],
        mask=r_ok & (offs_b[None, :] < KP // 2),
        other=0,
    )
    sb = tl.load(
        scales_ptr + offs_r[:, None] * stride_sn + offs_s[None, :],
        mask=r_ok & (offs_s[None, :] < KP // 32),
        other=0,
    )
    if PERMUTED:
        p = tl.reshape(packed.to(tl.int32), (BR, BK // 32, 16))
        scale = _e8m0_times_2_14(sb)[:, :, None]
        lo = (_e2m1_half_magnitudes(p & 0xF) * scale).to(out_ptr.dtype.element_ty)
        hi = (_e2m1_half_magnitudes(p >> 4) * scale).to(out_ptr.dtype.element_ty)
        blk = pid_k * (BK // 32) + tl.arange(0, BK // 32)
        pos = blk[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]
        ptrs = out_ptr + offs_r[:, None, None] * stride_on + pos
        ok = (offs_r[:, None, None] < N) & (pos < KP)
        tl.store(ptrs, lo, mask=ok)
        tl.store(ptrs + 16, hi, mask=ok)
    else:
        values = _decode_to_bf16(packed, sb, BR, BK, True)
        tl.store(
            out_ptr + offs_r[:, None] * stride_on + offs_k[None, :],
            values.to(out_ptr.dtype.element_ty),
            mask=r_ok & (offs_k[None, :] < KP),
        )


@triton.jit
def _decode_to_bf16(packed, scale_bytes, R: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr):
    """Packed codes ``uint8 [R, BK//2]`` and E8M0 bytes ``[R, BK//32]`` → bf16 ``[R, BK]``
    (float32 when not ``DOT_BF16``: the same values, for Triton's interpreter).

    Each nibble ``n`` becomes the fp16 bit pattern ``(n & 7) << 9 | (n & 8) << 12``, which
    is the E2M1 value times 2**-14 exactly (its subnormal 0.5 lands on fp16's subnormal);
    multiplying by ``2**(e + 14)`` in float32 and rounding to bf16 is exact.
    """
    p = packed.to(tl.int32)
    nibbles = tl.reshape(tl.join(p & 0xF, p >> 4), (R, BK // 32, 32))
    values = _e2m1_half_magnitudes(nibbles) * _e8m0_times_2_14(scale_bytes)[:, :, None]
    return _dot_operand(tl.reshape(values, (R, BK)), DOT_BF16)


@triton.jit
def _dot_operand(values, DOT_BF16: tl.constexpr):
    """Operands on the MXFP4 grid are exact in bf16, the tensor cores' input type. Triton's
    CPU interpreter multiplies bf16 tensors as their raw 16-bit patterns (its
    ``create_dot`` passes the uint16 storage to numpy), so under the interpreter the
    operands stay float32: the same values, hence the same products."""
    if DOT_BF16:
        return values.to(tl.bfloat16)
    else:
        return values


@triton.jit
def _mx_quantize_kernel(
    x_ptr,
    t_ptr,
    codes_ptr,
    scales_ptr,
    M,
    K,
    stride_xm,
    stride_cm,
    stride_sm,
    HAS_T: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
    PERMUTED: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """Activation pre-pass: ``x [M, K]`` → (optional ``x_blocks · Tᵀ``) → codes and scales,
    or, with ``WRITE_VALUES``, the dequantized MXFP4 values ``[M, Kp]`` into ``codes_ptr``
    (stride ``stride_cm``; exact in bf16)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if HAS_T:
        x = _block_transform(x, t_ptr, BM, BK)
    codes, scale_bytes, values = _mx_quantize_tile(x.to(tl.float32), BM, BK)
    kp = (K + 31) // 32 * 32
    if WRITE_VALUES and PERMUTED:  # per block of 32: even elements, then odd ones
        even, odd = tl.split(tl.reshape(values, (BM, BK // 32, 16, 2)))
        blk = pid_k * (BK // 32) + tl.arange(0, BK // 32)
        pos = blk[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]
        ptrs = codes_ptr + offs_m[:, None, None] * stride_cm + pos
        ok = (offs_m[:, None, None] < M) & (pos < kp)
        tl.store(ptrs, even.to(codes_ptr.dtype.element_ty), mask=ok)
        tl.store(ptrs + 16, odd.to(codes_ptr.dtype.element_ty), mask=ok)
    elif WRITE_VALUES:
        tl.store(
            codes_ptr + offs_m[:, None] * stride_cm + offs_k[None, :],
            tl.reshape(values, (BM, BK)).to(codes_ptr.dtype.element_ty),
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < kp),
        )
    else:
        packed = _pack_codes(codes, BM, BK)
        offs_b = pid_k * (BK // 2) + tl.arange(0, BK // 2)
        tl.store(
            codes_ptr + offs_m[:, None] * stride_cm + offs_b[None, :],
            packed,
            mask=(offs_m[:, None] < M) & (offs_b[None, :] < kp // 2),
        )
        offs_s = pid_k * (BK // 32) + tl.arange(0, BK // 32)
        tl.store(
            scales_ptr + offs_m[:, None] * stride_sm + offs_s[None, :],
            scale_bytes.to(tl.uint8),
            mask=(offs_m[:, None] < M) & (offs_s[None, :] < kp // 32),
        )


@triton.jit
def _block_transform(x, t_ptr, BM: tl.constexpr, BK: tl.constexpr):
    """``x [BM, BK]`` with every block of 32 along K multiplied by ``Tᵀ`` (``t_ptr`` holds
    ``Tᵀ`` as a row-major 32×32 matrix in x's dtype): the online block-diagonal transform
    (a 32-point Hadamard, or TORQ's intra-block rotation)."""
    r = tl.arange(0, 32)
    t_t = tl.load(t_ptr + r[:, None] * 32 + r[None, :])
    blocks = tl.reshape(x, (BM * (BK // 32), 32))
    y = tl.dot(blocks, t_t, input_precision="ieee", out_dtype=tl.float32)
    return tl.reshape(y, (BM, BK))


@triton.jit
def _mx_matmul_kernel(
    a_ptr,
    a_scales_ptr,
    t_ptr,
    w_ptr,
    w_scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    A_MODE: tl.constexpr,
    HAS_T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``out [M, N] = Q(A) · Q(W)ᵀ + bias`` with both operands decoded to bf16 in-kernel.

    ``A_MODE`` says what ``a_ptr`` holds: 0, the raw activation ``[M, K]``, each tile
    (transformed and) quantized here; 1, the packed activation and its scales from
    :func:`_mx_quantize_kernel`; 2, the pre-pass's dequantized MXFP4 values (exact in
    bf16). The weight is decoded by hand (``DOT_SCALED`` false) or by Triton's
    ``tl.dot_scaled`` with ``e2m1`` weights, which on Hopper also upcasts to bf16 for the
    tensor cores. With ``SPLIT_K > 1`` the K range is
    split over ``program_id(2)`` and partial sums are added atomically into a zeroed
    float32 output.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    kp = (K + 31) // 32 * 32
    k_tiles = tl.cdiv(kp, BK)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, k_tiles)
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    acc_shape: tl.constexpr = (BN, BM) if SWAP_AB else (BM, BN)
    acc = tl.zeros(acc_shape, dtype=tl.float32)
    for tile in range(t_begin, t_end):
        k0 = tile * BK
        offs_b = k0 // 2 + tl.arange(0, BK // 2)
        offs_s = k0 // 32 + tl.arange(0, BK // 32)
        b_ok = (offs_b[None, :] < kp // 2) | EVEN_K
        s_ok = (offs_s[None, :] < kp // 32) | EVEN_K
        if A_MODE == 0:
            offs_k = k0 + tl.arange(0, BK)
            x = tl.load(
                a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                mask=m_ok & ((offs_k[None, :] < K) | EVEN_K),
                other=0.0,
            )
            if HAS_T:
                x = _block_transform(x, t_ptr, BM, BK)
            _, _, a_values = _mx_quantize_tile(x.to(tl.float32), BM, BK)
            a = _dot_operand(tl.reshape(a_values, (BM, BK)), DOT_BF16)
        elif A_MODE == 2:
            offs_k = k0 + tl.arange(0, BK)
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                mask=m_ok & ((offs_k[None, :] < K) | EVEN_K),
                other=0.0,
            )
            a = _dot_operand(a.to(tl.float32), DOT_BF16)
        else:
            a_packed = tl.load(
                a_ptr + offs_m[:, None] * stride_am + offs_b[None, :], mask=m_ok & b_ok, other=0
            )
            a_sb = tl.load(
                a_scales_ptr + offs_m[:, None] * stride_asm + offs_s[None, :],
                mask=m_ok & s_ok,
                other=0,
            )
            a = _decode_to_bf16(a_packed, a_sb, BM, BK, DOT_BF16)
        w_packed = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=n_ok & b_ok, other=0
        )
        w_sb = tl.load(
            w_scales_ptr + offs_n[:, None] * stride_wsn + offs_s[None, :],
            mask=n_ok & s_ok,
            other=0,
        )
        if DOT_SCALED:
            a16 = a.to(tl.bfloat16)  # the interpreter handles bf16 in dot_scaled correctly
            acc = tl.dot_scaled(a16, None, "bf16", tl.trans(w_packed), w_sb, "e2m1", acc)
        elif SWAP_AB:  # outᵀ = W · Aᵀ: the decoded weight is the register operand
            w = _decode_to_bf16(w_packed, w_sb, BN, BK, DOT_BF16)
            acc = tl.dot(w, tl.trans(a), acc, out_dtype=tl.float32)
        else:
            w = _decode_to_bf16(w_packed, w_sb, BN, BK, DOT_BF16)
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.float32)
    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        if SPLIT_K == 1 or pid_k == 0:
            acc += bias[None, :]
    out_mask = m_ok & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)
