"""llm-compressor's GPTQ, weights only (MXFP4 W4A16), beside torq's on the same calibration tokens.

The cross-check of issue 4: torq's GPTQ (``torq run --methods rtn,gptq --a-format none``)
and llm-compressor's ``GPTQModifier`` quantize the same float model to MXFP4 weights with
float activations, from the same calibration windows, and both are scored with torq's
perplexity on the same WikiText-2 windows. Their RTN rows are measured too, because the two
libraries round MX block scales differently (see ``README.md``): the comparison is each
library's GPTQ gain over its own RTN, and the GPTQ perplexities themselves.

Recipe (llm-compressor 0.14):
``GPTQModifier(targets="Linear", scheme="MXFP4A16", ignore=["lm_head"], dampening_frac=0.01,
actorder=None)`` through ``oneshot(model, dataset, recipe, pipeline=...)`` on the windows
``torq.calibration.data.calibration_windows`` draws (``--calib-samples`` × ``--calib-seqlen``
tokens of ``--calib-corpus``, seed ``--calib-seed``: torq's defaults). ``--actorder static``
gives llm-compressor's default ordering instead. ``--pipeline sequential`` (default) feeds
each layer the outputs of the already-quantized layers (``propagate_error``), which is
``torq run --sequential``; ``--no-propagate-error`` feeds float outputs, which is torq's
plain calibration. The RTN row is ``QuantizationModifier(scheme="MXFP4A16")``, data-free.

Usage: ``python benchmarks/peers/llmcompressor_gptq.py --model smollm2-135m --max-windows 16
--calib-samples 16 --out results/peers/llmcompressor-gptq-smollm2.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import torch
from peer_common import (
    add_common_args,
    calibration_tokens,
    evaluate,
    load_subject,
    package_versions,
    save_record,
    timed,
)

PEER = "llmcompressor-gptq"


def processor_for(subject: Any) -> Any:
    """The tokenizer ``oneshot`` insists on when given a dataset (the data is already token
    ids): the model's own, or a word-level stand-in over the tiny model's vocabulary."""
    if subject.tokenizer is not None:
        return subject.tokenizer
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(subject.describe["vocab_size"])}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), unk_token="t0"
    )


def add_calibration_args(parser: argparse.ArgumentParser, samples: int) -> None:
    """torq's calibration windows as ``oneshot`` is given them (:func:`token_dataset`)."""
    parser.add_argument("--calib-corpus", default="wikitext2-valid")
    parser.add_argument("--calib-samples", type=int, default=samples)
    parser.add_argument("--calib-seqlen", type=int, default=2048)
    parser.add_argument("--calib-seed", type=int, default=0)


def token_dataset(tokens: torch.Tensor) -> Any:
    """Calibration windows of token ids as the ``datasets.Dataset`` ``oneshot`` reads."""
    from datasets import Dataset

    return Dataset.from_dict(
        {"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser, PEER)
    add_calibration_args(parser, 16)
    parser.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening_frac")
    parser.add_argument("--actorder", choices=["none", "static", "group", "weight"], default="none")
    parser.add_argument("--pipeline", choices=["sequential", "basic"], default="sequential")
    parser.add_argument(
        "--no-propagate-error",
        action="store_true",
        help="sequential pipeline: feed each layer the float outputs (torq's plain calibration)",
    )
    parser.add_argument("--skip-rtn", action="store_true", help="do not measure the RTN row")
    args = parser.parse_args(argv)

    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.recipe import Recipe

    subject = load_subject(args)
    progress = not args.no_progress
    record: dict[str, Any] = {}
    if args.with_fp:
        record["fp"] = evaluate(subject.model, subject.windows, "fp", progress)

    if not args.skip_rtn:
        rtn_model = copy.deepcopy(subject.model)
        rtn = QuantizationModifier(targets="Linear", scheme="MXFP4A16", ignore=["lm_head"])
        with timed() as t:
            oneshot(model=rtn_model, recipe=[rtn], pipeline="datafree")
        record["rtn"] = {
            **evaluate(rtn_model, subject.windows, "llmc-rtn", progress),
            "quantize_seconds": t["seconds"],
            "recipe_yaml": Recipe.from_modifiers([rtn]).yaml(),
        }
        del rtn_model

    tokens = calibration_tokens(args, subject)
    dataset = token_dataset(tokens)
    gptq = GPTQModifier(
        targets="Linear",
        scheme="MXFP4A16",
        ignore=["lm_head"],
        dampening_frac=args.damp,
        actorder=None if args.actorder == "none" else args.actorder,
    )
    model = subject.model
    with timed() as t:
        oneshot(
            model=model,
            dataset=dataset,
            processor=processor_for(subject),
            recipe=[gptq],
            pipeline=args.pipeline,
            num_calibration_samples=int(tokens.shape[0]),
            max_seq_length=int(tokens.shape[1]),
            propagate_error=not args.no_propagate_error,
            batch_size=1,
        )
    record["quantize_seconds"] = t["seconds"]
    record["quantized"] = evaluate(model, subject.windows, "llmc-gptq", progress)
    record["recipe"] = {
        "api": f"llmcompressor.oneshot(model, dataset, recipe, pipeline='{args.pipeline}')",
        "yaml": Recipe.from_modifiers([gptq]).yaml(),
        "calibration": {
            "corpus": args.calib_corpus,
            "samples": int(tokens.shape[0]),
            "seqlen": int(tokens.shape[1]),
            "seed": args.calib_seed,
            "tokens_sha_sum": int(tokens.sum()),
            "propagate_error": not args.no_propagate_error,
        },
        "weights": "MXFP4 (group 32, E8M0 scale, compressed-tensors scale rule)",
        "activations": "float",
    }
    record["peer_versions"] = package_versions("llmcompressor", "compressed-tensors", "torch")
    save_record(args, PEER, subject, record, label="GPTQ W4A16")
    if "rtn" in record:
        print(f"llm-compressor RTN (W4A16): {record['rtn']['ppl']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
