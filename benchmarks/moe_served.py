"""The `default` on a MoE model as it is served, in torq: the experts' inputs unrotated
(neither transformers nor vLLM runs an online transform inside the experts), their
activations in 4 bits as torq and an FP4 engine run them, and in float as transformers runs
them (it de-quantizes the experts' weights as it loads them and quantizes the activations of
its linears only). The second row is what the compressed-tensors folder of the same
settings computes through transformers (``torq eval --model FOLDER``), up to bf16.

    python -m benchmarks.moe_served --model results/moe/smollm2-e8 --calib-samples 4 \\
        --max-windows 2 --out results/moe/served.json

Writes a record (``--out``, and its table beside it, ``.md``): FP, then both rows' perplexity
on the first ``--max-windows`` WikiText-2 test windows, and the calibration time.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from benchmarks.common import save
from torq.experimental import (
    command_line,
    load_model,
    load_wikitext2_test,
    machine_info,
    now_iso,
    perplexity,
    qlinear,
    served_unrotated,
    windows_from_text,
)


def experts_in_float(model: nn.Module) -> nn.Module:
    """A copy of torq's quantized ``model`` whose MoE experts read their inputs in float
    (their weights as quantized): what transformers computes of the served folder."""
    out = copy.deepcopy(model)
    for module in out.modules():
        if isinstance(module, qlinear.QuantExperts):
            module.input_quantizer = qlinear.ActivationQuantizer(None)
            module.down_quantizers = nn.ModuleList([qlinear.ActivationQuantizer(None)])
    return out


def main(argv: list[str] | None = None) -> None:
    import torq

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a MoE model torq loads (name or folder)")
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--max-windows", type=int, default=2, help="test windows for the PPLs")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True, help="the record (JSON)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    test = windows_from_text(load_wikitext2_test(args.data_dir), tokenizer, 2048, args.max_windows)
    ppl = {"fp": perplexity(model, test, progress=False).ppl}
    t0 = time.perf_counter()
    q = torq.quantize(
        model,
        tokenizer=tokenizer,
        calib_samples=args.calib_samples,
        data_dir=args.data_dir,
        progress=False,
    )
    seconds = time.perf_counter() - t0
    ppl["experts_4bit"] = perplexity(q, test, progress=False).ppl
    ppl["experts_float"] = perplexity(experts_in_float(q), test, progress=False).ppl
    record = {
        "model": args.model,
        "recipe": "default",
        "unrotated": list(served_unrotated(model)),
        "calib_samples": args.calib_samples,
        "windows": int(test.shape[0]),
        "ppl": ppl,
        "calibration_seconds": seconds,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
    }
    lines = [
        f"{args.model}, the `default` as served (experts unrotated), calibrated on "
        f"{args.calib_samples} windows; PPL on the first {test.shape[0]} WikiText-2 test "
        "windows of 2048 tokens",
        "",
        "| row | PPL |",
        "| --- | ---: |",
        f"| FP | {ppl['fp']:.3f} |",
        f"| experts' activations in 4 bits (torq, an FP4 engine) | {ppl['experts_4bit']:.3f} |",
        f"| experts' activations in float (transformers) | {ppl['experts_float']:.3f} |",
    ]
    save(args.out, record, "\n".join(lines))


if __name__ == "__main__":
    main()
