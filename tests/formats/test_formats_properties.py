"""Property-based tests of the format functions (issue 30): for random shapes, dtypes and
values (subnormals, infinities, NaN, all-zero blocks, huge and tiny magnitudes), quantize →
pack → unpack → dequantize is fake quantization bit for bit, and both equal the reference."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torq.formats as tf
from tests.formats.formats_testing import ALL_SPECS, DTYPES, assert_bits_equal
from torq.formats.packing import pack_nibbles, unpack_nibbles
from torq.formats.reference import fake_quantize_reference

# values of every kind a block can hold: ordinary, subnormal, huge, signed zeros,
# infinities and NaN (drawn rarely: one poisons its block, or an NVFP4 tensor)
_special = st.sampled_from(
    [0.0, -0.0, 1e-45, -1e-45, 1e-40, 2.0**-126, 3.0e38, -3.0e38, 6.0, 0.25, 5.0, 2.5]
)
_value = st.one_of(
    st.floats(-1e4, 1e4, width=32),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    _special,
    st.sampled_from([math.inf, -math.inf, math.nan]),
)


@st.composite
def _tensors(draw: st.DrawFn) -> tuple[torch.Tensor, tf.FormatSpec]:
    spec = draw(st.sampled_from(ALL_SPECS))
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, 3))
    width = draw(st.integers(1, 3 * spec.block_size + 5))
    nonfinite = draw(st.booleans()) and draw(st.booleans())  # a quarter of the cases
    values = draw(
        st.lists(
            _value if nonfinite else _value.filter(math.isfinite),
            min_size=rows * width,
            max_size=rows * width,
        )
    )
    x = torch.tensor(values, dtype=torch.float64).view(rows, width)
    if draw(st.booleans()):  # an all-zero block
        x[0, : min(width, spec.block_size)] = 0.0
    scale = draw(st.sampled_from([1.0, 2.0**-20, 2.0**20]))
    return (x * scale).to(dtype), spec


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_tensors())
def test_packed_round_trip_is_fake_quantization(case: tuple[torch.Tensor, tf.FormatSpec]) -> None:
    x, spec = case
    fake = tf.fake_quantize(x, spec)
    packed = tf.quantize(x, spec)
    # the packed bytes (two 4-bit codes each, element 2i in the low nibble) through
    # unpacking and packing again
    assert torch.equal(pack_nibbles(unpack_nibbles(packed.codes)), packed.codes)
    assert_bits_equal(tf.dequantize(packed, x.dtype), fake)
    assert_bits_equal(fake_quantize_reference(x, spec), fake)
