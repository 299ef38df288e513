"""Every number that defines the 4-bit formats, stated once.

Sources: the OCP Microscaling Formats (MX) v1.0 specification (E2M1 elements in
section 5.3.3, E8M0 scales in section 5.4.1, the scale rule in section 6.3), NVIDIA's
NVFP4 (E2M1 elements, FP8 E4M3 block scale, FP32 tensor scale) and the project's
method notes, section 1.
"""

# FP4 E2M1 element: 1 sign, 2 exponent, 1 mantissa bit, no Inf/NaN encodings.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # 6 = 1.5 * 2**2
E2M1_MAX_SIGNIFICAND = 1.5
E2M1_EMIN = 0  # smallest normal binade; below it the grid is subnormal (step 0.5)
E2M1_MANTISSA_BITS = 1
E2M1_SIGN_BIT = 0b1000

# INT4 element of MXINT4: two's complement k in [-7, 7] standing for k / 4; -8 is unused
# so the grid is symmetric, as for OCP MXINT8.
INT4_MAX_CODE = 7
INT4_FRACTION_BITS = 2  # value = k * 2**-2, so the largest magnitude is 1.75 < 2**1
INT4_EMAX = 0

# E8M0 shared scale: an 8-bit biased power-of-two exponent, no sign, no mantissa.
E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E8M0_NAN = 0xFF

# FP8 E4M3 block scale of NVFP4 (torch.float8_e4m3fn): used only in its normal range.
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
# FP8 E4M3 element of MXFP8 (OCP MX v1.0, section 5.3.2): 448 = 1.75 * 2**8, so the OCP
# scale rule is floor(log2 amax) - 8 and elements past 448 saturate.
E4M3_EMAX = 8
E4M3_MAX_SIGNIFICAND = 1.75

# Block sizes along the last (reduction) dimension.
MX_BLOCK_SIZE = 32  # MXFP4, MXINT4 and MXFP8
NVFP4_BLOCK_SIZE = 16

# The NVFP4 FP32 tensor scale maps the tensor amax onto the largest product of a block
# scale and an element: amax_tensor / (E4M3_MAX * E2M1_MAX).
NVFP4_TENSOR_SCALE_DIVISOR = E4M3_MAX * E2M1_MAX
# "Four Over Six" (NVFP4 scale_mode "4over6"): a block may instead take the scale that maps
# its amax onto 4, 1.5 times NVFP4's, where that rounds the block with less squared error.
FOUR_OVER_SIX_EXPANSION = E2M1_MAX / 4.0
# Smallest tensor scale s with (1 / s) / E4M3_MIN_NORMAL finite in float32 (<= 2**127).
NVFP4_MIN_TENSOR_SCALE = 2.0**-121

# IEEE-754 binary32 layout, for the exact exponent arithmetic of the fast paths.
F32_MANTISSA_BITS = 23
F32_EXP_BIAS = 127
F32_EXP_MASK = 0x7F800000
F32_ABS_MASK = 0x7FFFFFFF
F32_SIGN_MASK = -0x80000000  # 0x80000000 as a signed int32
F32_MIN_NORMAL_EXP = -126
F32_MIN_SUBNORMAL_EXP = -149

# IEEE-754 binary64 layout.
F64_MANTISSA_BITS = 52
F64_EXP_BIAS = 1023
