"""Helpers shared by the format tests: bit-exact comparison and test data."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

import torq.formats as tf

# every format and MXFP4 scale rule the format tests cover
ALL_SPECS = [
    tf.get_format("mxfp4", "ocp"),
    tf.get_format("mxfp4", "paper"),
    tf.get_format("mxfp4", "rceil"),
    tf.get_format("mxfp4", "nearest"),
    tf.get_format("nvfp4"),
    tf.get_format("mxint4"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns (so -0 differs from +0), with any NaN equal to any NaN."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"NaN positions differ at {(nan_a != nan_e).nonzero()[:5]}"
    bits_a = torch.where(nan_a, 0, actual).view(_INT_VIEW[actual.dtype])
    bits_e = torch.where(nan_e, 0, expected).view(_INT_VIEW[expected.dtype])
    if not torch.equal(bits_a, bits_e):
        where = (bits_a != bits_e).nonzero()[:5]
        pairs = [(actual[tuple(i)].item(), expected[tuple(i)].item()) for i in where]
        raise AssertionError(f"{int((bits_a != bits_e).sum())} values differ, e.g. {pairs}")


def random_activations(rows: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """Float32 test matrices from several distributions, each ``[rows, width]``."""
    g = torch.Generator().manual_seed(seed)
    dof = 3
    chi2 = torch.randn(dof, rows, width, generator=g).square().sum(0)
    exponents = torch.randint(-40, 40, (rows, width // 32, 1), generator=g).float()
    mixed = torch.randn(rows, width // 32, 32, generator=g) * torch.exp2(exponents)
    outlier_rows = torch.randn(rows, width, generator=g)
    outlier_rows[:, torch.randint(0, width, (4,), generator=g)] *= 300.0
    return {
        "normal": torch.randn(rows, width, generator=g),
        "student_t3": torch.randn(rows, width, generator=g) / (chi2 / dof).sqrt(),
        "cauchy": torch.empty(rows, width).cauchy_(generator=g),
        "mixed_exponents": mixed.reshape(rows, width),
        "outlier_channels": outlier_rows,
        "uniform_wide": (torch.rand(rows, width, generator=g) - 0.5)
        * torch.exp2(torch.randint(-118, 126, (rows, 1), generator=g).float()),
    }


def edge_blocks(block_size: int) -> torch.Tensor:
    """Float32 rows, one block each, hitting every corner of the MX/NVFP4 rules."""
    f32 = torch.finfo(torch.float32)
    tiny = 2.0**-149
    cases: list[list[float]] = [
        [],  # all-zero block
        [-0.0, -0.0],  # negative zeros only
        [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0],  # ties between E2M1 codes (X = 1)
        [-4.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0],
        [4.0, 0.2499, 0.2501, 0.7499, 0.7501, 4.9999, 5.0001, -0.1],
        [7.99, 7.0, 6.5, 6.0, 5.99, -7.0, -6.0, 0.3],  # at and beyond 6 X
        [1.0, 1e-30, -1e-30, 2.0**-20],  # values far below the scale
        [f32.max, -f32.max, 1.0, 2.0**100],  # E8M0 upper limit
        [2.0**127, 1.5 * 2.0**127, -(2.0**126)],
        [2.0**106, 1.9 * 2.0**106, 2.0**105],  # around the fast path's fallback limit
        [2.0**107, -1.75 * 2.0**107, 3.0 * 2.0**104],
        [2.0**-122, 2.0**-124, 2.0**-125, 2.0**-127],
        [2.0**-123, 1.5 * 2.0**-124, 2.0**-126, tiny],
        [1.5 * 2.0**-125, 2.0**-127, 2.0**-128, 3 * 2.0**-128, -(2.0**-126)],
        [0.99 * 2.0**-124, 1.25 * 2.0**-126, -(2.0**-130)],
        [f32.tiny, tiny, -tiny, 3 * tiny],  # fp32 subnormals
        [6 * tiny, tiny * 1000, -tiny * 77],
        [1.0, 0.5, -0.25, 0.125, 2.0**-3 + 2.0**-10],
    ]
    rows = torch.zeros(len(cases), block_size)
    for i, values in enumerate(cases):
        values = values[:block_size]
        rows[i, : len(values)] = torch.tensor(values, dtype=torch.float64).float()
    return rows


def non_finite_blocks(block_size: int) -> torch.Tensor:
    """Blocks holding NaN, +Inf or -Inf next to ordinary values."""
    rows = torch.zeros(3, block_size)
    rows[:, 1] = 1.0
    rows[:, 2] = -3.0
    rows[0, 0] = float("nan")
    rows[1, 0] = float("inf")
    rows[2, 0] = float("-inf")
    return rows


# A slow, obviously correct model of the MX formats, in exact rational arithmetic:
# the spec of method notes, section 1, read literally, one element at a time.

E2M1_GRID = [Fraction(v) for v in ("0", "0.5", "1", "1.5", "2", "3", "4", "6")]
INT4_GRID = [Fraction(k, 4) for k in range(8)]


def _nearest_index(magnitude: Fraction, grid: list[Fraction]) -> int:
    """Index of the nearest grid value; a tie goes to the even index (even code)."""
    best = min(range(len(grid)), key=lambda i: (abs(magnitude - grid[i]), i % 2))
    return best


def _floor_log2(value: float) -> int:
    return math.frexp(value)[1] - 1


def brute_force_scale_exponent(amax: float, name: str, scale_mode: str) -> int:
    """The E8M0 exponent of a block's scale, straight from the definitions."""
    if amax == 0:
        return -127
    if name == "mxint4" or scale_mode == "paper":
        exponent = _floor_log2(amax)
    elif scale_mode == "ocp":
        exponent = _floor_log2(amax) - 2
    elif scale_mode == "nearest":  # one binade up when amax / 2**(floor(log2 amax) - 2) >= 7
        exponent = _floor_log2(amax) - 2
        if Fraction(amax) >= 7 * Fraction(2) ** exponent:
            exponent += 1
    else:  # rceil: the smallest power of two X with amax / X <= 6
        exponent = _floor_log2(amax) - 4
        while Fraction(amax) > 6 * Fraction(2) ** exponent:
            exponent += 1
    return max(-127, min(127, exponent))


