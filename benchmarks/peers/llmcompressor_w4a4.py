"""llm-compressor's calibrated W4A4 (NVFP4 or MXFP4): its GPTQ, optionally after its QuIP or
SpinQuant transforms, scored with torq's perplexity.

This is what a user of llm-compressor 0.14 runs to make an NVFP4 checkpoint: the preset
``NVFP4`` scheme (weights FP4 E2M1 in groups of 16 with an E4M3 scale and one FP32 global
scale per tensor; activations the same, their global scale static, calibrated by the
``static_minmax`` observer on the calibration data, their group scales computed as the model
runs) through ``GPTQModifier``, on torq's calibration windows:

``oneshot(model, dataset, recipe=[<transform>, GPTQModifier(targets="Linear", scheme=SCHEME,
ignore=["lm_head"])], pipeline="sequential")``

``--weights rtn`` puts ``QuantizationModifier`` (round to nearest; the activation global
scale still calibrated) in GPTQ's place. Transforms (``--transform``):

* ``none`` (default): GPTQ alone, llm-compressor's NVFP4 recipe as its examples give it;
* ``quip``: ``QuIPModifier(rotations=--quip-rotations, transform_type, transform_block_size)``,
  a Hadamard before each Linear (``v``; ``u`` adds one after it, undone online);
* ``spinquant``: ``SpinQuantModifier(rotations=--rotations)``, fixed Hadamards R1/R2 fused,
  R4 online before ``down_proj`` (0.14 trains no rotation).

GPTQ keeps llm-compressor's defaults (``dampening_frac`` 0.01, ``actorder`` static) unless
``--damp`` or ``--actorder`` say otherwise. llm-compressor makes the q/k/v and gate/up
weights share one global scale, as vLLM's fused linears need (torq does the same).

Usage: ``python benchmarks/peers/llmcompressor_w4a4.py --model smollm2-135m --scheme NVFP4
--max-windows 16 --calib-samples 32 --out results/peers/llmc-nvfp4-gptq-smollm2.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from llmcompressor_gptq import add_calibration_args, processor_for, token_dataset
from peer_common import (
    add_common_args,
    calibration_tokens,
    evaluate,
    load_subject,
    package_versions,
    save_record,
    timed,
)

PEER = "llmcompressor-w4a4"


def build_recipe(args: argparse.Namespace) -> list[Any]:
    """The modifiers: the transform asked for, then GPTQ (or RTN) in ``--scheme``."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier

    def names(text: str) -> list[str]:
        return [r.strip() for r in text.split(",") if r.strip()]

    modifiers: list[Any] = []
    if args.transform == "quip":
        modifiers.append(
            QuIPModifier(
                rotations=names(args.quip_rotations),
                transform_type=args.transform_type,
                transform_block_size=args.block_size,
                ignore=["lm_head"],
            )
        )
    elif args.transform == "spinquant":
        modifiers.append(
            SpinQuantModifier(
                rotations=[r.upper() for r in names(args.rotations)],
                transform_type=args.transform_type,
                transform_block_size=args.block_size,
            )
        )
    if args.weights == "rtn":
        modifiers.append(
            QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])
        )
    else:
        gptq: dict[str, Any] = {}
        if args.damp is not None:
            gptq["dampening_frac"] = args.damp
        if args.actorder is not None:
            gptq["actorder"] = None if args.actorder == "none" else args.actorder
        modifiers.append(
            GPTQModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"], **gptq)
        )
    return modifiers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser, PEER)
    parser.add_argument(
        "--scheme", default="NVFP4", help="compressed-tensors preset (NVFP4, MXFP4)"
    )
    parser.add_argument("--weights", choices=["gptq", "rtn"], default="gptq")
    parser.add_argument("--transform", choices=["none", "quip", "spinquant"], default="none")
    parser.add_argument("--quip-rotations", default="v", help="QuIP's rotations: v, or v,u")
    parser.add_argument("--rotations", default="R1,R2,R4", help="SpinQuant's rotations")
    parser.add_argument(
        "--transform-type",
        choices=["hadamard", "random-hadamard", "random-matrix"],
        default="random-hadamard",
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="block-diagonal transform of this size"
    )
    add_calibration_args(parser, 32)
    parser.add_argument("--damp", type=float, default=None, help="GPTQ dampening_frac")
    parser.add_argument("--actorder", choices=["none", "static", "group", "weight"], default=None)
    args = parser.parse_args(argv)

    from llmcompressor import oneshot
    from llmcompressor.recipe import Recipe

    torch.manual_seed(args.seed)
    subject = load_subject(args)
    progress = not args.no_progress
    record: dict[str, Any] = {}
    if args.with_fp:
        record["fp"] = evaluate(subject.model, subject.windows, "fp", progress)

    tokens = calibration_tokens(args, subject)
    dataset = token_dataset(tokens)
    recipe = build_recipe(args)
    model = subject.model
    with timed() as t:
        oneshot(
            model=model,
            dataset=dataset,
            processor=processor_for(subject),
            recipe=recipe,
            pipeline="sequential",
            num_calibration_samples=int(tokens.shape[0]),
            max_seq_length=int(tokens.shape[1]),
            batch_size=1,
        )
    record["quantize_seconds"] = t["seconds"]
    record["quantized"] = evaluate(model, subject.windows, PEER, progress)
    record["recipe"] = {
        "api": "llmcompressor.oneshot(model, dataset, recipe, pipeline='sequential')",
        "yaml": Recipe.from_modifiers(recipe).yaml(),
        "scheme": args.scheme,
        "weights": args.weights,
        "transform": args.transform,
        "calibration": {
            "corpus": args.calib_corpus,
            "samples": int(tokens.shape[0]),
            "seqlen": int(tokens.shape[1]),
            "seed": args.calib_seed,
            "tokens_sha_sum": int(tokens.sum()),
        },
    }
    record["peer_versions"] = package_versions("llmcompressor", "compressed-tensors", "torch")
    save_record(args, PEER, subject, record, label=f"{args.scheme} W4A4")
    return 0


if __name__ == "__main__":
    sys.exit(main())
