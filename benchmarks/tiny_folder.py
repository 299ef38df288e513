"""A tiny Hugging Face folder of one architecture with random weights, and a data folder for
it: what a check of an architecture no real model here has (does torq quantize it, does
transformers or vLLM load what torq wrote) runs on. The numbers such a folder gives mean only
that the engines agree: the weights are random.

    python -m benchmarks.tiny_folder granite /tmp/tiny-granite --data-dir /tmp/tiny-data
    torq quantize /tmp/tiny-granite --out /tmp/tiny-granite-q --calib-samples 2 \\
        --data-dir /tmp/tiny-data
    python -m benchmarks.vllm_cpu --folder /tmp/tiny-granite-q --vllm-python VENV/bin/python \\
        --max-windows 2 --data-dir /tmp/tiny-data --out results/vllm-cpu-tiny-granite.json

Any ``model_type`` transformers knows, and ``gemma3`` (Gemma 3 of text and images: its
decoder's settings in a ``text_config``, a small vision tower beside it): the test suite's
tiny models (``tests.conftest``: 2 layers, grouped-query attention with 4 heads and 2 of
keys and values, its byte-level tokenizer of 384 tokens) with heads of 64 (vLLM's CPU
attention has no kernel for smaller ones) and hidden size 256; the data folder repeats the
tokenizer's sentences under WikiText-2's file names.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.conftest import (
    TINY_TEXT,
    build_tiny_tokenizer,
    tiny_gemma3_of_text_and_images,
    tiny_model,
)

# vLLM's CPU attention has kernels for heads of 64 and more, not the tests' 16
WIDTHS = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_type", help="a transformers model_type, or gemma3")
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--data-dir", type=Path, help="also write a data folder here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} holds something already")
    if args.model_type == "gemma3":
        model = tiny_gemma3_of_text_and_images(args.seed, **WIDTHS)
    else:
        model = tiny_model(args.model_type, args.seed, **WIDTHS)
    model.save_pretrained(args.out)
    build_tiny_tokenizer().save_pretrained(args.out)
    print(f"wrote {args.out} ({type(model).__name__}, random weights)")
    if args.data_dir is not None:
        test = args.data_dir / "wikitext-2-raw" / "wiki.test.raw"
        valid = args.data_dir / "wikitext-2" / "wiki.valid.tokens"
        for file, copies in ((test, 400), (valid, 400)):
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(TINY_TEXT * copies, encoding="utf-8")
        print(f"wrote {args.data_dir} (its sentences repeated)")


if __name__ == "__main__":
    main()
