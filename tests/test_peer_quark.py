"""``benchmarks/peers/quark_mxfp4.py``: ``--scale-calculation-mode`` reaches every tensor spec.

Quark is not in torq's environment (it has its own); the stand-ins carry only the fields the
script sets, under the names Quark's ``Config`` and ``QLayerConfig`` give them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import quark_mxfp4


def spec() -> SimpleNamespace:
    return SimpleNamespace(scale_calculation_mode="even")


def test_scale_rule_reaches_every_spec() -> None:
    global_layer = SimpleNamespace(
        input_tensors=spec(), output_tensors=None, weight=spec(), bias=None
    )
    by_type = SimpleNamespace(input_tensors=[spec(), spec()], weight=spec())
    by_name = SimpleNamespace(weight=spec(), bias=SimpleNamespace())  # a spec without the field
    config = SimpleNamespace(
        global_quant_config=global_layer,
        layer_type_quant_config={"Linear": by_type},
        layer_quant_config={"model.layers.0.mlp.down_proj": by_name},
    )
    assert quark_mxfp4.set_scale_rule(config, "floor") == 6
    modes = [
        global_layer.input_tensors.scale_calculation_mode,
        global_layer.weight.scale_calculation_mode,
        *(s.scale_calculation_mode for s in by_type.input_tensors),
        by_type.weight.scale_calculation_mode,
        by_name.weight.scale_calculation_mode,
    ]
    assert modes == ["floor"] * 6
    assert not hasattr(by_name.bias, "scale_calculation_mode")
