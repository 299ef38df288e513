"""WUSH run from its own code (its transform, RTN or GPTQ; MXFP4 W4A4), scored by torq's perplexity.

WUSH (IST-DASLab/WUSH) builds, for every block of 32 input features of every linear layer,
a data-aware non-orthogonal transform (a Hadamard times the square root of the block's
weight-times-Cholesky second moment; ``get_transform(transform_type="wush")`` in
``src/quantization/wush_gptq.py``) and quantizes the transformed weight with RTN or with its
GPTQ (Babai's nearest plane over the Hessian's Cholesky factor). At inference the
activation is multiplied by the same per-block transform and fake-quantized to MXFP4
(``QuantLinear`` / ``BlockTransformQuantizer`` in ``src/utils/wush_utils.py``).

This script calls WUSH's own ``wush_quantization_gptq(model, calibration_data, args,
device)`` (the function its ``model_quant.py`` calls) on the float model
``torq.models.load`` returns, with torq's calibration windows
(``torq.calibration.data.calibration_windows``: ``--calib-samples`` × ``--calib-seqlen``
tokens of ``--calib-corpus``, seed ``--calib-seed``) in place of its FineWeb-Edu download,
and scores the model it leaves with ``torq.eval.perplexity`` on torq's WikiText-2 windows.

WUSH's code needs a GPU in two places; on a machine without CUDA this script swaps in
PyTorch references of the same computations, checked against WUSH's own Triton kernels run
in Triton's interpreter before quantizing (``kernel_check`` in the JSON):

* ``accumulate_hessian`` (``src/quantization/accumulate_hessian.py``, a Triton kernel):
  ``H += Xᵀ X`` in float32; the check gives the largest relative difference (float sums in
  another order, not equal bit for bit). On a GPU the kernel's ``tl.dot`` of float32 inputs
  runs in TF32, so GPU Hessians carry TF32 rounding that these do not.
* FP-Quant's ``mxfp4_forward_kernel_wrapper`` with ``quest=False``, the activation quantizer
  WUSH's ``pseudoquantize_fp`` calls (identity Hadamard, ``abs_max``): per group of 32 the
  scale ``2^(floor(log2 amax) - 2) * 4/3`` and the kernel's own thresholds for E2M1 (ties
  towards zero); the check requires equality bit for bit.

Two more changes, each recorded under ``substitutes`` in the JSON:

* PyTorch's CPU ``cat`` has no kernel for ``float4_e2m1fn_x2``, so (without CUDA)
  ``collate_xxfp4`` concatenates the packed codes (kept for export only) as their bytes.
* WUSH's ``QuantLinear`` has no bias: a model whose Linears carry one (Qwen2's q/k/v)
  gets it back, added after the product (``keep_biases``).

WUSH's MXFP4 rule is its own and fixed in its code (no option changes it): both operands map
each block's largest magnitude into [3, 6) of the FP4 grid through a global scale of 3
(weights: the E8M0 scale is amax * 3/4 rounded to the nearest power of two by PyTorch's
cast; activations: the scale above). torq's ``ocp`` rule maps it into [4, 8) and ``nearest``
into [3.5, 7), both clipping at 6. WUSH's paper runs its models in
bfloat16 on 1024 FineWeb-Edu sequences; here the model is float32 (torq's float model) and
the calibration set is torq's.

Usage: ``python benchmarks/peers/wush_mxfp4.py --wush-repo PATH --model smollm2-135m
--max-windows 16 --calib-samples 32 --gptq --out results/peers/wush-gptq-smollm2.json``,
where PATH is a checkout of ``https://github.com/IST-DASLab/WUSH`` (commit db41ab4 was used).
It runs in torq's own environment (WUSH needs torch, transformers, scipy and triton).
``--tasks all --subset 200 --answers-dir R/smollm2-135m/wush-code-gptq-s0`` also scores the
zero-shot tasks as ``torq eval`` does, keeping the answers where
``benchmarks/zeroshot_paired.py --resume-dir R`` pairs them with torq's rows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from peer_common import (
    add_common_args,
    calibration_tokens,
    evaluate,
    import_from_checkout,
    load_subject,
    package_versions,
    resolve_data_dir,
    save_record,
    timed,
)

PEER = "wush"


def prepare_triton(device: str) -> None:
    """Without CUDA WUSH's Triton kernels can only run in the interpreter (set before Triton
    is imported), which the kernel check uses."""
    if not device.startswith("cuda"):
        os.environ["TRITON_INTERPRET"] = "1"


def import_wush(repo: Path) -> dict[str, ModuleType]:
    """WUSH's modules, imported from its checkout (its packages are named ``src`` and
    ``inference_lib``: :func:`import_from_checkout`)."""
    if not (repo / "src" / "quantization" / "wush_gptq.py").is_file():
        raise SystemExit(f"error: {repo} is not a WUSH checkout (no src/quantization/)")
    mxfp4_module, hessian_module, gptq_module, utils_module = import_from_checkout(
        repo,
        "inference_lib.src.fp_quant.module.triton.mxfp4",
        "src.quantization.accumulate_hessian",
        "src.quantization.wush_gptq",
        "src.utils.wush_utils",
    )
    return {
        "gptq": gptq_module,
        "utils": utils_module,
        "hessian": hessian_module,
        "mxfp4": mxfp4_module,
    }


def hessian_reference(mat_hessian: torch.Tensor, mat_input: torch.Tensor, **_: Any) -> torch.Tensor:
    """``accumulate_hessian``'s computation in PyTorch: ``H += Xᵀ X`` (float32), in place."""
    x = mat_input.reshape(-1, mat_input.shape[-1]).to(torch.float32)
    mat_hessian += x.T @ x
    return mat_hessian


