"""Brevitas's Qronos (or its GPTQ, or RTN) after its QuaRot rotations, MXFP4 W4A4, from its
own code, scored by torq's PPL.

Qronos (Zhang, Zhang, Colbert and Saab, ICLR 2026) quantizes each layer's weights against
the mismatched loss ``‖X W − X̃ Q‖²``: the float model's inputs ``X`` on one side, the
quantized model's ``X̃`` on the other. Its reference implementation is Brevitas's
(``brevitas.graph.qronos``), and Brevitas ships the recipe its Qronos page reports for MXFP4
W4A4 (``brevitas_examples/papers/qronos/llama3-w4a4-mxfp-quarot.yml``): QuaRot's Hadamard
rotations fused into the weights (R1, R2) with an online Hadamard before ``down_proj`` and
in the attention's SDPA region, OCP MXFP4 weights (MSE-chosen block scales) and activations
(dynamic, ``floor`` scale rounding: OCP's rule), act-order, and Qronos with ``alpha`` 1e-3.
This script runs that recipe through Brevitas's own LLM entry point
(``brevitas_examples.llm.main.quantize_llm``) on the float model torq loads, with torq's
calibration windows, and scores the result with ``torq.eval.perplexity`` on torq's
WikiText-2 windows, as Brevitas's own evaluation runs it (``quant_inference_mode``).

What had to change, each recorded under ``substitutes``:

* the data: Brevitas's loader reads WikiText-2 or C4 from the hub; here it returns torq's
  calibration windows (the file ``prepare`` writes), the same text every torq row sees;
* the device: Brevitas's block-by-block GPxQ loop (``llm_quant/gpxq.py``) moves every
  cached input to ``"cuda"``; without a GPU those moves go to the CPU;
* the precision: the model in float32 (the recipe's ``dtype`` is bfloat16), as in torq's
  rows.

Two steps, as for FlatQuant: ``prepare`` (torq's environment) writes the model folder and
the windows; ``run`` (Brevitas's environment, ``benchmarks/peers/setup-brevitas-venv.sh``)
quantizes and scores::

    python benchmarks/peers/brevitas_mxfp4.py prepare --model smollm2-135m \\
        --max-windows 16 --calib-samples 32 --out /tmp/smollm2-windows.pt
    BV=/path/to/brevitas-venv/bin/python
    $BV benchmarks/peers/brevitas_mxfp4.py run --windows /tmp/smollm2-windows.pt \\
        --algorithm qronos --threads 1 --out results/peers/brevitas-qronos-smollm2.json
"""

from __future__ import annotations

import argparse
import importlib.resources
import time
from pathlib import Path
from typing import Any

import torch

PEER = "brevitas"
RECIPE = "papers/qronos/llama3-w4a4-mxfp-quarot.yml"
ALGORITHMS = ("qronos", "gptq", "rtn")


def prepare(args: argparse.Namespace) -> int:
    """torq's float model folder, evaluation windows and calibration windows, in one file."""
    from peer_common import write_windows

    return write_windows(args, "brevitas_mxfp4")


def brevitas_args(
    config: Path, data: dict[str, Any], args: argparse.Namespace
) -> tuple[argparse.Namespace, Any]:
    """Brevitas's own argument namespace for ``quantize_llm``: the packaged recipe, the float
    model's folder, the calibration windows' count and length, the algorithm."""
    from brevitas_examples.common.parse_utils import override_defaults, parse_args
    from brevitas_examples.llm.llm_args import create_args_parser

    calib = data["calib"][: args.nsamples]
    argv = [
        "--config", str(config), "--model", data["model_folder"], "--dtype", "float32",
        "--nsamples", str(calib.shape[0]), "--seqlen", str(calib.shape[1]),
        "--seed", str(args.seed),
    ]  # fmt: skip
    if args.algorithm != "rtn":
        argv.append(f"--{args.algorithm}")
    if args.qronos_alpha is not None:
        argv += ["--qronos-alpha", str(args.qronos_alpha)]
    overrides = override_defaults(argv)
    parsed, extra = parse_args(create_args_parser(), argv, override_defaults=overrides)
    parsed.eval = False  # torq scores the model, on torq's windows
    parsed.few_shot_eval = None
    return parsed, extra


