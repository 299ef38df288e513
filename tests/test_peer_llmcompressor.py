"""``benchmarks/peers/llmcompressor_w4a4.py``: the modifiers each option gives llm-compressor.

llm-compressor is not in torq's environment (it has its own); the stand-ins record the
keyword arguments the script passes, under the module paths llm-compressor 0.14 gives its
modifiers.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import llmcompressor_w4a4


class _Modifier:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture
def modifiers(monkeypatch: pytest.MonkeyPatch) -> dict[str, type]:
    made = {
        name: type(name, (_Modifier,), {})
        for name in ("GPTQModifier", "QuantizationModifier", "QuIPModifier", "SpinQuantModifier")
    }
    where = {
        "llmcompressor.modifiers.gptq": ("GPTQModifier",),
        "llmcompressor.modifiers.quantization": ("QuantizationModifier",),
        "llmcompressor.modifiers.transform": ("QuIPModifier", "SpinQuantModifier"),
    }
    for path in ("llmcompressor", "llmcompressor.modifiers", *where):
        monkeypatch.setitem(sys.modules, path, types.ModuleType(path))
    for path, names in where.items():
        for name in names:
            setattr(sys.modules[path], name, made[name])
    return made


def _args(**over: Any) -> argparse.Namespace:
    base = dict(
        scheme="NVFP4",
        weights="gptq",
        transform="none",
        quip_rotations="v",
        rotations="R1,R2,R4",
        transform_type="random-hadamard",
        block_size=None,
        damp=None,
        actorder=None,
    )
    return argparse.Namespace(**{**base, **over})


def test_gptq_alone_keeps_llm_compressors_defaults(modifiers: dict[str, type]) -> None:
    (gptq,) = llmcompressor_w4a4.build_recipe(_args())
    assert type(gptq) is modifiers["GPTQModifier"]
    # dampening and act-order unset: llm-compressor's own defaults (0.01, static)
    assert gptq.kwargs == {"targets": "Linear", "scheme": "NVFP4", "ignore": ["lm_head"]}
    (gptq,) = llmcompressor_w4a4.build_recipe(_args(damp=0.1, actorder="none"))
    assert gptq.kwargs["dampening_frac"] == 0.1 and gptq.kwargs["actorder"] is None


def test_transforms_come_before_the_weights(modifiers: dict[str, type]) -> None:
    quip, gptq = llmcompressor_w4a4.build_recipe(
        _args(transform="quip", quip_rotations="v, u", block_size=16, scheme="MXFP4")
    )
    assert type(quip) is modifiers["QuIPModifier"]
    assert quip.kwargs["rotations"] == ["v", "u"] and quip.kwargs["transform_block_size"] == 16
    assert gptq.kwargs["scheme"] == "MXFP4"
    spin, rtn = llmcompressor_w4a4.build_recipe(
        _args(transform="spinquant", rotations="r1,r2", weights="rtn")
    )
    assert type(spin) is modifiers["SpinQuantModifier"] and spin.kwargs["rotations"] == ["R1", "R2"]
    assert type(rtn) is modifiers["QuantizationModifier"]
    assert rtn.kwargs == {"targets": "Linear", "scheme": "NVFP4", "ignore": ["lm_head"]}
