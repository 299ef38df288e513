"""MX formats against a slow, obviously correct model in exact rational arithmetic.

This is the oracle for what torchao does not cover: MXINT4, the ``paper`` and
``rceil`` scale modes, other block sizes and float64 inputs.
"""

from __future__ import annotations

import pytest
import torch

import torq.formats as tf
from tests.formats.formats_testing import (
    assert_bits_equal,
    brute_force_mx,
    edge_blocks,
    non_finite_blocks,
    random_activations,
)

MX_SPECS = [
    tf.get_format("mxfp4", "ocp"),
    tf.get_format("mxfp4", "paper"),
    tf.get_format("mxfp4", "rceil"),
    tf.get_format("mxint4"),
]
SPEC_IDS = [f"{s.name}-{s.scale_mode}" for s in MX_SPECS]


def inputs_for(block_size: int) -> torch.Tensor:
    """Random rows of width 256 and every edge/non-finite block, laid out in rows."""
    rows = [*random_activations(rows=4, width=256, seed=1).values()]
    special = torch.cat([edge_blocks(block_size), non_finite_blocks(block_size)])
    per_row = 256 // block_size
    pad = (-special.shape[0]) % per_row
    special = torch.cat([special, torch.zeros(pad, block_size)])
    rows.append(special.reshape(-1, 256))
    return torch.cat(rows)


@pytest.mark.parametrize("spec", MX_SPECS, ids=SPEC_IDS)
def test_fake_quantize_matches_brute_force(spec: tf.FormatSpec) -> None:
    x = inputs_for(spec.block_size)
    expected = brute_force_mx(x, spec.name, spec.scale_mode, spec.block_size).float()
    assert_bits_equal(tf.fake_quantize(x, spec), expected)
    assert_bits_equal(tf.dequantize(tf.quantize(x, spec)), expected)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("name", ["mxfp4", "mxint4"])
def test_other_block_sizes_match_brute_force(name: str, block_size: int) -> None:
    spec = tf.FormatSpec(name, block_size)
    x = inputs_for(block_size)[::3]
    expected = brute_force_mx(x, spec.name, spec.scale_mode, spec.block_size).float()
    assert_bits_equal(tf.fake_quantize(x, spec), expected)


@pytest.mark.parametrize("spec", MX_SPECS, ids=SPEC_IDS)
def test_float64_is_quantized_exactly(spec: tf.FormatSpec) -> None:
    """A float64 input is rounded once, from its own value, not via float32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 256, generator=g, dtype=torch.float64) * 3
    expected = brute_force_mx(x, spec.name, spec.scale_mode, spec.block_size)
    assert_bits_equal(tf.fake_quantize(x, spec), expected)
    assert_bits_equal(tf.dequantize(tf.quantize(x, spec), torch.float64), expected)


def test_float64_near_a_tie_is_not_rounded_twice() -> None:
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, 0] = 4.0  # X = 1
    x[0, 1] = 2.5 + 1e-12  # above the 2|3 midpoint, but 2.5 in float32
    assert tf.fake_quantize(x, "mxfp4")[0, 1].item() == 3.0
    assert tf.fake_quantize(x.float(), "mxfp4")[0, 1].item() == 2.0


def test_mxint4_grid_and_ties() -> None:
    """X = 2**floor(log2 amax); values k / 4 * X, ties to even k, saturating at 7/4."""
    x = torch.zeros(1, 32)
    x[0, :9] = torch.tensor([1.0, 0.125, 0.375, 0.625, -0.125, 1.9, -1.99, 0.05, -0.05])
    y = tf.fake_quantize(x, "mxint4")[0, :9]
    assert y.tolist() == [1.0, 0.0, 0.5, 0.5, 0.0, 1.75, -1.75, 0.0, 0.0]
    assert torch.signbit(y).tolist() == [False] * 6 + [True] + [False] * 2