def install_substitutes(data: dict[str, Any], nsamples: int) -> dict[str, str]:
    """Brevitas's data loader returns torq's windows; its GPxQ loop's ``"cuda"`` moves go to
    the CPU when there is no GPU."""
    import brevitas_examples.llm.llm_quant.gpxq as gpxq
    import brevitas_examples.llm.main as bmain
    from datasets import Dataset

    def torq_windows(
        dataset_name: str, tokenizer: Any, nsamples: int = nsamples, seqlen: int = 2048,
        seed: int = 0, split: str = "train", **_: Any,
    ) -> Dataset:  # fmt: skip
        rows = data["calib"][:nsamples] if split == "train" else data["windows"][:1]
        return Dataset.from_dict({"input_ids": [r.numpy()[None] for r in rows]})

    bmain.get_dataset_for_model = torq_windows
    substitutes = {
        "data_utils.get_dataset_for_model": f"torq's calibration windows ({nsamples} x "
        f"{data['calib'].shape[1]} tokens of {data['calibration']['corpus']}, seed "
        f"{data['calibration']['seed']})",
        "dtype": "float32 (the recipe's bfloat16), as in torq's rows",
    }
    if not torch.cuda.is_available():
        send = gpxq.send_to_device

        def to_cpu(obj: Any, device: Any, *a: Any, **k: Any) -> Any:
            return send(obj, "cpu" if str(device).startswith("cuda") else device, *a, **k)

        gpxq.send_to_device = to_cpu
        substitutes["llm_quant.gpxq.send_to_device"] = "'cuda' read as 'cpu' (no GPU here)"
    return substitutes


def run(args: argparse.Namespace) -> int:
    from peer_common import evaluate, first_window_nll, package_versions, save_run_record

    if args.threads:
        torch.set_num_threads(args.threads)
    data = torch.load(args.windows, weights_only=False)
    nsamples = args.nsamples or int(data["calib"].shape[0])
    if nsamples > data["calib"].shape[0]:
        raise SystemExit(
            f"brevitas_mxfp4: --nsamples {nsamples} > the file's "
            f"{data['calib'].shape[0]} calibration windows"
        )
    args.nsamples = nsamples
    config = args.config or Path(str(importlib.resources.files("brevitas_examples") / RECIPE))
    if not Path(config).is_file():
        raise SystemExit(f"brevitas_mxfp4: no recipe file {config}")
    substitutes = install_substitutes(data, nsamples)
    import brevitas_examples.llm.main as bmain
    from brevitas.export.inference.manager import quant_inference_mode
    from transformers import AutoModelForCausalLM

    windows = data["windows"]
    progress = not args.no_progress
    float_model = AutoModelForCausalLM.from_pretrained(data["model_folder"], dtype=torch.float32)
    float_model.eval()
    record: dict[str, Any] = {"first_window_nll_float": first_window_nll(float_model, windows)}
    if args.with_fp:
        record["fp"] = evaluate(float_model, windows, "fp", progress)
    del float_model

    b_args, extra = brevitas_args(Path(config), data, args)
    start = time.perf_counter()
    _, model = bmain.quantize_llm(b_args, extra)
    record["quantize_seconds"] = time.perf_counter() - start
    first = {"input_ids": data["calib"][:1]}
    with torch.no_grad(), quant_inference_mode(model, compile=False):
        model(**first)  # Brevitas's own eval runs one batch first, to set the inference mode
        record["quantized"] = evaluate(model, windows, f"brevitas-{args.algorithm}", progress)
    keys = (
        "rotation", "rotation_mode", "rotation_orphan_sink", "rotation_sdpa_regions",
        "weight_quant_format", "weight_group_size", "weight_param_method",
        "weight_scale_precision", "input_quant_format", "input_group_size",
        "input_scale_type", "input_scale_precision", "scale_rounding_func_type",
        "gpxq_act_order", "qronos_alpha", "nsamples", "seqlen", "dtype",
    )  # fmt: skip
    record["recipe"] = {
        "api": "brevitas_examples.llm.main.quantize_llm",
        "config": str(RECIPE if args.config is None else config),
        "algorithm": args.algorithm,
        "settings": {k: getattr(b_args, k, None) for k in keys},
        "weights": f"MXFP4 ({args.algorithm}; MSE-chosen E8M0 scales) after QuaRot's "
        "fused rotations",
        "activations": "MXFP4, dynamic OCP scales (floor), after QuaRot's rotations and "
        "the online Hadamards",
        "calibration": {**data["calibration"], "n_samples": nsamples},
        "substitutes": substitutes,
    }
    versions = package_versions("brevitas", "torch", "transformers", "torq-mx")
    save_run_record(args, PEER, data, record, versions)
    print(
        f"brevitas {args.algorithm} on {data['model']}: W4A4 PPL "
        f"{record['quantized']['ppl']:.3f} (quantize {record['quantize_seconds']:.0f} s)"
    )
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from peer_common import two_step_parser

    parser, go = two_step_parser(__doc__, PEER, "Brevitas's environment: rotate, quantize, score")
    go.add_argument("--algorithm", choices=ALGORITHMS, default="qronos")
    go.add_argument("--config", type=Path, default=None, help=f"default: Brevitas's {RECIPE}")
    go.add_argument("--nsamples", type=int, default=None, help="calibration windows (all)")
    go.add_argument("--qronos-alpha", type=float, default=None, help="default: the recipe's")
    go.add_argument("--with-fp", action="store_true", help="also score the float model")
    args = parser.parse_args(argv)
    return prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
