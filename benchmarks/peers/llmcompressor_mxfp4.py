"""llm-compressor: SpinQuant / QuIP rotations + MXFP4 W4A4, scored with torq's perplexity.

Recipe (llm-compressor 0.14): a transform modifier, then
``QuantizationModifier(targets="Linear", scheme="MXFP4", ignore=["lm_head"])`` applied with
``oneshot(..., pipeline="datafree")``. The preset ``MXFP4`` scheme is weights static
(observer ``memoryless_minmax``) and activations dynamic, both FP4 E2M1 in groups of 32 with
a uint8 E8M0 scale. Both MXFP4 sides are data-free, so no calibration set is passed.

Transforms (``--transform``):

* ``spinquant`` (default): ``SpinQuantModifier`` with ``--rotations`` (default R1,R2,R4, the
  QuaRot set without the KV-cache R3). R1 (residual) and R2 (per-head, v/o) are fused into
  the weights; R4 is an online Hadamard before ``down_proj``. With ``learnable=False`` the
  rotations are fixed Hadamards, i.e. QuaRot-style, not SpinQuant's trained ones (0.14 has
  no rotation training). The modifier also folds norms and centres the embedding rows.
* ``quip``: ``QuIPModifier(rotations=["v"])``: an online Hadamard before every Linear's input,
  its inverse fused into the weight (closest to torq's ``had32`` with ``--block-size 32``).
* ``none``: MXFP4 RTN alone.

After ``oneshot`` the model keeps fake-quantizing in its forward (status FROZEN), which is
what torq's ``perplexity`` then measures. The first-window check switches quantization off
(``quantization_enabled = False``) to show what the transforms alone do to the float model.

Usage: ``python benchmarks/peers/llmcompressor_mxfp4.py --model smollm2-135m
--max-windows 16 --out results/peers/llmcompressor-smollm2.json``.
"""

from __future__ import annotations

import argparse
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

PEER = "llmcompressor"


def build_recipe(args: argparse.Namespace) -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier

    modifiers: list[Any] = []
    if args.transform == "spinquant":
        rotations = [r.strip().upper() for r in args.rotations.split(",") if r.strip()]
        modifiers.append(
            SpinQuantModifier(
                rotations=rotations,
                transform_type=args.transform_type,
                transform_block_size=args.block_size,
            )
        )
    elif args.transform == "quip":
        modifiers.append(
            QuIPModifier(
                rotations=["v"],
                transform_type=args.transform_type,
                transform_block_size=args.block_size,
                ignore=args.ignore,
            )
        )
    modifiers.append(QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=args.ignore))
    return modifiers


def set_quantization(model: torch.nn.Module, enabled: bool) -> None:
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            module.quantization_enabled = enabled


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser, PEER)
    parser.add_argument("--transform", choices=["spinquant", "quip", "none"], default="spinquant")
    parser.add_argument(
        "--rotations", default="R1,R2,R4", help="SpinQuant rotations (comma list of R1..R4)"
    )
    parser.add_argument(
        "--transform-type",
        choices=["hadamard", "random-hadamard", "random-matrix"],
        default="random-hadamard",
        help="'hadamard' needs power-of-two sizes (SmolLM2's hidden 576 is not); "
        "'random-hadamard' uses the fixed seed of a fresh torch.Generator",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="block-diagonal transform of this size (default: full hidden / head_dim width)",
    )
    parser.add_argument("--scheme", default="MXFP4", help="compressed-tensors preset scheme")
    parser.add_argument("--ignore", nargs="*", default=["lm_head"], help="modules left in float")
    parser.add_argument(
        "--no-rotation-check", action="store_true", help="skip the first-window float check"
    )
    args = parser.parse_args(argv)

    from llmcompressor import oneshot
    from llmcompressor.recipe import Recipe

    subject, record, nll_float = start(args, check_rotation=not args.no_rotation_check)
    model, windows, progress = subject.model, subject.windows, not args.no_progress

    recipe = build_recipe(args)
    recipe_yaml = Recipe.from_modifiers(recipe).yaml()
    with timed() as t:
        oneshot(model=model, recipe=recipe, pipeline="datafree")
    record["quantize_seconds"] = t["seconds"]

    if nll_float is not None and args.transform != "none":
        set_quantization(model, False)
        record["rotation_check"] = rotation_check(nll_float, first_window_nll(model, windows))
        set_quantization(model, True)

    n_quantized = sum(
        1
        for m in model.modules()
        if getattr(m, "quantization_scheme", None) is not None
        and getattr(m, "quantization_enabled", True)
    )
    record["quantized"] = evaluate(model, windows, PEER, progress)
    record["recipe"] = {
        "api": "llmcompressor.oneshot(model, recipe, pipeline='datafree')",
        "yaml": recipe_yaml,
        "transform": args.transform,
        "rotations": args.rotations if args.transform == "spinquant" else None,
        "transform_type": args.transform_type if args.transform != "none" else None,
        "block_size": args.block_size,
        "scheme": args.scheme,
        "ignore": args.ignore,
        "quantized_modules": n_quantized,
        "mx_scale_rule": "compressed-tensors generate_mx_scales: 2^(floor(log2 amax) - 2), "
        "moved up one power of two when amax's mantissa is >= 1.75 (no saturation at 6)",
    }
    record["peer_versions"] = package_versions("llmcompressor", "compressed-tensors", "torch")
    save_record(args, PEER, subject, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