def brute_force_mx_block(block: list[float], name: str, scale_mode: str) -> list[float]:
    """Quantize-dequantize one MX block (``name`` is "mxfp4" or "mxint4")."""
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return [math.nan] * len(block)
    amax = max(abs(v) for v in block)
    scale = Fraction(2) ** brute_force_scale_exponent(amax, name, scale_mode)
    grid = INT4_GRID if name == "mxint4" else E2M1_GRID
    out = []
    for v in block:
        q = grid[_nearest_index(abs(Fraction(v)) / scale, grid)] * scale
        negative = math.copysign(1.0, v) < 0
        if q == 0:
            # E2M1 has a -0 code; two's complement INT4 does not.
            out.append(-0.0 if negative and name == "mxfp4" else 0.0)
            continue
        try:
            magnitude = float(q)
        except OverflowError:
            magnitude = math.inf
        out.append(-magnitude if negative else magnitude)
    return out


def brute_force_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round each value to the nearest signed E2M1 value (ties to even, saturating)."""
    out = [
        math.copysign(float(E2M1_GRID[_nearest_index(abs(Fraction(a)), E2M1_GRID)]), a)
        for a in v.double().flatten().tolist()
    ]
    return torch.tensor(out, dtype=torch.float64).reshape(v.shape)


def brute_force_mx(x: torch.Tensor, name: str, scale_mode: str, block_size: int) -> torch.Tensor:
    """:func:`brute_force_mx_block` over the blocks of a 2-D tensor (zero-padded)."""
    width = x.shape[-1]
    padded = -(-width // block_size) * block_size
    values = x.double().tolist()
    result = []
    for row in values:
        row = row + [0.0] * (padded - width)
        out_row: list[float] = []
        for start in range(0, padded, block_size):
            out_row += brute_force_mx_block(row[start : start + block_size], name, scale_mode)
        result.append(out_row[:width])
    return torch.tensor(result, dtype=torch.float64)
