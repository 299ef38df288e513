"""FlatQuant from its own code (learned affine transforms; MXFP4 W4A4), scored by torq's PPL.

FlatQuant (ruikangliu/FlatQuant) learns, layer by layer, an invertible Kronecker-factored
affine transform in front of every group of linear layers (q/k/v, o, up/gate, down), a
per-channel scale folded into the norms ("diag"), and clipping factors for the weights
(LWC) and the activations (LAC), by AdamW on the MSE between each decoder layer's float and
quantized outputs (``train_utils.cali_flat_quant``); then folds them in
(``flat_utils.reparameterize_model``) and quantizes the weights with RTN
(``gptq_utils.rtn_fwrd``). This script calls those three functions of FlatQuant's own code,
with its Llama model wrapper (``model_tools/llama31_utils.apply_flatquant_to_llama_31``), on
the float SmolLM2-135M that torq loads, and scores what they leave with
``torq.eval.perplexity`` on torq's WikiText-2 windows.

FlatQuant pins transformers 4.45, torq needs 4.56 or later, so the run has two steps in two
environments:

1. ``prepare`` (torq's environment) writes a file with the float model's folder, torq's
   evaluation windows and torq's calibration windows (``--calib-samples`` × 2048 tokens of
   ``--calib-corpus``, seed ``--calib-seed``), as every torq row sees them;
2. ``run`` (FlatQuant's environment: torch, transformers 4.45, accelerate, scipy, tqdm and
   torq installed with ``--no-deps`` for its formats and perplexity) trains and scores.
   It first scores the float model itself: that row equals torq's FP row only if
   transformers 4.45 reads torq's folder right (its RoPE base is moved from the newer
   ``rope_parameters`` into 4.45's ``rope_theta``).

FlatQuant's quantizers are integer only; here, in their place, both are MXFP4 (blocks of 32
along the input features, E8M0 scales under ``--scale-mode``, torq's
``torq.formats.fake_quant.fake_quantize``) with the straight-through gradient FlatQuant's
integer quantizers use (``round_ste``):

* weights (``WeightQuantizer``, in training and in ``rtn_fwrd``): MXFP4 per block, after
  FlatQuant's own LWC clamp of each output row (unchanged);
* activations (``ActivationQuantizer``): LAC's learned clipping factors, which FlatQuant
  applies to each token's range before its integer scale, here clamp each block of 32 to
  ``[sigmoid(c_min) min, sigmoid(c_max) max]`` of that block before MXFP4 (a power-of-two
  scale carries no gradient, the clamp does).

Three more changes, recorded under ``substitutes``: ``Tensor.cuda`` returns the tensor
itself when there is no GPU (FlatQuant's SmoothQuant-style initial scales are made with
``.cuda()``); training runs in float32 (FlatQuant's ``--deactive_amp``: its autocast is
CUDA's); the KV cache stays in float (``--k_bits 16 --v_bits 16``), as in every torq row.
The paper's Llama-3-8B recipe trains 15 epochs on 128 windows of 2048 tokens (learning
rate 5e-3, batch 4); ``--epochs`` and ``--nsamples`` cut that to this machine's budget and
the record says by how much.

Usage::

    python benchmarks/peers/flatquant_mxfp4.py prepare --model smollm2-135m \\
        --max-windows 16 --calib-samples 32 --out /tmp/smollm2-windows.pt
    FQ=/path/to/flatquant-venv/bin/python
    $FQ benchmarks/peers/flatquant_mxfp4.py run --flatquant-repo PATH \\
        --windows /tmp/smollm2-windows.pt --nsamples 32 --epochs 2 --threads 2 \\
        --out results/peers/flatquant-smollm2.json

where PATH is a copy of ``https://github.com/ruikangliu/FlatQuant`` (commit 9d88ffc was
used) and the FlatQuant environment is made by ``benchmarks/peers/setup-flatquant-venv.sh``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from peer_common import import_from_checkout, mxfp4_ste

PEER = "flatquant"


def prepare(args: argparse.Namespace) -> int:
    """torq's float model folder, evaluation windows and calibration windows, in one file."""
    from peer_common import write_windows

    return write_windows(args, "flatquant_mxfp4")


