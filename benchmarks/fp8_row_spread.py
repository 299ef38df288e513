"""Whether a real model's rows fit the FP8 prefill path exactly (CPU, no GPU needed).

The FP8 prefill path (``torq.kernels``, ``kind="fp8_gemm"``) writes each row of MXFP4
values as E4M3 with one power-of-two scale per row. That is exact when the row's nonzero
blocks have scales within 2**14 of the row's largest. This script counts the rows that
span more, in every linear weight of a model and in the token rows that reach every
decoder linear on WikiText-2 windows.

``python -m benchmarks.fp8_row_spread --model smollm2-135m --windows 2 --out
results/fp8_row_spread.json``
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.common import save
from torq.experimental import (
    FP8_EXACT_SPAN,
    MXFP4Weight,
    get_format,
    load,
    load_wikitext2_test,
    quantize,
)


def row_spreads(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x [rows, K]``: largest minus smallest block exponent over the blocks
    that hold a nonzero MXFP4 code (0 for rows without one)."""
    packed = quantize(x.float(), get_format("mxfp4"))
    rows = x.shape[0]
    exponents = packed.scales.to(torch.int32) - 127
    nonzero = (packed.codes.view(rows, -1, 16) & 0x77).ne(0).any(dim=-1)
    finite = packed.scales != 255
    top = torch.where(finite, exponents, -1000).amax(dim=1)
    low = torch.where(nonzero & finite, exponents, 1000).amin(dim=1)
    return (top - low).clamp(min=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=2, help="WikiText-2 windows of --seqlen")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--out", default="results/fp8_row_spread.json")
    args = p.parse_args()
    t0 = time.time()
    lm = load(args.model)
    weights = {"linears": 0, "exact": 0, "max_spread": 0}
    for module in lm.model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight.detach()
            weights["linears"] += 1
            weights["exact"] += bool(MXFP4Weight.from_float(w).fp8_rows()[2])
            weights["max_spread"] = max(weights["max_spread"], int(row_spreads(w).max()))
    hist = torch.zeros(64, dtype=torch.long)

    def hook(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
        hist.add_(torch.bincount(row_spreads(x).clamp(max=63), minlength=64))

    vocab = lm.model.config.vocab_size
    handles = [
        m.register_forward_pre_hook(hook)
        for m in lm.model.modules()
        if isinstance(m, torch.nn.Linear) and m.out_features != vocab
    ]
    text = load_wikitext2_test()
    need = args.windows * args.seqlen
    ids = lm.tokenizer(text[: 60 * need], return_tensors="pt").input_ids[0, :need]
    if ids.numel() < need:
        raise SystemExit(f"WikiText-2 gave {ids.numel()} tokens, fewer than {need}")
    with torch.no_grad():
        for window in ids.view(args.windows, args.seqlen):
            lm.model(window[None])
    for h in handles:
        h.remove()
    rows = int(hist.sum())
    over = int(hist[FP8_EXACT_SPAN + 1 :].sum())
    rec: dict[str, Any] = {
        "kind": "torq.bench.fp8_row_spread",
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "exact_span": FP8_EXACT_SPAN,
        "weights": weights,
        "activation_rows": rows,
        "activation_rows_over_span": over,
        "activation_spread_histogram": {i: int(v) for i, v in enumerate(hist.tolist()) if v},
        "wall_seconds": time.time() - t0,
    }
    md = "\n".join(
        [
            f"FP8 prefill exactness on {args.model} (a row is exact when its nonzero blocks' "
            f"scales lie within 2**{FP8_EXACT_SPAN} of its largest)",
            "",
            "| rows | count | exact | largest spread (binades) |",
            "| --- | ---: | ---: | ---: |",
            f"| linear weights (whole matrices) | {weights['linears']} | {weights['exact']} | "
            f"{weights['max_spread']} |",
            f"| activation token rows ({args.windows}×{args.seqlen} WikiText-2 tokens, every "
            f"decoder linear) | {rows} | {rows - over} | "
            f"{max(int(i) for i in rec['activation_spread_histogram'])} |",
        ]
    )
    save(args.out, rec, md)


if __name__ == "__main__":
    main()
