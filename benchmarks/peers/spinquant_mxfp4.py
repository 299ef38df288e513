"""SpinQuant from its own code (learned rotations R1 and R2; MXFP4 W4A4), scored by torq's PPL.

SpinQuant (facebookresearch/SpinQuant) learns the residual stream's rotation R1 and each
layer's value/output head rotation R2 with Cayley SGD on the Stiefel manifold
(``train_utils.optimizer.SGDG``), minimising the quantized network's language-model loss on
calibration text, with the norms fused and the online Hadamard R4 before ``down_proj``
(``train_utils.main.prepare_model`` on its ``LlamaForCausalLM`` of
``train_utils/modeling_llama_quant.py``, which rotates every weight by the current R1 and
R2 in each forward). Then its PTQ step folds the learned rotations into the weights
(``eval_utils.rotation_utils.rotate_model`` through ``eval_utils.main.ptq_model``), keeps
R4 online and quantizes. This script calls those functions of SpinQuant's own code on the
float model torq loads, trains with transformers' ``Trainer`` as its
``optimize_rotation.py`` does, and scores what is left with ``torq.eval.perplexity`` on
torq's WikiText-2 windows.

SpinQuant pins transformers 4.44.2; it runs here in FlatQuant's environment (transformers
4.45, ``benchmarks/peers/setup-flatquant-venv.sh``), so like FlatQuant's script it has two
steps: ``prepare`` (torq's environment) writes the float model's folder and torq's
evaluation and calibration windows; ``run`` trains, quantizes and scores, and first scores
the float model and checks that the learned rotations alone (quantizers off) leave its
first window's NLL unchanged.

SpinQuant's quantizers are integer only; here both are MXFP4 (blocks of 32 along the input
features, E8M0 scales under ``--scale-mode``, torq's ``torq.formats.fake_quant``) with the
straight-through gradient its integer ones use (``STEQuantize``):

* weights (``WeightQuantizer``): MXFP4 per block, in training (its ``QuantizeLinear``
  quantizes the rotated weight in every forward) and in the PTQ step: RTN (``--w_rtn``;
  the recipe with rotations trained against the W4A4 network, its
  ``10_optimize_rotation.sh M 4 4 16`` then ``2_eval_ptq.sh``), or with ``--w-quantizer
  gptq`` its GPTQ (``eval_utils.gptq_utils.gptq_fwrd``) on the calibration windows, each
  block of 32 columns' E8M0 scales fitted when its column loop reaches the block (its
  README trains the rotations for GPTQ weights against W16A4: ``--train-w-bits 16``;
  ``--rotations`` reuses a former run's);
* activations (``ActQuantizer``): MXFP4 per block of each token's features, on every
  linear layer's input (after R4 before ``down_proj``), ``lm_head`` in float.

What else differs from its scripts, recorded under ``substitutes``: no GPU here, so
``Tensor.to``/``Tensor.cuda`` map ``"cuda"`` to the CPU while its code runs, the
``RotateModule`` holding R1 and R2 is made on the CPU, and ``fast_hadamard_transform`` (a
CUDA extension) is a product with the Sylvester Hadamard matrix of the same order;
training runs in float32 (its scripts use bf16 on GPUs) without gradient checkpointing;
no NCCL process group (one process); the KV cache stays in float (``--k_bits 16
--v_bits 16``), as in every torq row. Its paper trains 100 steps on 800 WikiText-2 windows
of 2048 tokens (8 GPUs × batch 1, learning rate 1.5, cosine schedule); ``--steps`` and
``--nsamples`` cut that to this machine's budget (the steps cycle over the calibration
windows) and the record says by how much.

Usage::

    python benchmarks/peers/spinquant_mxfp4.py prepare --model smollm2-135m \\
        --max-windows 16 --calib-samples 32 --out /tmp/smollm2-windows.pt
    /path/to/flatquant-venv/bin/python benchmarks/peers/spinquant_mxfp4.py run \\
        --spinquant-repo PATH --windows /tmp/smollm2-windows.pt --steps 100 --threads 2 \\
        --out results/peers/spinquant-smollm2.json

where PATH is a copy of ``https://github.com/facebookresearch/SpinQuant`` (commit 8f47aa3
was used).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from peer_common import import_from_checkout, mxfp4_ste

PEER = "spinquant"
PAPER = {"windows": 800, "steps": 100, "batch": 8, "learning_rate": 1.5}


def sylvester(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The unnormalised Sylvester Hadamard matrix of order ``n`` (a power of two): what
    ``fast_hadamard_transform.hadamard_transform`` multiplies by."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"fast_hadamard_transform stand-in: order {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(dtype)


def install_fast_hadamard_stub() -> None:
    """A CPU stand-in for the CUDA extension ``fast_hadamard_transform`` (imported by
    SpinQuant's ``utils/utils.py``): ``hadamard_transform(x, scale)`` = ``scale · x Hₙ``."""
    cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        key = (x.shape[-1], x.dtype)
        if key not in cache:
            cache[key] = sylvester(*key)
        return (x @ cache[key]) * scale

    module = types.ModuleType("fast_hadamard_transform")
    module.hadamard_transform = hadamard_transform  # type: ignore[attr-defined]
    sys.modules["fast_hadamard_transform"] = module


def install_datasets_stub() -> None:
    """SpinQuant's ``utils/data_utils.py`` imports ``datasets`` for its WikiText download,
    which this script never calls (torq's windows are used); without the package installed,
    a module that says so in place of it."""
    import transformers  # noqa: F401  (first: it looks for the real package once, at import)

    try:
        import datasets  # noqa: F401
    except ImportError:

        def load_dataset(*args: Any, **kwargs: Any) -> Any:
            raise SystemExit("spinquant_mxfp4: SpinQuant's own data download is not used here")

        module = types.ModuleType("datasets")
        module.load_dataset = load_dataset  # type: ignore[attr-defined]
        sys.modules["datasets"] = module


def _on_cpu(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


@contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """While SpinQuant's code runs without a GPU: ``Tensor.to(..."cuda"...)`` goes to the
    CPU, ``Tensor.cuda()`` returns the tensor itself and ``torch.cuda.synchronize`` does
    nothing (its code names ``"cuda"`` in about forty places)."""
    if torch.cuda.is_available():
        yield
        return
    to, cuda = torch.Tensor.to, torch.Tensor.cuda

    def patched_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(_on_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return to(self, *args, **kwargs)

    synchronize = torch.cuda.synchronize
    torch.Tensor.to = patched_to  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *a, **k: None  # its GPTQ synchronizes after each weight
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.cuda = to, cuda  # type: ignore[method-assign]
        torch.cuda.synchronize = synchronize


def install_mxfp4(quant_utils: ModuleType, fmt: Any) -> None:
    """SpinQuant's integer weight and activation quantizers replaced by MXFP4 (module doc).

    The weight quantizer serves its three callers: training (``quantize`` of the whole
    rotated weight), its RTN (``fake_quantize`` of the whole weight) and its GPTQ
    (``find_params`` on each block of 32 columns as the column loop reaches it, then
    ``fake_quantize`` of one column ``[rows, 1]`` at a time with that block's scales).
    """
    from torq.experimental import exact_pow2, mx_scale_exponent, round_to_e2m1

    block = fmt.block_size

    def weight_find_params(self: Any, x: torch.Tensor) -> None:
        # A block of columns (its GPTQ): each row's E8M0 scale under the format's rule.
        # The whole weight (training, RTN): nothing to fit, fake_quantize finds its scales.
        self.scale = torch.ones(1)
        if x.shape[-1] == block:
            amax = x.abs().amax(dim=-1, keepdim=True).float()
            self.scale = exact_pow2(mx_scale_exponent(amax, fmt), torch.float32).to(x.dtype)

    def weight_quantize(self: Any, x: torch.Tensor) -> torch.Tensor:
        if self.bits < 16:
            return mxfp4_ste(x, fmt).to(x.dtype)
        return x

    def weight_fake_quantize(self: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(dequantized, E2M1 values, scales): its RTN reads the first; its GPTQ all three
        (the last two are for its ExecuTorch export)."""
        if self.bits >= 16:
            return x, x, torch.ones_like(x)
        if x.shape[-1] == 1:  # one column of its GPTQ, on the current block's scales
            scale = self.scale.to(x.dtype)
            codes = round_to_e2m1(x / scale)
            return codes * scale, codes, scale.expand_as(x)
        deq = weight_quantize(self, x)
        return deq, deq, torch.ones_like(x)

    def act_find_params(self: Any, x: torch.Tensor) -> None:
        return None

    def act_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if self.bits >= 16:
            return x
        return mxfp4_ste(x, fmt).to(x.dtype)

    quant_utils.WeightQuantizer.find_params = weight_find_params
    quant_utils.WeightQuantizer.fake_quantize = weight_fake_quantize
    quant_utils.WeightQuantizer.quantize = weight_quantize
    quant_utils.WeightQuantizer.ready = lambda self: True
    quant_utils.ActQuantizer.find_params = act_find_params
    quant_utils.ActQuantizer.forward = act_forward


def spinquant_args(
    w_bits: int, a_bits: int, seed: int, rotation: str | None, gptq_samples: int = 0
) -> Any:
    """SpinQuant's own PTQ arguments (``utils.process_args.parser_gen``, its defaults) for
    its scripts' W4A4 recipe, symmetric (MXFP4 has no zero point), KV in float: RTN weights
    (``--w_rtn``), or its GPTQ on ``gptq_samples`` windows with one block scale per 32
    columns (``--w_groupsize 32``: its column loop fits the scales at each block's start)."""
    from utils.process_args import parser_gen

    argv = ["spinquant", "--w_bits", str(w_bits), "--a_bits", str(a_bits), "--k_bits", "16",
            "--v_bits", "16", "--rotate", "--seed", str(seed)]  # fmt: skip
    if gptq_samples:
        argv += ["--w_groupsize", "32", "--nsamples", str(gptq_samples)]
    else:
        argv += ["--w_rtn"]
    saved = sys.argv
    sys.argv = argv
    try:
        args, _ = parser_gen()
    finally:
        sys.argv = saved
    args.optimized_rotation_path = rotation
    return args


def load_untied(folder: str, model_class: Any) -> torch.nn.Module:
    """torq's float folder in SpinQuant's model class, float32, ``lm_head`` untied from the
    embeddings as its scripts do ("SpinQuant is not compatible with tie_word_embeddings")."""
    from peer_common import legacy_llama_config

    config = legacy_llama_config(folder)
    tied = bool(config.tie_word_embeddings)
    config.tie_word_embeddings = False
    model = model_class.from_pretrained(folder, config=config, torch_dtype=torch.float32)
    if tied:
        model.lm_head.weight.data = model.model.embed_tokens.weight.data.clone()
    model.config.use_cache = False
    return model.eval()


class RotateModule(torch.nn.Module):
    """A learned rotation as SpinQuant's ``optimize_rotation.RotateModule`` holds it (its
    own is made on ``"cuda"``)."""

    def __init__(self, r_init: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(r_init.to(torch.float32))

    def forward(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        return x @ self.weight if transpose else self.weight @ x


def train_rotations(args: argparse.Namespace, data: dict[str, Any], out_dir: str) -> dict:
    """SpinQuant's ``optimize_rotation.train`` on one CPU process: R1 and every R2 from
    random Hadamards, Cayley SGD, transformers' ``Trainer``; returns the losses logged."""
    import transformers
    from train_utils.main import prepare_model
    from train_utils.modeling_llama_quant import LlamaForCausalLM as QuantLlama
    from train_utils.optimizer import SGDG
    from utils.hadamard_utils import random_hadamard_matrix

    ptq_args = spinquant_args(args.train_w_bits, 4, args.seed, None)
    model = load_untied(data["model_folder"], QuantLlama)
    model = prepare_model(ptq_args, model)
    for param in model.parameters():
        param.requires_grad = False
    config = model.config
    model.R1 = RotateModule(random_hadamard_matrix(config.hidden_size, "cpu"))
    head_dim = config.hidden_size // config.num_attention_heads
    for layer in model.model.layers:
        layer.self_attn.R2 = RotateModule(random_hadamard_matrix(head_dim, "cpu"))
    trainable = [model.R1.weight] + [layer.self_attn.R2.weight for layer in model.model.layers]
    calib = data["calib"][: args.nsamples]
    train_data = [{"input_ids": w, "labels": w.clone()} for w in calib]
    model.seqlen = int(calib.shape[1])
    training_args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=1, learning_rate=args.learning_rate,
        weight_decay=0.0, lr_scheduler_type="cosine", max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        seed=args.seed, dataloader_num_workers=0, disable_tqdm=args.no_progress,
    )  # fmt: skip
    # This environment's accelerate (0.32, for FlatQuant) calls optimizer.train()/eval() on
    # every step, which only schedule-free optimizers define; SGDG has nothing to switch.
    for mode in ("train", "eval"):
        if not hasattr(SGDG, mode):
            setattr(SGDG, mode, lambda self: None)
    optimizer = SGDG(trainable, lr=args.learning_rate, stiefel=True)
    trainer = transformers.Trainer(
        model=model, args=training_args, train_dataset=train_data,
        data_collator=transformers.default_data_collator, optimizers=(optimizer, None),
    )  # fmt: skip
    trainer.train()
    state = model.state_dict()
    rotations = {
        key.replace(".weight", ""): value.detach().clone()
        for key, value in state.items()
        if "R1.weight" in key or "self_attn.R2" in key
    }
    path = Path(out_dir) / "R.bin"
    torch.save(rotations, path)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"rotation_file": str(path), "losses": losses}


def ptq(
    data: dict[str, Any],
    w_bits: int,
    a_bits: int,
    seed: int,
    rotation: str,
    gptq_windows: torch.Tensor | None = None,
) -> Any:
    """SpinQuant's PTQ step (``eval_utils.main.ptq_model``) with the learned rotations;
    its GPTQ, when ``gptq_windows`` are given, reads them where it would download
    WikiText-2 (``utils.data_utils.get_wikitext2``)."""
    import eval_utils.main as ptq_main
    from eval_utils.modeling_llama import LlamaForCausalLM

    n = 0 if gptq_windows is None else int(gptq_windows.shape[0])
    if gptq_windows is not None:
        loader = [(w[None], w[None]) for w in gptq_windows]
        ptq_main.data_utils.get_wikitext2 = lambda *a, **k: loader
        if not torch.cuda.is_available():
            # its caller passes "cuda", which its buffers are allocated on
            gptq_fwrd = ptq_main.gptq_utils.gptq_fwrd
            ptq_main.gptq_utils.gptq_fwrd = lambda m, d, dev, a: gptq_fwrd(m, d, "cpu", a)
    model = load_untied(data["model_folder"], LlamaForCausalLM)
    ptq_args = spinquant_args(w_bits, a_bits, seed, rotation, n)
    model_args = types.SimpleNamespace(input_model=data["model_folder"])
    return ptq_main.ptq_model(ptq_args, model, model_args).eval()


def run(args: argparse.Namespace) -> int:
    from peer_common import (
        evaluate,
        first_window_nll,
        package_versions,
        rotation_check,
        save_run_record,
    )

    from torq.experimental import get_format

    if args.threads:
        torch.set_num_threads(args.threads)
    data = torch.load(args.windows, weights_only=False)
    if args.nsamples > data["calib"].shape[0]:
        raise SystemExit(
            f"spinquant_mxfp4: --nsamples {args.nsamples} > the file's "
            f"{data['calib'].shape[0]} calibration windows"
        )
    if not (args.spinquant_repo / "optimize_rotation.py").is_file():
        raise SystemExit(f"spinquant_mxfp4: {args.spinquant_repo} is not a SpinQuant checkout")
    substitutes: dict[str, str] = {
        "utils.quant_utils.WeightQuantizer": "MXFP4 per block of 32 (torq's fake_quantize), STE",
        "utils.quant_utils.ActQuantizer": "MXFP4 per block of 32 (torq's fake_quantize), STE",
        "fast_hadamard_transform": "x @ Sylvester Hadamard (a CUDA extension in its setup)",
        "optimize_rotation.RotateModule": "the same module, made on the CPU",
        "training precision": "float32 (its scripts: bf16 on GPUs), no gradient checkpointing",
        "distributed": "one process, no NCCL process group",
        "datasets": "a stand-in module when the package is absent (its download is not used)",
        "KV cache": "float (k_bits = v_bits = 16), as in torq's rows",
    }
    if not torch.cuda.is_available():
        substitutes["Tensor.to / Tensor.cuda"] = '"cuda" mapped to the CPU while its code runs'
    install_fast_hadamard_stub()
    install_datasets_stub()
    (quant_utils,) = import_from_checkout(Path(args.spinquant_repo), "utils.quant_utils")

    fmt = get_format("mxfp4", args.scale_mode)
    install_mxfp4(quant_utils, fmt)
    torch.manual_seed(args.seed)
    windows = data["windows"]
    progress = not args.no_progress
    import transformers

    float_model = load_untied(data["model_folder"], transformers.LlamaForCausalLM)
    record: dict[str, Any] = {}
    if not args.no_fp:
        record["fp"] = evaluate(float_model, windows, "fp", progress)
    nll_float = first_window_nll(float_model, windows)
    # SpinQuant's fuse_layer_norms subtracts each embedding row's mean, which an RMSNorm
    # model does not undo: the rotated float model is compared with the float model so
    # centred, and the centring's own shift is recorded beside it.
    with torch.no_grad():
        emb = float_model.model.embed_tokens.weight
        emb.copy_((emb.double() - emb.double().mean(-1, keepdim=True)).to(emb.dtype))
    nll_centred = first_window_nll(float_model, windows)
    del float_model

    start = time.perf_counter()
    if args.rotations is None:
        out_dir = str(args.work_dir or tempfile.mkdtemp(prefix="spinquant-"))
        with cuda_on_cpu():
            training = train_rotations(args, data, out_dir)
    else:
        training = {"rotation_file": str(args.rotations), "losses": None}
    trained = time.perf_counter()
    with cuda_on_cpu(), torch.no_grad():
        rotated = ptq(data, 16, 16, args.seed, training["rotation_file"])
        record["rotation_check"] = {
            **rotation_check(nll_centred, first_window_nll(rotated, windows)),
            "first_window_nll_uncentred_float": nll_float,
            "centring_shift": nll_centred - nll_float,
        }
        del rotated
        ptq_start = time.perf_counter()
        gptq_windows = data["calib"][: args.nsamples] if args.w_quantizer == "gptq" else None
        model = ptq(data, 4, 4, args.seed, training["rotation_file"], gptq_windows)
        ptq_seconds = time.perf_counter() - ptq_start
    record["quantize_seconds"] = trained - start + ptq_seconds
    record["training_seconds"] = trained - start
    record["training_losses"] = training["losses"]
    record["rotation_file"] = training["rotation_file"]
    with cuda_on_cpu():
        record["quantized"] = evaluate(model, windows, PEER, progress)
    steps_ratio = args.steps / PAPER["steps"]
    windows_ratio = args.steps / (PAPER["steps"] * PAPER["batch"])
    record["recipe"] = {
        "api": "train_utils.main.prepare_model, train_utils.optimizer.SGDG with "
        "transformers.Trainer (optimize_rotation.train), eval_utils.main.ptq_model",
        "weights": f"MXFP4 {args.w_quantizer.upper()} ({args.scale_mode} scales) after the "
        "learned R1, R2 and R4; "
        f"rotations trained against W{args.train_w_bits}A4",
        "activations": f"MXFP4 ({args.scale_mode} scales) on every linear input, R4 online "
        "before down_proj",
        "paper_recipe": PAPER,
        "budget": f"{args.steps} steps x batch 1 over {args.nsamples} windows = "
        f"{steps_ratio:.3f} of the paper's steps, {windows_ratio:.3f} of its window-steps",
        "calibration": data["calibration"],
        "substitutes": substitutes,
    }
    versions = package_versions("torch", "transformers", "accelerate", "torq-mx")
    save_run_record(args, PEER, data, record, versions, spinquant_commit=args.spinquant_commit)
    q = record["quantized"]["ppl"]
    fp = f"{record['fp']['ppl']:.3f}" if "fp" in record else "not scored (--no-fp)"
    check = record["rotation_check"]
    print(
        f"spinquant on {data['model']}: W4A4 PPL {q:.3f}  FP {fp}  "
        f"(training {record['training_seconds']:.0f} s; the rotations alone keep the "
        f"centred float model's first window: {check['equivalent']}, "
        f"|dNLL| {check['abs_diff']:.2e})"
    )
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from peer_common import two_step_parser, write_windows

    parser, go = two_step_parser(__doc__, PEER, "SpinQuant's code (FlatQuant's environment)")
    go.add_argument("--spinquant-repo", type=Path, required=True)
    go.add_argument("--spinquant-commit", default="8f47aa3")
    go.add_argument("--nsamples", type=int, default=32, help="calibration windows cycled")
    go.add_argument("--steps", type=int, default=100, help="Cayley SGD steps (batch 1)")
    go.add_argument("--learning-rate", type=float, default=PAPER["learning_rate"])
    go.add_argument(
        "--train-w-bits", type=int, default=4, choices=[4, 16],
        help="weights in the trained network: 4 (W4A4) or 16 (its note for GPTQ weights)",
    )  # fmt: skip
    go.add_argument("--scale-mode", default="ocp", choices=["ocp", "nearest"])
    go.add_argument(
        "--w-quantizer", default="rtn", choices=["rtn", "gptq"],
        help="its PTQ step's weights: RTN (--w_rtn) or its GPTQ on the --nsamples windows",
    )  # fmt: skip
    go.add_argument("--work-dir", type=Path, default=None, help="where R.bin is written")
    go.add_argument(
        "--no-fp", action="store_true",
        help="skip the float model's perplexity (a former run of the same windows has it)",
    )  # fmt: skip
    go.add_argument(
        "--rotations", type=Path, default=None,
        help="an R.bin a former run trained: no training, its PTQ step and the score only",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.step == "prepare":
        return write_windows(args, "spinquant_mxfp4")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
