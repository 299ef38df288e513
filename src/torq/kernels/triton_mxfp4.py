"""Triton kernels for real MXFP4 × MXFP4 inference (W4A4) on GPUs.

Bit layout (the one :mod:`torq.formats.packing` defines): two E2M1 codes per byte,
element ``2i`` in the low nibble, one E8M0 scale byte per block of 32 along the input
(reduction) dimension. A weight ``W [N, K]`` is stored as ``codes uint8 [N, Kp/2]`` and
``scales uint8 [N, Kp/32]`` with ``Kp = ceil(K/32)·32``.

Kernels (their launchers are in :mod:`torq.kernels.launch`, the default choice per token
count in :mod:`torq.kernels.config`; measurements in ``docs/research/kernels-and-gpus.md`` §4):

* :func:`_mx_gemv_i8_kernel`, one token (decode): since ``2·Q(x)`` and ``2·Q(W)`` are
  integers in [−12, 12], each block of 32 is an exact int32 dot product (``dp4a``),
  scaled once per block and accumulated in float32. Its activation pre-pass
  (:func:`_mx_quantize_i8_kernel`, or :func:`_mx_quantize_torq_i8_kernel` with TORQ's
  online transform fused in) writes ``2·Q(x)`` as int8 once per call.
  :func:`_mx_gemv_grouped_i8_kernel` is the same for a mixture of experts' decode: every
  (token, chosen expert) pair in one launch.
* :func:`_mx_quantize_kernel`, the activation pre-pass: ``x [M, K]`` (any float dtype)
  → optional block-diagonal ``32×32`` transform → packed codes and scale bytes (or their
  dequantized values), with the OCP scale rule of method notes section 1
  (``floor(log2 amax) − 2``, RNE, ±6 saturation, NaN/Inf blocks → scale 0xFF), bit for
  bit as :func:`torq.formats.quantize`.
* :func:`_mx_matmul_kernel`, ``out = Q(x) · Q(W)ᵀ (+ bias)`` on the tensor cores: the
  weight is decoded to bf16 inside the kernel (E2M1 × 2^e is exact in bf16) and multiplied
  with fp32 accumulation, so the result is the exact MXFP4 × MXFP4 product up to the order
  of accumulation (the 2–255-token path).
* :func:`_mx_dequantize_kernel`, the weight side of the bf16 prefill path: packed → bf16
  scratch copy for the vendor GEMM.
* :func:`_mx_quantize_fp8_kernel` and :func:`_mx_weight_fp8_kernel`, the FP8 prefill
  path: both operands' MXFP4 values as E4M3 with one power-of-two scale per row (exact
  when a row's block scales span at most 2**14), multiplied by the vendor's row-scaled
  FP8 GEMM.

Everything here runs under ``TRITON_INTERPRET=1`` on a CPU, which is how CI tests it.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch), Hopper and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: KernelConfig.pdl is refused by the launcher
    gdc_launch_dependents = gdc_wait = None

# 2**23: adding and subtracting it rounds a float32 in [0, 2**22) to the nearest
# integer, ties to even, with the hardware's default rounding.
_RNE_MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _block_exponent(amax, NEAREST: tl.constexpr):
    """The E8M0 exponent of blocks with the finite maximum magnitude ``amax``: the OCP rule
    ``floor(log2 amax) − 2`` (method notes sec. 1), with ``NEAREST`` one more when amax's
    significand is at least 1.75 (:func:`torq.formats.reference.mx_scale_exponent`'s
    ``nearest``), clamped to [−127, 126] (``amax`` = 0 or subnormal → −127)."""
    bits = amax.to(tl.int32, bitcast=True)
    e_field = (bits >> 23) & 0xFF
    if NEAREST:
        bump = ((bits & 0x7FFFFF) >= 0x600000).to(tl.int32)  # significand ≥ 1.75
        exponent = tl.minimum(tl.maximum(e_field - 129 + bump, -127), 126)
    else:
        exponent = tl.minimum(tl.maximum(e_field - 129, -127), 125)
    return exponent


@triton.jit
def _mx_block_scales(amax, has_nan, NEAREST: tl.constexpr = False):
    """E8M0 scale of blocks with maximum magnitude ``amax`` (OCP rule, method notes sec. 1;
    with ``NEAREST`` the nearest rule, :func:`_block_exponent`).

    Returns ``(scale_bytes int32, inverse_scale f32, scale f32)``: ``floor(log2 amax) − 2``
    clamped to E8M0's [−127, 127] (``amax`` = 0 or subnormal → −127), and NaN (byte 0xFF)
    for blocks holding NaN or ±Inf.
    """
    e_field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    is_nan = (e_field == 255) | has_nan
    exponent = _block_exponent(amax, NEAREST)
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
def _mx_quantize_tile(x, BM: tl.constexpr, BK: tl.constexpr, NEAREST: tl.constexpr = False):
    """MXFP4-quantize a ``[BM, BK]`` float32 tile along K in blocks of 32.

    Returns ``(codes int32 [BM, BK//32, 32], scale_bytes int32 [BM, BK//32],
    values float32 [BM, BK//32, 32])``: E2M1 codes (sign in bit 3), E8M0 bytes, and the
    dequantized values ``s_b · Q(x / s_b)`` (paper eq. 1). Same arithmetic as
    :func:`torq.formats.reference.mx_quantize_blocks` with the OCP scale.
    """
    xb = tl.reshape(x, (BM, BK // 32, 32))
    amax = tl.max(tl.abs(xb), axis=2)
    has_nan = tl.max((xb != xb).to(tl.int32), axis=2) > 0
    scale_byte, inv_scale, scale = _mx_block_scales(amax, has_nan, NEAREST)
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


@triton.jit
def _e2m1_twice(nibbles):
    """E2M1 codes → the integers ``2·value`` in [−12, 12] (int32)."""
    u = nibbles & 7
    big = (2 + (u & 1)) << tl.maximum((u >> 1) - 1, 0)
    v = tl.where(u < 4, u, big)
    return tl.where((nibbles & 8) != 0, -v, v)


# dp4a decode of eight E2M1 codes (one 32-bit word, element i in nibble i) against eight
# int8 activations (two words). The codes become the int8 values 2·E2M1 through byte
# lookups (``prmt``) into the table 0, 1, 2, 3, 4, 6, 8, 12; a selector nibble with bit 3
# (the sign) set returns 0x00 from a table of non-negative bytes (prmt's sign-replicate
# mode), so ``prmt(T, w)`` gives the magnitudes of the positive elements (negatives → 0)
# and ``prmt(T, w ^ 0x8888)`` those of the negative ones; the exact integer dot product is
# the difference of two unsigned × signed ``dp4a`` chains. $0: result, $1: the weight
# word, $2 / $3: the activation words of elements 0-3 / 4-7. 14 instructions per eight
# elements (docs/kernels.md has the variants measured).
_DP4A_E2M1_ASM = tl.constexpr("""{
.reg .b32 t0, t1, ng, wh, nh, p, q, a, b;
mov.b32 t0, 0x03020100;
mov.b32 t1, 0x0C080604;
xor.b32 ng, $1, 0x88888888;
shr.u32 wh, $1, 16;
shr.u32 nh, ng, 16;
prmt.b32 p, t0, t1, $1;
prmt.b32 q, t0, t1, ng;
dp4a.u32.s32 a, p, $2, 0;
dp4a.u32.s32 b, q, $2, 0;
prmt.b32 p, t0, t1, wh;
prmt.b32 q, t0, t1, nh;
dp4a.u32.s32 a, p, $3, a;
dp4a.u32.s32 b, q, $3, b;
sub.s32 $0, a, b;
}""")


def _dp4a_rows_asm(rows: int) -> str:
    """The same decode for ``rows`` tokens at once: the four lookups of a weight word are
    shared, each token adds its two ``dp4a`` chains and a subtraction (``$0 … $rows−1``:
    the results, ``$rows``: the weight word, then each token's two activation words)."""
    w = f"${rows}"
    lines = [
        "{",
        ".reg .b32 t0, t1, ng, wh, nh, p0, q0, p1, q1, a, b;",
        "mov.b32 t0, 0x03020100;",
        "mov.b32 t1, 0x0C080604;",
        f"xor.b32 ng, {w}, 0x88888888;",
        f"shr.u32 wh, {w}, 16;",
        "shr.u32 nh, ng, 16;",
        f"prmt.b32 p0, t0, t1, {w};",
        "prmt.b32 q0, t0, t1, ng;",
        "prmt.b32 p1, t0, t1, wh;",
        "prmt.b32 q1, t0, t1, nh;",
    ]
    for r in range(rows):
        lo, hi = f"${rows + 1 + 2 * r}", f"${rows + 2 + 2 * r}"
        lines += [
            f"dp4a.u32.s32 a, p0, {lo}, 0;",
            f"dp4a.u32.s32 a, p1, {hi}, a;",
            f"dp4a.u32.s32 b, q0, {lo}, 0;",
            f"dp4a.u32.s32 b, q1, {hi}, b;",
            f"sub.s32 ${r}, a, b;",
        ]
    return "\n".join([*lines, "}"])


_DP4A_E2M1_ROWS2_ASM = tl.constexpr(_dp4a_rows_asm(2))
_DP4A_E2M1_ROWS4_ASM = tl.constexpr(_dp4a_rows_asm(4))


@triton.jit
def _mx_quantize_i8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    PDL: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    NEAREST: tl.constexpr = False,
):
    """Activation pre-pass of the integer GEMV: ``x [M, K]`` → ``2·Q(x)`` as int8
    ``[M, Kp]`` (integers in [−12, 12]) and ``s_b / 4`` as float32 ``[M, Kp/32]`` (paper
    eq. 1, OCP scale), so that a block's dot product with a weight block is
    ``dp4a(2·Q(x), 2·Q(w)) · (s_b/4) · s_w``. NaN/Inf blocks: codes 0, scale NaN. With
    ``PDL`` it lets the GEMV that follows launch at once (programmatic dependent launch:
    the GEMV streams its weights meanwhile and waits for this kernel before it reads the
    activation)."""
    if PDL:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    m_ok = offs_m[:, None] < M
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
        mask=m_ok & (offs_k[None, :] < K),
        other=0.0,
    )
    q2, x_scale = _quantize_twice(tl.reshape(x.to(tl.float32), (BM * (BK // 32), 32)), NEAREST)
    kp = (K + 31) // 32 * 32
    tl.store(
        q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :],
        tl.reshape(q2, (BM, BK)).to(tl.int8),
        mask=m_ok & (offs_k[None, :] < kp),
    )
    offs_s = pid_k * (BK // 32) + tl.arange(0, BK // 32)
    tl.store(
        s_ptr + offs_m[:, None] * stride_sm + offs_s[None, :],
        tl.reshape(x_scale, (BM, BK // 32)),
        mask=m_ok & (offs_s[None, :] < kp // 32),
    )


@triton.jit
def _mx_quantize_torq_i8_kernel(
    x_ptr,
    cs_ptr,
    r_inter_ptr,
    r_intra_ptr,
    q_ptr,
    s_ptr,
    NB,
    stride_xm,
    stride_qm,
    stride_sm,
    HAS_SCALE: tl.constexpr,
    HAS_INTER: tl.constexpr,
    HAS_INTRA: tl.constexpr,
    TRANS_INTRA: tl.constexpr,
    PDL: tl.constexpr,
    BA: tl.constexpr,
    BB: tl.constexpr,
    NEAREST: tl.constexpr = False,
):
    """TORQ's online transform fused into the integer GEMV's pre-pass (paper Algorithm 3,
    the forward transform ``z = T x`` of Section 5, then eq. 1), for one token per row:
    ``x / s`` (the balancing channel scale), then per position ``k`` the inter-block
    rotation ``y[a, k] = Σ_b R_k[a, b] x[b, k]`` (``r_inter [32, NB, NB]``), then the
    intra-block rotation ``y_a ← y_a · R_intra`` (``r_intra [32, 32]``), then ``2·Q(y)``
    and ``s_b / 4`` as :func:`_mx_quantize_i8_kernel` writes them. Program ``(m, j)``
    produces output blocks ``j·BA … j·BA + BA − 1`` of token ``m``, reading the rotation
    rows it needs once (``32·BA·NB`` entries) and the token's ``x`` in chunks of ``BB``
    blocks; sums in float32. With ``TRANS_INTRA`` ``r_intra_ptr`` holds ``R_intraᵀ`` (a
    32×32 block transform ``T``, applied as ``y_a ← T y_a``)."""
    if PDL:
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_a = tl.program_id(1)
    offs_a = pid_a * BA + tl.arange(0, BA)
    a_ok = offs_a < NB
    pos = tl.arange(0, 32)
    x_row = x_ptr + pid_m * stride_xm
    if HAS_INTER:
        acc = tl.zeros((32, BA), dtype=tl.float32)  # y transposed: [position, block]
        for b0 in range(0, NB, BB):
            offs_b = b0 + tl.arange(0, BB)
            b_ok = offs_b < NB
            xt = tl.load(
                x_row + offs_b[None, :] * 32 + pos[:, None], mask=b_ok[None, :], other=0.0
            ).to(tl.float32)  # [32, BB]: x[b, k] at [k, b]
            if HAS_SCALE:
                cs = tl.load(
                    cs_ptr + offs_b[None, :] * 32 + pos[:, None], mask=b_ok[None, :], other=1.0
                ).to(tl.float32)
                xt = xt / cs
            r = tl.load(
                r_inter_ptr
                + pos[:, None, None] * NB * NB
                + offs_a[None, :, None] * NB
                + offs_b[None, None, :],
                mask=a_ok[None, :, None] & b_ok[None, None, :],
                other=0.0,
            ).to(tl.float32)  # [32, BA, BB]: R_k[a, b]
            acc += tl.sum(r * xt[:, None, :], axis=2)
        y = tl.trans(acc)  # [BA, 32]
    else:
        y = tl.load(x_row + offs_a[:, None] * 32 + pos[None, :], mask=a_ok[:, None], other=0.0).to(
            tl.float32
        )
        if HAS_SCALE:
            cs = tl.load(
                cs_ptr + offs_a[:, None] * 32 + pos[None, :], mask=a_ok[:, None], other=1.0
            )
            y = y / cs.to(tl.float32)
    if HAS_INTRA:
        if TRANS_INTRA:  # r_intra_ptr holds a block transform T: y_a · Tᵀ = T y_a
            r_intra = tl.load(r_intra_ptr + pos[None, :] * 32 + pos[:, None]).to(tl.float32)
        else:
            r_intra = tl.load(r_intra_ptr + pos[:, None] * 32 + pos[None, :]).to(tl.float32)
        y = tl.sum(y[:, :, None] * r_intra[None, :, :], axis=1)  # y_a · R_intra
    q2, x_scale = _quantize_twice(y, NEAREST)
    tl.store(
        q_ptr + pid_m * stride_qm + offs_a[:, None] * 32 + pos[None, :],
        q2.to(tl.int8),
        mask=a_ok[:, None],
    )
    tl.store(s_ptr + pid_m * stride_sm + offs_a, x_scale, mask=a_ok)


@triton.jit
def _quantize_twice(xb, NEAREST: tl.constexpr = False):
    """Blocks ``[R, 32]`` (float32) → ``(2·Q(x) int32 [R, 32], s_b / 4 float32 [R])``."""
    amax = tl.max(tl.abs(xb), axis=1)
    has_nan = tl.max((xb != xb).to(tl.int32), axis=1) > 0
    scale_byte, inv_scale, scale = _mx_block_scales(amax, has_nan, NEAREST)
    _, q = _e2m1_round(xb * inv_scale[:, None])
    q2 = tl.where(scale_byte[:, None] == 255, 0, (q * 2.0).to(tl.int32))
    return q2, scale * 0.25


@triton.jit
def _block_dots_i8(words, x_words, q2, USE_ASM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The exact integer products of one K tile's blocks of 32, float32 ``[BN, BK/32]``:
    ``words`` the packed weight rows (int32 ``[BN, BK/8]``, eight E2M1 codes a word),
    ``x_words`` the activation's ``2·Q(x)`` int8 values as int32 words in pairs
    (``[BK/8, 2]``: one weight word's eight inputs), ``q2`` the same values as integers (any
    shape of BK elements), read only by the plain-Triton path that replaces ``dp4a``
    without ``USE_ASM`` (Triton's interpreter)."""
    if not USE_ASM:
        nib = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF
        x8 = tl.reshape(q2, (BK // 8, 8))
        dots = tl.sum(_e2m1_twice(nib) * x8[None, :, :], axis=2)
    else:
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
    return tl.sum(tl.reshape(dots, (BN, BK // 32, 4)), axis=2).to(tl.float32)


@triton.jit
def _mx_gemv_i8_kernel(
    x_ptr,
    xq_ptr,
    xs_ptr,
    t_ptr,
    w_ptr,
    w_scales_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    count_ptr,
    N,
    K,
    stride_wn,
    stride_wsn,
    FUSED_QUANT: tl.constexpr,
    HAS_T: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    STREAM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NEAREST: tl.constexpr = False,
):
    """One token, exact integer block products: ``out [N] = Q(x) · Q(W)ᵀ + bias``.

    Both operands are MXFP4, so ``2·Q(x)`` and ``2·Q(W)`` are integers in [−12, 12]: each
    block of 32 is an exact int32 dot product (``dp4a``: four int8 products per
    instruction), scaled once by ``s_x · s_w / 4`` and accumulated in float32. ``w_ptr``
    is the packed weight viewed as int32 words (eight codes each, ``stride_wn`` in words).
    The activation comes from the int8 pre-pass (:func:`_mx_quantize_i8_kernel`: ``xq_ptr``
    as int32 words, ``xs_ptr`` the block scales over 4), so the weight stream is the
    kernel's only work; with ``FUSED_QUANT`` each program quantizes its own K range of the
    raw ``x_ptr`` instead (and ``HAS_T`` applies the 32×32 block transform there, on the
    tensor cores: ``BK ≥ 512``).
    With ``SPLIT_K > 1`` the partial sums go to a float32 workspace (``ws_ptr [N]``) and
    the last program of each output tile (a counter per tile, ``count_ptr``) writes the
    output in its dtype and zeroes both again: one launch, no memset, no cast. Without
    ``USE_ASM`` (Triton's interpreter) the same integers are computed in plain Triton.
    ``PREFETCH`` loads the next weight tile before the current one is multiplied. ``PDL``
    (programmatic dependent launch, GPU only): the first weight tile is loaded before
    waiting for the kernel before (the pre-pass) to finish; the weights must not be
    written by that kernel. ``STREAM``: the weight words are loaded with the evict-first
    cache hint (worth 1–1.4 µs a call on the large Llama-3-8B shapes on an H100).
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
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    s_rows = w_scales_ptr + offs_n[:, None] * stride_wsn
    if PREFETCH:  # the weights are constants: their first tile needs no wait
        # (an empty split loads a tile it never uses)
        first = tl.minimum(t_begin, t_end - 1)
        next_words, next_sb = _gemv_weight_tile(w_rows, s_rows, n_ok, first, kp, EVEN_K, BK, STREAM)
    if PDL:
        gdc_wait()  # the activation (and the output, the workspace) only from here on
    for tile in range(t_begin, t_end):
        k0 = tile * BK
        offs_s = k0 // 32 + tl.arange(0, BK // 32)
        s_in = (offs_s < kp // 32) | EVEN_K
        if PREFETCH:  # registers double-buffer the weight stream
            words, w_sb = next_words, next_sb
            ahead = tl.minimum(tile + 1, t_end - 1)  # the last tile again at the end: no mask
            next_words, next_sb = _gemv_weight_tile(
                w_rows, s_rows, n_ok, ahead, kp, EVEN_K, BK, STREAM
            )
        else:
            words, w_sb = _gemv_weight_tile(w_rows, s_rows, n_ok, tile, kp, EVEN_K, BK, STREAM)
        if FUSED_QUANT:
            offs_k = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + offs_k, mask=(offs_k < K) | EVEN_K, other=0.0).to(tl.float32)
            xb = tl.reshape(x, (BK // 32, 32))
            if HAS_T:  # t_ptr holds T (row-major); x_b · Tᵀ = T x_b
                r = tl.arange(0, 32)
                t_t = tl.load(t_ptr + r[None, :] * 32 + r[:, None]).to(tl.float32)
                xb = tl.dot(xb, t_t, input_precision="ieee", out_dtype=tl.float32)
            q2, x_scale = _quantize_twice(xb, NEAREST)
            x_words = tl.sum(tl.reshape(q2 & 0xFF, (BK // 8, 2, 4)) << byte_shift, axis=2)
        else:
            offs_xw = k0 // 4 + tl.arange(0, BK // 4)
            xw = tl.load(xq_ptr + offs_xw, mask=(offs_xw < kp // 4) | EVEN_K, other=0)
            x_scale = tl.load(xs_ptr + offs_s, mask=s_in, other=0.0)
            x_words = tl.reshape(xw, (BK // 8, 2))
            # the int8 values back, sign-extended (plain-Triton path only)
            q2 = tl.reshape((xw[:, None] << (24 - byte_shift)[None, :]) >> 24, (BK // 32, 32))
        block_dots = _block_dots_i8(words, x_words, q2, USE_ASM, BN, BK)
        w_scale = _e8m0_value(w_sb)
        acc += tl.sum(block_dots * (w_scale * x_scale[None, :]), axis=1)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        if pid_k == 0:
            acc += bias
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N)
    else:
        tl.atomic_add(ws_ptr + offs_n, acc, mask=offs_n < N, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sum is in before the count
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last program of this tile
            tl.debug_barrier()
            zero = tl.zeros((BN,), tl.float32)
            total = tl.atomic_add(ws_ptr + offs_n, zero, mask=offs_n < N)  # read through L2
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=offs_n < N)
            tl.store(ws_ptr + offs_n, zero, mask=offs_n < N)
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _mx_gemv_rows_i8_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    w_scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xq,
    stride_xs,
    stride_wn,
    stride_wsn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    STREAM: tl.constexpr,
    ROWS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``ROWS`` (2 or 4) tokens at once, ``M ≤ ROWS`` of them real: ``out [M, N] = Q(x) ·
    Q(W)ᵀ + bias`` with the integer block products of :func:`_mx_gemv_i8_kernel`. Each
    weight word is looked up once and multiplied with every token's int8 activation (from
    :func:`_mx_quantize_i8_kernel`), so the weight stream is shared by the tokens."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n[:, None] < N
    rows = tl.arange(0, ROWS)
    r_ok = rows < M
    kp = (K + 31) // 32 * 32
    k_tiles = tl.cdiv(kp, BK)
    acc = tl.zeros((ROWS, BN), dtype=tl.float32)
    byte_shift = 8 * tl.arange(0, 4)
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    s_rows = w_scales_ptr + offs_n[:, None] * stride_wsn
    if PREFETCH:
        next_words, next_sb = _gemv_weight_tile(w_rows, s_rows, n_ok, 0, kp, EVEN_K, BK, STREAM)
    if PDL:
        gdc_wait()
    for tile in range(0, k_tiles):
        k0 = tile * BK
        if PREFETCH:
            words, w_sb = next_words, next_sb
            ahead = tl.minimum(tile + 1, k_tiles - 1)
            next_words, next_sb = _gemv_weight_tile(
                w_rows, s_rows, n_ok, ahead, kp, EVEN_K, BK, STREAM
            )
        else:
            words, w_sb = _gemv_weight_tile(w_rows, s_rows, n_ok, tile, kp, EVEN_K, BK, STREAM)
        offs_xw = k0 // 4 + tl.arange(0, BK // 4)
        xw = tl.load(
            xq_ptr + rows[:, None] * stride_xq + offs_xw[None, :],
            mask=r_ok[:, None] & ((offs_xw[None, :] < kp // 4) | EVEN_K),
            other=0,
        )  # [ROWS, BK/4]
        offs_s = k0 // 32 + tl.arange(0, BK // 32)
        x_scale = tl.load(
            xs_ptr + rows[:, None] * stride_xs + offs_s[None, :],
            mask=r_ok[:, None] & ((offs_s[None, :] < kp // 32) | EVEN_K),
            other=0.0,
        )  # [ROWS, BK/32]
        w_scale = _e8m0_value(w_sb)
        if USE_ASM:
            x_lo, x_hi = tl.split(tl.reshape(xw, (ROWS, BK // 8, 2)))  # [ROWS, BK/8]
            shape: tl.constexpr = (BN, BK // 8)
            if ROWS == 2:
                x0_lo, x1_lo = tl.split(tl.permute(x_lo, (1, 0)))
                x0_hi, x1_hi = tl.split(tl.permute(x_hi, (1, 0)))
                d0, d1 = tl.inline_asm_elementwise(
                    asm=_DP4A_E2M1_ROWS2_ASM,
                    constraints="=r,=r,r,r,r,r,r",
                    args=[
                        words,
                        tl.broadcast_to(x0_lo[None, :], shape),
                        tl.broadcast_to(x0_hi[None, :], shape),
                        tl.broadcast_to(x1_lo[None, :], shape),
                        tl.broadcast_to(x1_hi[None, :], shape),
                    ],
                    dtype=(tl.int32, tl.int32),
                    is_pure=True,
                    pack=1,
                )
                dots = tl.join(d0, d1)  # [BN, BK/8, 2]
            else:
                x01_lo, x23_lo = tl.split(tl.permute(tl.reshape(x_lo, (2, 2, BK // 8)), (2, 1, 0)))
                x0_lo, x1_lo = tl.split(x01_lo)
                x2_lo, x3_lo = tl.split(x23_lo)
                x01_hi, x23_hi = tl.split(tl.permute(tl.reshape(x_hi, (2, 2, BK // 8)), (2, 1, 0)))
                x0_hi, x1_hi = tl.split(x01_hi)
                x2_hi, x3_hi = tl.split(x23_hi)
                d0, d1, d2, d3 = tl.inline_asm_elementwise(
                    asm=_DP4A_E2M1_ROWS4_ASM,
                    constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                    args=[
                        words,
                        tl.broadcast_to(x0_lo[None, :], shape),
                        tl.broadcast_to(x0_hi[None, :], shape),
                        tl.broadcast_to(x1_lo[None, :], shape),
                        tl.broadcast_to(x1_hi[None, :], shape),
                        tl.broadcast_to(x2_lo[None, :], shape),
                        tl.broadcast_to(x2_hi[None, :], shape),
                        tl.broadcast_to(x3_lo[None, :], shape),
                        tl.broadcast_to(x3_hi[None, :], shape),
                    ],
                    dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                    is_pure=True,
                    pack=1,
                )
                dots = tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (BN, BK // 8, 4))
            dots = tl.permute(dots, (2, 0, 1))  # [ROWS, BN, BK/8]
        else:
            nib = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF
            w2 = _e2m1_twice(nib)  # [BN, BK/8, 8]
            x8 = tl.reshape(
                (xw[:, :, None] << (24 - byte_shift)[None, None, :]) >> 24, (ROWS, BK // 8, 8)
            )
            dots = tl.sum(w2[None, :, :, :] * x8[:, None, :, :], axis=3)  # [ROWS, BN, BK/8]
        block_dots = tl.sum(tl.reshape(dots, (ROWS, BN, BK // 32, 4)), axis=3).to(tl.float32)
        acc += tl.sum(block_dots * (w_scale[None, :, :] * x_scale[:, None, :]), axis=2)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += bias[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & (offs_n[None, :] < N),
    )


@triton.jit
def _mx_gemv_grouped_i8_kernel(
    xq_ptr,
    xs_ptr,
    rows_ptr,
    experts_ptr,
    w_ptr,
    w_scales_ptr,
    out_ptr,
    N,
    K,
    stride_xq,
    stride_xs,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_out,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    STREAM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Mixture-of-experts decode, every chosen expert in one launch: slot ``s`` (the grid's
    second axis) computes ``out[s] = Q(x[rows[s]]) · Q(W_{experts[s]})ᵀ`` with the exact
    integer block products of :func:`_mx_gemv_i8_kernel` (its pre-pass path: ``xq_ptr``
    int32 words of ``2·Q(x)``, ``xs_ptr`` block scales over four). ``w_ptr`` holds every
    expert's packed weight as int32 words (``stride_we`` words an expert), ``w_scales_ptr``
    their scale bytes. One program per (output tile, slot): the experts' weights stream
    side by side instead of one launch per expert."""
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    row = tl.load(rows_ptr + slot).to(tl.int64)
    expert = tl.load(experts_ptr + slot).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n[:, None] < N
    kp = (K + 31) // 32 * 32
    acc = tl.zeros((BN,), dtype=tl.float32)
    byte_shift = 8 * tl.arange(0, 4)
    w_rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
    s_rows = w_scales_ptr + expert * stride_wse + offs_n[:, None] * stride_wsn
    for tile in range(0, tl.cdiv(kp, BK)):
        k0 = tile * BK
        offs_s = k0 // 32 + tl.arange(0, BK // 32)
        words, w_sb = _gemv_weight_tile(w_rows, s_rows, n_ok, tile, kp, EVEN_K, BK, STREAM)
        offs_xw = k0 // 4 + tl.arange(0, BK // 4)
        xw = tl.load(xq_ptr + row * stride_xq + offs_xw, mask=(offs_xw < kp // 4) | EVEN_K, other=0)
        x_scale = tl.load(
            xs_ptr + row * stride_xs + offs_s, mask=(offs_s < kp // 32) | EVEN_K, other=0.0
        )
        # the int8 values back, sign-extended (plain-Triton path only)
        q2 = (xw[:, None] << (24 - byte_shift)[None, :]) >> 24
        block_dots = _block_dots_i8(words, tl.reshape(xw, (BK // 8, 2)), q2, USE_ASM, BN, BK)
        acc += tl.sum(block_dots * (_e8m0_value(w_sb) * x_scale[None, :]), axis=1)
    tl.store(
        out_ptr + slot * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=offs_n < N
    )


@triton.jit
def _e8m0_value(scale_bytes):
    """E8M0 bytes → ``2**(e − 127)`` in float32 (byte 0: the subnormal ``2**-127``; byte
    255: NaN)."""
    e = scale_bytes.to(tl.int32)
    value = (e << 23).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, 5.877471754111438e-39, value)
    return tl.where(e == 255, float("nan"), value)


@triton.jit
def _gemv_weight_tile(
    w_rows, s_rows, n_ok, tile, kp, EVEN_K: tl.constexpr, BK: tl.constexpr, STREAM: tl.constexpr
):
    """Weight words ``int32 [BN, BK/8]`` and scale bytes ``[BN, BK/32]`` of one K tile
    (zeros past the padded width); ``w_rows`` / ``s_rows`` point at the program's rows.
    ``STREAM``: the words are loaded with the evict-first cache hint (read once)."""
    offs_w = tile * (BK // 8) + tl.arange(0, BK // 8)
    w_mask = n_ok & ((offs_w[None, :] < kp // 8) | EVEN_K)
    if STREAM:
        words = tl.load(
            w_rows + offs_w[None, :], mask=w_mask, other=0, eviction_policy="evict_first"
        )
    else:
        words = tl.load(w_rows + offs_w[None, :], mask=w_mask, other=0)
    offs_s = tile * (BK // 32) + tl.arange(0, BK // 32)
    sb = tl.load(
        s_rows + offs_s[None, :], mask=n_ok & ((offs_s[None, :] < kp // 32) | EVEN_K), other=0
    )
    return words, sb


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
    NEAREST: tl.constexpr = False,
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
    codes, scale_bytes, values = _mx_quantize_tile(x.to(tl.float32), BM, BK, NEAREST)
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
    NEAREST: tl.constexpr = False,
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
            _, _, a_values = _mx_quantize_tile(x.to(tl.float32), BM, BK, NEAREST)
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


# E4M3 (fp8 e4m3fn) holds every E2M1 value times 2**j exactly for j in [-8, 6]: with
# the row shift below, a row's values are exact when its block scales lie within 2**14 of
# its largest one.
FP8_ROW_HEADROOM = tl.constexpr(6)  # 6 · 2**6 = 384 ≤ 448, E4M3's largest finite value
FP8_MIN_ROW_EXPONENT = tl.constexpr(-120)  # keeps the row scale 2**(r − 6) a normal float32


@triton.jit
def _fp8_e4m3_bits(v):
    """float32 values on the E4M3 grid → their fp8 e4m3fn bit patterns (int32 0–255).

    Normal values (|v| ≥ 2**-6) keep their exponent and top three mantissa bits, so values
    with at most three mantissa bits (every E2M1 value times a power of two) are exact;
    below 2**-6 the value is rounded to the subnormal grid ``m · 2**-9`` (nearest, ties
    to even; 2**-10 and less → 0). NaN → 0x7F; magnitudes above 448 saturate to 448 (the
    callers keep |v| ≤ 384). Integer arithmetic only, so Triton's interpreter gives the
    same bits as the GPU."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = ((bits >> 23) & 0xFF) - 127
    normal = ((e + 7) << 3) | ((bits >> 20) & 7)
    a = tl.where(v != v, 0.0, tl.abs(v))
    sub = ((tl.minimum(a, 1.0) * 512.0 + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32)
    mag = tl.minimum(tl.where(e >= -6, normal, sub), 0x7E)
    mag = tl.where(v != v, 0x7F, mag)
    return sign | mag


@triton.jit
def _to_fp8_bits(v, HW_FP8: tl.constexpr):
    """:func:`_fp8_e4m3_bits` (int32), with ``HW_FP8`` through the GPU's own conversion
    (``cvt.rn.satfinite`` to E4M3: the same bits for values on the grid and NaN, in one
    instruction per two values)."""
    if HW_FP8:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        return _fp8_e4m3_bits(v)


@triton.jit
def _pow2(biased_exponent):
    """``2**(b − 127)`` in float32 for int32 ``b`` in [1, 254]."""
    return (biased_exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_rows(x_ptr, offs_m, m_ok, k0, K, stride_xm, BK: tl.constexpr):
    """Columns ``k0 … k0 + BK − 1`` of the rows ``offs_m`` (zeros past ``K`` or ``M``)."""
    offs_k = k0 + tl.arange(0, BK)
    return tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
        mask=m_ok & (offs_k[None, :] < K),
        other=0.0,
    )


@triton.jit
def _fp8_row_tile(
    x, t_ptr, HAS_T: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, NEAREST: tl.constexpr
):
    """One ``[BM, BK]`` tile of the FP8 activation pre-pass: the (block-transformed) values
    in float32 and each row's largest finite block exponent."""
    if HAS_T:
        x = _block_transform(x, t_ptr, BM, BK)
    xf = x.to(tl.float32)
    a = tl.abs(xf)
    amax = tl.max(tl.where(a <= 3.4e38, a, 0.0), axis=1)  # finite blocks only
    # the rule's exponent rises with amax, so the row's largest is its largest block's
    e = _block_exponent(amax, NEAREST)
    return xf, e


@triton.jit
def _fp8_store_row_values(
    xf,
    mult,
    out_ptr,
    offs_m,
    m_ok,
    k0,
    kp,
    stride_om,
    HW_FP8: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    NEAREST: tl.constexpr,
):
    _, _, values = _mx_quantize_tile(xf, BM, BK, NEAREST)
    bits = _to_fp8_bits(tl.reshape(values, (BM, BK)) * mult[:, None], HW_FP8)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_k[None, :],
        bits.to(tl.uint8),
        mask=m_ok & (offs_k[None, :] < kp),
    )


@triton.jit
def _mx_quantize_fp8_kernel(
    x_ptr,
    t_ptr,
    out_ptr,
    row_scale_ptr,
    M,
    K,
    stride_xm,
    stride_om,
    HAS_T: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HW_FP8: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    NEAREST: tl.constexpr = False,
):
    """Activation pre-pass of the FP8 prefill path: ``x [M, K]`` → (optional block transform)
    → the MXFP4 values ``Q(x)`` (paper eq. 1) as E4M3 ``[M, Kp]`` (``out_ptr``: their
    bytes) times ``2**(6 − r_m)``, and the row scale ``2**(r_m − 6)`` (float32 ``[M]``),
    where ``r_m`` is the row's largest block exponent (the block exponent of the row's
    largest finite magnitude, at least −120; NaN/Inf blocks are NaN as in eq. 1). Exact
    for blocks whose scale is at least ``2**(r_m − 14)``; smaller blocks are rounded to
    E4M3's subnormal grid (ties to even, tiny values to 0). ``ONE_TILE`` (``Kp ≤ BK``):
    the row is read once; otherwise twice, its largest magnitude first."""
    pid = tl.program_id(0)
    offs_m = pid * BM + tl.arange(0, BM)
    m_ok = offs_m[:, None] < M
    kp = (K + 31) // 32 * 32
    rmax = tl.full((BM,), FP8_MIN_ROW_EXPONENT, tl.int32)
    if ONE_TILE:
        x = _load_rows(x_ptr, offs_m, m_ok, 0, K, stride_xm, BK)
        xf, e = _fp8_row_tile(x, t_ptr, HAS_T, BM, BK, NEAREST)
        rmax = tl.maximum(rmax, e)
        mult = _pow2(-rmax + (127 + FP8_ROW_HEADROOM))  # 2**(6 − r_m)
        _fp8_store_row_values(
            xf, mult, out_ptr, offs_m, m_ok, 0, kp, stride_om, HW_FP8, BM, BK, NEAREST
        )
    else:
        for k0 in range(0, K, BK):
            x = _load_rows(x_ptr, offs_m, m_ok, k0, K, stride_xm, BK)
            _, e = _fp8_row_tile(x, t_ptr, HAS_T, BM, BK, NEAREST)
            rmax = tl.maximum(rmax, e)
        mult = _pow2(-rmax + (127 + FP8_ROW_HEADROOM))  # 2**(6 − r_m)
        for k0 in range(0, kp, BK):
            x = _load_rows(x_ptr, offs_m, m_ok, k0, K, stride_xm, BK)
            xf, _ = _fp8_row_tile(x, t_ptr, HAS_T, BM, BK, NEAREST)
            _fp8_store_row_values(
                xf, mult, out_ptr, offs_m, m_ok, k0, kp, stride_om, HW_FP8, BM, BK, NEAREST
            )
    scale = ((rmax - FP8_ROW_HEADROOM + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(row_scale_ptr + offs_m, scale, mask=offs_m < M)


@triton.jit
def _mx_weight_fp8_kernel(
    codes_ptr,
    scales_ptr,
    row_exp_ptr,
    out_ptr,
    N,
    KP,
    stride_cn,
    stride_sn,
    stride_on,
    HW_FP8: tl.constexpr,
    BR: tl.constexpr,
    BK: tl.constexpr,
):
    """Weight side of the FP8 prefill path: packed MXFP4 ``[N, KP/2]`` → E4M3 ``[N, KP]``
    (``out_ptr``: its bytes) holding ``Q(W) · 2**(6 − r_n)``, with ``r_n`` the row's
    shift (``row_exp_ptr``, int32 ``[N]``, from :meth:`MXFP4Weight.fp8_rows`). Exact when
    every nonzero block's scale is at least ``2**(r_n − 14)``, which the launcher checks
    once per weight."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = pid_r * BR + tl.arange(0, BR)
    offs_b = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    offs_s = pid_k * (BK // 32) + tl.arange(0, BK // 32)
    r_ok = offs_r[:, None] < N
    b_ok = r_ok & (offs_b[None, :] < KP // 2)
    packed = tl.load(codes_ptr + offs_r[:, None] * stride_cn + offs_b[None, :], mask=b_ok, other=0)
    sb = tl.load(
        scales_ptr + offs_r[:, None] * stride_sn + offs_s[None, :],
        mask=r_ok & (offs_s[None, :] < KP // 32),
        other=0,
    ).to(tl.int32)
    r = tl.load(row_exp_ptr + offs_r, mask=offs_r < N, other=0)
    # the E2M1 half-magnitudes are the values times 2**-14: scale by 2**(e − r + 6 + 14)
    ex = tl.maximum(sb - 127 - r[:, None] + FP8_ROW_HEADROOM + 14, -126)
    mult = ((ex + 127) << 23).to(tl.float32, bitcast=True)
    mult = tl.where(sb == 255, float("nan"), mult)
    p = packed.to(tl.int32)
    nibbles = tl.reshape(tl.join(p & 0xF, p >> 4), (BR, BK // 32, 32))
    values = tl.reshape(_e2m1_half_magnitudes(nibbles) * mult[:, :, None], (BR, BK))
    offs_k = pid_k * BK + tl.arange(0, BK)
    tl.store(
        out_ptr + offs_r[:, None] * stride_on + offs_k[None, :],
        _to_fp8_bits(values, HW_FP8).to(tl.uint8),
        mask=r_ok & (offs_k[None, :] < KP),
    )


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``, the number of tiles of ``b`` that cover ``a``."""
    return triton.cdiv(a, b)
