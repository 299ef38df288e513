"""AMD Quark: QuaRot-style Hadamard rotations + MXFP4 W4A4, scored with torq's perplexity.

Recipe (amd-quark 0.13, eager mode): the model type's ``LLMTemplate`` (``llama`` for
SmolLM2), ``template.get_config(scheme="mxfp4", algorithm=["rotation"], algo_configs=
{"rotation": RotationConfig})`` and ``ModelQuantizer(config).quantize_model(model, None)``,
then ``ModelQuantizer.freeze(model)`` so the weights are fake-quantized once. The ``mxfp4``
scheme is ``OCP_MXFP4Spec``: FP4 E2M1 in groups of 32 with an E8M0 scale
(``scale_calculation_mode="even"``), weights static, activations dynamic; everything is
data-free, so no calibration loader is given. ``lm_head`` stays in float (the template
excludes it). Quark's ``even`` rule is torq's ``nearest`` (the OCP exponent, raised by one
when the block maximum's mantissa would round past E2M1's 6); ``--scale-calculation-mode
floor`` sets every tensor's spec to Quark's ``floor``, OCP's own rule (torq's ``ocp``).

Rotations: Quark's built-in ``rotation`` config for ``llama`` turns on R1 only; this script
sets ``--rotations`` (default r1,r2,r4, the QuaRot set without the KV-cache R3) on a copy of
it. R1 (residual, norms folded first) and R2 (per head, v/o) are fused Hadamards; R4 is an
online Hadamard before ``down_proj`` (``InputRotationWrapperHadamard``). Sizes that are not
powers of two (SmolLM2's 576 and 1536) use Quark's Hadamard tables (12, 20, 28, 36, ...).
Model types without a built-in rotation config (qwen2, qwen3, mistral) borrow the llama one:
their module names are the same; the JSON says when that happened.

The first-window check disables every fake quantizer (before ``freeze``, which bakes the
fake-quantized weights in) to show the rotations alone keep the float model's function.

Usage: ``python benchmarks/peers/quark_mxfp4.py --model smollm2-135m --max-windows 16
--out results/peers/quark-smollm2.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import torch
from peer_common import (
    add_common_args,
    evaluate,
    first_window_nll,
    package_versions,
    rotation_check,
    save_record,
    start,
    timed,
)

PEER = "quark"


def build_config(model: torch.nn.Module, args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from quark.torch import LLMTemplate
    from quark.torch.quantization.config.algo_configs import get_algo_config

    model_type = model.config.model_type
    template = LLMTemplate.get(model_type)
    info: dict[str, Any] = {"template": model_type}
    rotations = {r.strip().lower() for r in args.rotations.split(",") if r.strip()}
    if not rotations:
        return template.get_config(scheme=args.scheme), info
    base = get_algo_config("rotation", model_type)
    if base is None:
        base = get_algo_config("rotation", "llama")
        info["rotation_config_borrowed_from"] = "llama"
    rotation = dataclasses.replace(
        base,
        r1="r1" in rotations,
        r2="r2" in rotations,
        r3="r3" in rotations,
        r4="r4" in rotations,
        rotation_size=args.rotation_size,
        random_r1=args.random_r1,
    )
    config = template.get_config(
        scheme=args.scheme, algorithm=["rotation"], algo_configs={"rotation": rotation}
    )
    return config, info


def set_scale_rule(config: Any, mode: str) -> int:
    """Set ``scale_calculation_mode`` on every tensor spec of a Quark ``Config`` (the global
    layer config and any per-type or per-name ones); returns how many specs were set."""
    layers = [
        config.global_quant_config,
        *config.layer_type_quant_config.values(),
        *config.layer_quant_config.values(),
    ]
    count = 0
    for layer in layers:
        for field in ("input_tensors", "output_tensors", "weight", "bias"):
            specs = getattr(layer, field, None)
            for spec in specs if isinstance(specs, list) else [specs]:
                if spec is not None and hasattr(spec, "scale_calculation_mode"):
                    spec.scale_calculation_mode = mode
                    count += 1
    return count


def fake_quantizers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "disable_fake_quant")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser, PEER)
    parser.add_argument(
        "--rotations", default="r1,r2,r4", help="comma list of r1..r4; empty for MXFP4 RTN"
    )
    parser.add_argument(
        "--rotation-size",
        type=int,
        default=None,
        help="block-diagonal rotations of this size (default: full width)",
    )
    parser.add_argument("--random-r1", action="store_true", help="random-sign Hadamard for R1")
    parser.add_argument("--scheme", default="mxfp4", help="LLMTemplate scheme name")
    parser.add_argument(
        "--scale-calculation-mode",
        choices=["even", "floor", "ceil"],
        default="even",
        help="the E8M0 scale rule of every tensor spec: even (Quark's default, torq's "
        "nearest), floor (OCP's, torq's ocp) or ceil",
    )
    parser.add_argument(
        "--no-rotation-check", action="store_true", help="skip the first-window float check"
    )
    args = parser.parse_args(argv)

    from quark.torch import ModelQuantizer

    subject, record, nll_float = start(args, check_rotation=not args.no_rotation_check)
    model, windows, progress = subject.model, subject.windows, not args.no_progress

    config, info = build_config(model, args)
    if args.scale_calculation_mode != "even":
        info["scale_specs_set"] = set_scale_rule(config, args.scale_calculation_mode)
    info["scale_calculation_mode"] = args.scale_calculation_mode
    with timed() as t:
        model = ModelQuantizer(config).quantize_model(model, None)
    quantize_seconds = t["seconds"]

    # Before freeze, every weight and input quantizer can still be switched off.
    quantizers = fake_quantizers(model)
    if nll_float is not None and args.rotations.strip():
        for q in quantizers:
            q.disable_fake_quant()
        record["rotation_check"] = rotation_check(nll_float, first_window_nll(model, windows))
        for q in quantizers:
            q.enable_fake_quant()
    with timed() as t:
        model = ModelQuantizer.freeze(model)
    record["quantize_seconds"] = quantize_seconds + t["seconds"]

    record["quantized"] = evaluate(model, windows, PEER, progress)
    record["recipe"] = {
        "api": "ModelQuantizer(LLMTemplate.get(model_type).get_config(scheme, algorithm="
        "['rotation'], algo_configs={'rotation': RotationConfig})).quantize_model(model, None)"
        "; ModelQuantizer.freeze(model)",
        **info,
        "scheme": args.scheme,
        "rotations": args.rotations,
        "rotation_size": args.rotation_size,
        "random_r1": args.random_r1,
        "fake_quantizers": len(quantizers),
        "config": json.loads(json.dumps(config.to_dict(), default=str)),
    }
    record["peer_versions"] = package_versions("amd-quark", "torch")
    save_record(args, PEER, subject, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
