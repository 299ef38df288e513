"""Format specs, names, scale modes and bad-input errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import torq.formats as tf


def test_public_names() -> None:
    assert tf.FORMAT_NAMES == ("mxfp4", "nvfp4", "mxint4")
    assert tf.SCALE_MODES == ("ocp", "paper", "rceil", "nearest")


@pytest.mark.parametrize(("name", "block_size"), [("mxfp4", 32), ("nvfp4", 16), ("mxint4", 32)])
def test_get_format_defaults(name: str, block_size: int) -> None:
    spec = tf.get_format(name)
    assert spec == tf.FormatSpec(name, block_size, "ocp")
    assert spec.to_dict() == {"name": name, "block_size": block_size, "scale_mode": "ocp"}


@pytest.mark.parametrize("mode", ["ocp", "paper", "rceil", "nearest"])
def test_mxfp4_scale_modes(mode: str) -> None:
    assert tf.get_format("mxfp4", mode).scale_mode == mode


def test_spec_round_trips_through_json() -> None:
    spec = tf.get_format("mxfp4", "rceil")
    assert tf.FormatSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_spec_is_frozen_and_hashable() -> None:
    spec = tf.get_format("nvfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    assert len({spec, tf.get_format("nvfp4")}) == 1


def test_unknown_format_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"mxfp4.*nvfp4.*mxint4"):
        tf.get_format("fp4")
    with pytest.raises(ValueError, match="known formats"):
        tf.FormatSpec("int4", 32)


def test_unknown_scale_mode_lists_known_modes() -> None:
    with pytest.raises(ValueError, match=r"ocp.*paper.*rceil"):
        tf.get_format("mxfp4", "ceil")


@pytest.mark.parametrize("name", ["nvfp4", "mxint4"])
@pytest.mark.parametrize("mode", ["paper", "rceil", "nearest"])
def test_mxfp4_scale_modes_are_mxfp4_only(name: str, mode: str) -> None:
    with pytest.raises(ValueError, match=f"format '{name}' takes scale_mode 'ocp'"):
        tf.get_format(name, mode)


@pytest.mark.parametrize("name", ["mxfp4", "mxint4", "mxfp8"])
def test_four_over_six_is_nvfp4_only(name: str) -> None:
    assert tf.get_format("nvfp4", "4over6").scale_mode == "4over6"
    with pytest.raises(ValueError, match="not '4over6'"):
        tf.get_format(name, "4over6")


@pytest.mark.parametrize("block_size", [0, -32, 31, 1, 32.0, True])
def test_bad_block_size(block_size: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        tf.FormatSpec("mxfp4", block_size)  # type: ignore[arg-type]


def test_fake_quantize_accepts_a_name_or_a_spec() -> None:
    x = torch.randn(4, 64)
    assert torch.equal(tf.fake_quantize(x, "mxfp4"), tf.fake_quantize(x, tf.get_format("mxfp4")))
    assert tf.quantize(x, "nvfp4").fmt == tf.get_format("nvfp4")


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        tf.fake_quantize(torch.arange(64).reshape(2, 32), "mxfp4")
    with pytest.raises(TypeError, match="floating-point"):
        tf.quantize(torch.ones(2, 32, dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="dimension"):
        tf.fake_quantize(torch.tensor(1.0), "mxfp4")
    with pytest.raises(ValueError, match="dimension"):
        tf.quantize(torch.tensor(1.0), "nvfp4")
    with pytest.raises(TypeError, match="FormatSpec"):
        tf.fake_quantize(torch.ones(32), 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="known formats"):
        tf.fake_quantize(torch.ones(32), "mxfp6")
