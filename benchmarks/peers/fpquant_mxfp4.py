"""FP-Quant: block-Hadamard + MXFP4 W4A4 (pseudo-quantization), scored with torq's perplexity.

Recipe (fp-quant 0.3.2): ``FPQuantConfig(forward_dtype=MXFP4, forward_method=--method,
backward_dtype=BF16, hadamard_group_size=--group, transform_init=--transform,
pseudoquantization=True)`` and ``replace_quantize_with_fp_quant_linear(model, config)``,
which swaps every ``nn.Linear`` but ``lm_head`` for an ``FPQuantLinear`` and quantizes its
weight once. In the forward both operands are multiplied by the same block Hadamard
(group 32 / 64 / 128 along the input features), fake-quantized to FP4 E2M1 in groups of 32
by FP-Quant's Triton kernel, and multiplied in the rotated basis, where the Hadamards cancel
(an online block rotation like torq's ``had32``, no residual-stream rotation). Weights are
round-to-nearest: GPTQ lives in the FP-Quant research repository, not in the package.

Scale rules of the pseudo-quantization kernel (``--method``):

* ``quest`` (the library default): per group ``2^floor(log2(0.487 * std))``, values beyond
  6 scales clipped (a Gaussian-MSE clip, not the OCP amax rule);
* ``abs_max``: per group ``2^(floor(log2 amax) - 2) * 4/3``: the OCP exponent on values
  pre-scaled by 3/4 (the packed kernels move the 4/3 into a global scale).

On a machine without CUDA the Triton kernel runs in Triton's interpreter
(``TRITON_INTERPRET=1``, set by this script before Triton is imported). The interpreter
cannot time autotuning candidates, so the script keeps only the kernel's largest block
configuration (BLOCK_SIZE 16384); every group of 32 is computed the same way whatever the
block size, so the numbers do not change, only the time (expect minutes per 2048-token
window of SmolLM2 on two cores). On a GPU the kernel's ``tl.dot`` of float32 inputs uses
TF32 by default, so GPU and CPU numbers can differ in the last bits.

fp-quant 0.3.2 adds the bias twice in its pseudo-quantization path without master weights;
when any replaced Linear has a bias (Qwen2's q/k/v) the script keeps master weights
(``store_master_weights=True``: the same kernel re-quantizes the weight in every forward,
and that path adds the bias once) and says so in the JSON.

Usage: ``python benchmarks/peers/fpquant_mxfp4.py --model smollm2-135m --max-windows 16
--out results/peers/fpquant-smollm2.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from peer_common import (
    add_common_args,
    evaluate,
    package_versions,
    save_record,
    start,
    timed,
)

PEER = "fpquant"


def prepare_triton(device: str) -> dict[str, Any]:
    """Run FP-Quant's Triton kernel in the interpreter on CPU (must precede importing triton)."""
    if device.startswith("cuda"):
        return {"triton_interpret": False}
    os.environ["TRITON_INTERPRET"] = "1"
    import fp_quant.module.triton.mxfp4 as kernel_module

    kernel = kernel_module.mxfp4_forward_kernel
    kernel.configs = kernel.configs[-1:]
    return {
        "triton_interpret": True,
        "autotune_configs_kept": [str(c) for c in kernel.configs],
    }


def has_biased_linear(model: torch.nn.Module, skip: list[str]) -> bool:
    return any(
        isinstance(m, torch.nn.Linear) and m.bias is not None and not name.endswith(tuple(skip))
        for name, m in model.named_modules()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser, PEER)
    parser.add_argument("--method", choices=["quest", "abs_max"], default="quest")
    parser.add_argument("--group", type=int, choices=[32, 64, 128], default=32)
    parser.add_argument("--transform", choices=["hadamard", "identity", "gsr"], default="hadamard")
    parser.add_argument("--skip", nargs="*", default=["lm_head"], help="modules left in float")
    args = parser.parse_args(argv)

    triton_info = prepare_triton(args.device)
    from fp_quant import FPQuantConfig, FPQuantDtype, replace_quantize_with_fp_quant_linear

    subject, record, _ = start(args, check_rotation=False)
    model, windows, progress = subject.model, subject.windows, not args.no_progress

    master = has_biased_linear(model, args.skip)
    config = FPQuantConfig(
        forward_dtype=FPQuantDtype.MXFP4,
        forward_method=args.method,
        backward_dtype=FPQuantDtype.BF16,
        store_master_weights=master,
        hadamard_group_size=args.group,
        pseudoquantization=True,
        transform_init=args.transform,
        modules_to_not_convert=list(args.skip),
    )
    with timed() as t:
        replace_quantize_with_fp_quant_linear(model, config)
    record["quantize_seconds"] = t["seconds"]

    n_replaced = sum(1 for m in model.modules() if type(m).__name__ == "FPQuantLinear")
    record["quantized"] = evaluate(model, windows, PEER, progress)
    record["recipe"] = {
        "api": "fp_quant.replace_quantize_with_fp_quant_linear(model, FPQuantConfig(...))",
        "config": {
            "forward_dtype": "mxfp4",
            "forward_method": args.method,
            "backward_dtype": "bf16",
            "store_master_weights": master,
            "hadamard_group_size": args.group,
            "pseudoquantization": True,
            "transform_init": args.transform,
            "modules_to_not_convert": list(args.skip),
        },
        "store_master_weights_reason": (
            "a replaced Linear has a bias: fp-quant 0.3.2 adds it twice without master weights"
            if master
            else None
        ),
        "replaced_linears": n_replaced,
        "weights": "round-to-nearest (no GPTQ in the package)",
        **triton_info,
    }
    record["peer_versions"] = package_versions("fp-quant", "triton", "torch")
    save_record(args, PEER, subject, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