def install_mxfp4(quant_utils: ModuleType, fmt: Any) -> None:
    """FlatQuant's integer weight and activation quantizers replaced by MXFP4 (module doc)."""
    block = fmt.block_size

    def weight_find_params(self: Any, x: torch.Tensor) -> None:
        # MXFP4's block scales come from the weight itself; nothing to fit (RTN).
        self.scale = torch.ones(1)

    def weight_quantize(self: Any, x: torch.Tensor) -> torch.Tensor:
        if self.enable and self.bits < 16:
            return mxfp4_ste(x, fmt).to(x.dtype)
        return x

    def act_fake_quant(self: Any, x: torch.Tensor) -> torch.Tensor:
        if self.lac:
            shape = x.shape
            blocks = x.reshape(-1, shape[-1] // block, block)
            hi = blocks.amax(-1, keepdim=True).clamp(min=0) * self.sigmoid(self.clip_factor_a_max)
            lo = blocks.amin(-1, keepdim=True).clamp(max=0) * self.sigmoid(self.clip_factor_a_min)
            x = torch.maximum(torch.minimum(blocks, hi), lo).reshape(shape)
        return mxfp4_ste(x, fmt).to(x.dtype)

    quant_utils.WeightQuantizer.find_params = weight_find_params
    quant_utils.WeightQuantizer.quantize = weight_quantize
    quant_utils.WeightQuantizer.ready = lambda self: True
    quant_utils.ActivationQuantizer.fake_quant = act_fake_quant


def load_float_model(folder: str) -> torch.nn.Module:
    """torq's float folder read by transformers 4.45, its RoPE base carried over."""
    import transformers
    from peer_common import legacy_llama_config

    config = legacy_llama_config(folder)
    config._attn_implementation_internal = "eager"
    model = transformers.LlamaForCausalLM.from_pretrained(
        folder, config=config, torch_dtype=torch.float32, low_cpu_mem_usage=True
    )
    model.config.use_cache = False
    return model.eval()


def run(args: argparse.Namespace) -> int:
    from peer_common import evaluate, package_versions, save_run_record

    from torq.experimental import get_format

    if args.threads:
        torch.set_num_threads(args.threads)
    data = torch.load(args.windows, weights_only=False)
    if args.nsamples > data["calib"].shape[0]:
        raise SystemExit(
            f"flatquant_mxfp4: --nsamples {args.nsamples} > the file's "
            f"{data['calib'].shape[0]} calibration windows"
        )
    if args.nsamples % args.cali_bsz:
        raise SystemExit("flatquant_mxfp4: --nsamples must be a multiple of --cali-bsz")
    substitutes: dict[str, str] = {
        "quant_utils.WeightQuantizer": "MXFP4 per block of 32 (torq's fake_quantize), STE",
        "quant_utils.ActivationQuantizer": "LAC's clamp per block of 32, then MXFP4, STE",
        "training precision": "float32 (--deactive_amp; FlatQuant's autocast is CUDA's)",
        "KV cache": "float (k_bits = v_bits = 16), as in torq's rows",
    }
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        substitutes["torch.Tensor.cuda"] = "returns the tensor itself (no GPU here)"
    (quant_utils,) = import_from_checkout(Path(args.flatquant_repo), "flatquant.quant_utils")

    fmt = get_format("mxfp4", args.scale_mode)
    install_mxfp4(quant_utils, fmt)
    import gptq_utils
    from flatquant import flat_utils, train_utils
    from flatquant.model_tools.llama31_utils import apply_flatquant_to_llama_31

    torch.manual_seed(args.seed)
    model = load_float_model(data["model_folder"])
    windows = data["windows"]
    progress = not args.no_progress
    record: dict[str, Any] = {"fp": evaluate(model, windows, "fp", progress)}

    exp_dir = tempfile.mkdtemp(prefix="flatquant-")
    fq_args = SimpleNamespace(
        model=data["model_folder"], w_bits=4, a_bits=4, w_groupsize=-1, a_groupsize=-1,
        w_asym=False, a_asym=False, q_bits=16, k_bits=16, v_bits=16,
        q_asym=False, k_asym=False, v_asym=False,
        cali_trans=True, add_diag=True, lwc=True, lac=True,
        diag_init="sq_style", diag_alpha=args.diag_alpha, direct_inv=False,
        separate_vtrans=False, epochs=args.epochs, nsamples=args.nsamples,
        cali_bsz=args.cali_bsz, flat_lr=args.flat_lr, warmup=False, deactive_amp=True,
        exp_dir=exp_dir, gptq=False, gptq_mse=False, act_order=False, percdamp=0.01,
    )  # fmt: skip
    logger = logging.getLogger("flatquant")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model.seqlen = int(data["calibration"]["seqlen"])
    calib = data["calib"][: args.nsamples]
    loader = [(calib[i : i + 1],) for i in range(calib.shape[0])]
    start = time.perf_counter()
    model = apply_flatquant_to_llama_31(fq_args, model)
    train_utils.cali_flat_quant(fq_args, model, loader, torch.device("cpu"), logger)
    trained = time.perf_counter()
    flat_utils.reparameterize_model(model)
    gptq_utils.rtn_fwrd(model, torch.device("cpu"), fq_args)
    record["quantize_seconds"] = time.perf_counter() - start
    record["training_seconds"] = trained - start
    record["quantized"] = evaluate(model, windows, "flatquant", progress)
    paper = {"nsamples": 128, "epochs": 15, "cali_bsz": 4, "flat_lr": 5e-3}
    record["recipe"] = {
        "api": "train_utils.cali_flat_quant, flat_utils.reparameterize_model, "
        "gptq_utils.rtn_fwrd; model_tools.llama31_utils.apply_flatquant_to_llama_31",
        "args": vars(fq_args),
        "weights": f"MXFP4 RTN ({args.scale_mode} scales) after FlatQuant's transforms and LWC",
        "activations": f"MXFP4 ({args.scale_mode} scales) after FlatQuant's online transforms "
        "and LAC",
        "paper_recipe": paper,
        "budget": f"{args.nsamples} windows x {args.epochs} epochs = "
        f"{args.nsamples * args.epochs / (paper['nsamples'] * paper['epochs']):.3f} "
        "of the paper's training steps",
        "calibration": data["calibration"],
        "substitutes": substitutes,
    }
    versions = package_versions("torch", "transformers", "accelerate", "torq-mx")
    save_run_record(args, PEER, data, record, versions, flatquant_commit=args.flatquant_commit)
    q, fp = record["quantized"]["ppl"], record["fp"]["ppl"]
    print(
        f"flatquant on {data['model']}: W4A4 PPL {q:.3f}  FP {fp:.3f}  "
        f"(training {record['training_seconds']:.0f} s, in all {record['quantize_seconds']:.0f} s)"
    )
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from peer_common import two_step_parser

    parser, go = two_step_parser(__doc__, PEER, "FlatQuant's environment: train, quantize, score")
    go.add_argument("--flatquant-repo", type=Path, required=True)
    go.add_argument("--flatquant-commit", default="9d88ffc")
    go.add_argument("--nsamples", type=int, default=32, help="calibration windows trained on")
    go.add_argument("--epochs", type=int, default=15)
    go.add_argument("--cali-bsz", type=int, default=4)
    go.add_argument("--flat-lr", type=float, default=5e-3)
    go.add_argument("--diag-alpha", type=float, default=0.3)
    go.add_argument("--scale-mode", default="ocp", choices=["ocp", "nearest"])
    args = parser.parse_args(argv)
    return prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