def mxfp4_abs_max_reference(
    x: torch.Tensor,
    hadamard_matrix: torch.Tensor,
    return_clip_mask: bool = False,
    gaussian_scale: float = 3 / 4,
    quest: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FP-Quant's ``mxfp4_forward_kernel`` with ``quest=False`` in PyTorch, operation by
    operation (the only path WUSH's activation quantizer takes)."""
    if quest:
        raise NotImplementedError("only the abs_max path (quest=False) WUSH uses")
    dim = hadamard_matrix.shape[-1]
    flat = x.contiguous().reshape(-1, dim) @ hadamard_matrix.to(x.device, x.dtype)
    grouped = flat.reshape(-1, 32)
    scales = grouped.abs().amax(dim=-1, keepdim=True)
    shared_exps = torch.exp2(torch.floor(torch.log2(scales)) - 2) / gaussian_scale
    scaled = grouped / shared_exps
    mag = scaled.abs()
    fp4 = torch.zeros_like(mag)
    # the kernel's nested tl.where: the largest threshold passed (strictly) wins
    steps = ((0.25, 0.5), (0.75, 1.0), (1.25, 1.5), (1.75, 2.0), (2.5, 3.0), (3.5, 4.0), (5.0, 6.0))
    for threshold, value in steps:
        fp4 = torch.where(mag > threshold, torch.full_like(mag, value), fp4)
    sign = torch.where(scaled > 0, 1.0, -1.0).to(mag.dtype)
    out = (fp4 * sign * shared_exps).reshape(x.shape)
    clip = (mag < 6).reshape(x.shape) if return_clip_mask else None
    return out, clip


def collate_as_bytes(original: Any) -> Any:
    """WUSH's ``collate_xxfp4`` with the packed FP4 codes concatenated as their bytes:
    PyTorch's CPU ``cat`` has no ``float4_e2m1fn_x2`` kernel (the codes are kept for export
    only; the fake-quantized weight is the same)."""

    def collate(*results: dict, dtype: torch.dtype) -> dict:
        for result in results:
            result["e2m1"] = result["e2m1"].view(torch.uint8)
        out = original(*results, dtype=dtype)
        out["qweight"] = out["qweight"].view(torch.float4_e2m1fn_x2)
        return out

    return collate


def kernel_check(modules: dict[str, ModuleType], seed: int) -> dict[str, Any]:
    """WUSH's Triton kernels (in the interpreter) against the references above."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4096, generator=gen) * torch.exp(torch.randn(8, 4096, generator=gen))
    x[0, :32] = 0.0  # an all-zero group: NaN in both (amax 0 gives a zero scale)
    eye = torch.eye(32)
    # the interpreter cannot time autotuning candidates: keep the largest block the kernel
    # offers (every group of 32 is computed the same way whatever the block size)
    import triton

    autotuned = modules["mxfp4"].mxfp4_forward_kernel
    autotuned.configs = [triton.Config({"BLOCK_SIZE": 512 * 32}, num_warps=1, num_stages=1)]
    autotuned.early_config_prune = None
    theirs, _ = modules["utils"].mxfp4_forward_kernel_wrapper(
        x, eye, return_clip_mask=True, quest=False, gaussian_scale=3 / 4
    )
    ours, _ = mxfp4_abs_max_reference(x, eye, return_clip_mask=True, quest=False)
    same = bool(torch.equal(theirs.nan_to_num(7.0), ours.nan_to_num(7.0)))
    if not same:
        raise SystemExit("error: the activation quantizer's reference differs from WUSH's kernel")

    kernel = modules["hessian"].accumulate_hessian_triton_kernel.fn  # below the autotuner
    inp = torch.randn(300, 96, generator=gen)
    h_theirs = torch.randn(96, 96, generator=gen)
    h_theirs = (h_theirs + h_theirs.T).contiguous()
    h_ours = h_theirs.clone()
    kernel[(1 * 2 * 2,)](
        h_theirs, inp, 96, 300, False, True, 1,
        BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=2,
    )  # fmt: skip
    hessian_reference(h_ours, inp)
    rel = float((h_theirs - h_ours).abs().max() / h_ours.abs().max())
    if rel > 1e-5:
        raise SystemExit(f"error: the Hessian reference differs from WUSH's kernel ({rel:.2e})")
    return {
        "activation_quantizer": "equal bit for bit on 8x4096 values (an all-zero group included)",
        "hessian_max_relative_difference": rel,
    }


def keep_biases(modules: dict[str, ModuleType], model: torch.nn.Module) -> int:
    """Give WUSH's ``QuantLinear`` the bias of the Linear it replaces.

    WUSH builds each quantized layer from the weight alone (``quantize_layers`` →
    ``QuantLinear(weight, activation_quantizer)``), so a Linear's bias is dropped: no
    matter for Llama or Qwen3, whose Linears have none, but Qwen2's q/k/v have one. The
    bias is found by the weight tensor it belongs to and added after the product."""
    biases = {
        id(m.weight): m.bias
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.bias is not None
    }
    if not biases:
        return 0
    gptq, utils = modules["gptq"], modules["utils"]
    original_quantize, original_forward = gptq.quantize_layers, utils.QuantLinear.forward

    def quantize_layers(*weights: torch.Tensor, **kwargs: Any) -> Any:
        layers, results = original_quantize(*weights, **kwargs)
        for layer, weight in zip(layers, weights, strict=True):
            layer.wush_bias = biases.get(id(weight))
        return layers, results

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        y = original_forward(self, x)
        bias = getattr(self, "wush_bias", None)
        return y if bias is None else y + bias

    gptq.quantize_layers = quantize_layers
    utils.QuantLinear.forward = forward
    return len(biases)


def zeroshot(args: argparse.Namespace, model: torch.nn.Module, subject: Any) -> dict[str, Any]:
    """torq's zero-shot scoring of the quantized model (lm-eval, in process), its answers
    kept in ``--answers-dir`` for a paired comparison with torq's rows."""
    from torq.experimental import FolderStore, evaluate_zeroshot, parse_tasks

    result = evaluate_zeroshot(
        model,
        subject.tokenizer,
        parse_tasks(args.tasks),
        data_dir=resolve_data_dir(args.data_dir),
        subset=args.subset,
        subset_seed=args.subset_seed,
        progress=not args.no_progress,
        store=None if args.answers_dir is None else FolderStore(args.answers_dir),
    )
    return {**result["scores"], "seconds": result["seconds"], "subset": result["subset"]}


def git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_common_args(parser, PEER)
    parser.add_argument(
        "--wush-repo", required=True, type=Path, help="a checkout of IST-DASLab/WUSH"
    )
    parser.add_argument("--gptq", action="store_true", help="WUSH's GPTQ (else RTN)")
    parser.add_argument(
        "--transform",
        choices=["wush", "hadamard", "identity"],
        default="wush",
        help="WUSH's --transform_class",
    )
    parser.add_argument("--calib-corpus", default="wikitext2-valid")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-seqlen", type=int, default=2048)
    parser.add_argument("--calib-seed", type=int, default=0)
    parser.add_argument(
        "--tasks", default=None, help="also the zero-shot tasks (as torq eval --tasks), e.g. all"
    )
    parser.add_argument("--subset", type=int, default=None, help="questions per task, seeded")
    parser.add_argument("--subset-seed", type=int, default=0)
    parser.add_argument(
        "--answers-dir",
        type=Path,
        default=None,
        help="keep the zero-shot answers here (a folder benchmarks/zeroshot_paired.py reads: "
        "<resume-dir>/<model>/<name>-<tag>)",
    )
    args = parser.parse_args(argv)

    prepare_triton(args.device)
    modules = import_wush(args.wush_repo)
    substitutes: dict[str, str] = {}
    check = None
    if not args.device.startswith("cuda"):
        check = kernel_check(modules, args.seed)
        modules["gptq"].accumulate_hessian = hessian_reference
        modules["utils"].mxfp4_forward_kernel_wrapper = mxfp4_abs_max_reference
        modules["gptq"].collate_xxfp4 = collate_as_bytes(modules["gptq"].collate_xxfp4)
        substitutes = {
            "wush_gptq.collate_xxfp4": "the same; the packed codes concatenated as bytes",
            "wush_gptq.accumulate_hessian": "hessian_reference (H += X^T X, float32)",
            "wush_utils.mxfp4_forward_kernel_wrapper": "mxfp4_abs_max_reference",
        }

    subject = load_subject(args)
    progress = not args.no_progress
    record: dict[str, Any] = {}
    if args.with_fp:
        record["fp"] = evaluate(subject.model, subject.windows, "fp", progress)

    samples = [row[None] for row in calibration_tokens(args, subject)]  # (1, L) each
    model = subject.model
    model.config.use_cache = False
    wush_args = SimpleNamespace(
        format="mxfp",
        gptq=args.gptq,
        transform_class=args.transform,
        cpu_offload_activations=False,
        cpu_offload_modules=False,
        export_quantized_model="",
    )
    biased = keep_biases(modules, model)
    if biased:
        substitutes["wush_gptq.quantize_layers"] = (
            f"the same, each layer keeping its bias ({biased})"
        )
    with timed() as t:
        modules["gptq"].wush_quantization_gptq(model, samples, wush_args, torch.device(args.device))
    record["quantize_seconds"] = t["seconds"]
    record["quantized"] = evaluate(
        model, subject.windows, f"wush-{'gptq' if args.gptq else 'rtn'}", progress
    )
    record["recipe"] = {
        "api": "src.quantization.wush_gptq.wush_quantization_gptq(model, data, args, device)",
        "args": vars(wush_args),
        "weights": "MXFP4 through WUSH's rtn_xxfp4 (E8M0 scale of amax*3/4, global scale 3), "
        + ("its GPTQ (Babai)" if args.gptq else "RTN"),
        "activations": "MXFP4 through FP-Quant's abs_max kernel (scale 2^(floor(log2 amax)-2)*4/3)",
        "calibration": {
            "corpus": args.calib_corpus,
            "samples": len(samples),
            "seqlen": int(samples[0].shape[-1]),
            "seed": args.calib_seed,
        },
        "substitutes": substitutes,
        "kernel_check": check,
        "wush_commit": git_commit(args.wush_repo),
    }
    if args.tasks:
        record["zeroshot"] = zeroshot(args, model, subject)
    record["peer_versions"] = package_versions("torch", "transformers", "scipy", "triton")
    save_record(args, PEER, subject, record, label=f"WUSH {'GPTQ' if args.gptq else 'RTN'} W4A4")
    return 0


if __name__ == "__main__":
    sys.exit(main())
