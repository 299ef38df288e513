"""The ``torq`` command line: a thin layer over :mod:`torq.pipeline` and :mod:`torq.models`.

torq run --model smollm2-135m --methods fp,rtn --format mxfp4 --max-windows 40
torq eval --model smollm2-135m --methods fp,rtn --tasks arc_easy,piqa --limit 100
torq models
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from torq.errors import TorqError
from torq.logs import quiet_libraries

if TYPE_CHECKING:
    from torq.methods.settings import TorqSettings


# TORQ's block sizes K: the divisors of 32 with at least two columns, so K divides every
# width a 32-element MX block does (and NVFP4's 16) and has a Sylvester Hadamard matrix
ROTATION_BLOCKS = (2, 4, 8, 16, 32)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``, else a one-line error naming ``what``."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{value}'") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
        return n

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _balance_alpha(value: str) -> float | None:
    if value.strip().lower() in ("none", "off"):
        return None
    try:
        alpha = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1] or 'none', got '{value}'"
        ) from None
    if not 0.0 <= alpha <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'none', got {alpha}")
    return alpha


def _linear_names(value: str) -> tuple[str, ...]:
    from torq.methods.settings import LINEAR_NAME

    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names or not all(LINEAR_NAME.fullmatch(n) for n in names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated linear layer names such as o_proj, got '{value}'"
        )
    return names


def _format_name(value: str) -> str | None:
    from torq.formats import FORMAT_NAMES

    v = value.strip().lower()
    if v in ("none", "fp", "float"):
        return None
    if v not in FORMAT_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown format '{value}'; choose from {', '.join(FORMAT_NAMES)} or none"
        )
    return v


def build_parser() -> argparse.ArgumentParser:
    """The `torq` command line: `run`, `eval` and the other subcommands over the Python API."""
    parser = _Parser(
        prog="torq", description="TORQ: rotation-based MXFP4 W4A4 quantization of LLMs"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="quantize a model with several methods and compare perplexity")
    _add_run_arguments(run)
    ev = sub.add_parser(
        "eval",
        help="like run, plus the paper's zero-shot tasks through lm-evaluation-harness",
    )
    _add_run_arguments(ev)
    ev.add_argument(
        "--tasks",
        default="all",
        help="comma-separated: arc_challenge, arc_easy, hellaswag, lambada_openai, piqa, "
        "winogrande, or 'all' (read from <data-dir>/zeroshot/, hub fallback)",
    )
    which = ev.add_mutually_exclusive_group()
    which.add_argument(
        "--limit", type=_positive_int, default=None, help="first N examples of each task"
    )
    which.add_argument(
        "--subset",
        type=_positive_int,
        default=None,
        help="N questions of each task drawn at random with --subset-seed (the same ones for "
        "every method: rows compare question by question); needs the local task files",
    )
    ev.add_argument(
        "--subset-seed", type=int, default=0, help="which questions --subset draws (default 0)"
    )
    ev.add_argument("--task-batch-size", type=_positive_int, default=8, help="lm-eval batch size")
    ev.add_argument("--skip-ppl", action="store_true", help="zero-shot tasks only")
    ev.add_argument(
        "--no-shared-context",
        action="store_true",
        help="score each choice with its own forward pass (lm-eval's HFLM as it is)",
    )

    ex = sub.add_parser(
        "export",
        help="write a quantized checkpoint torq saved (--save-dir) in another format",
    )
    ex.add_argument(
        "--model", required=True, help="a folder torq saved (<save-dir>/<model>-<method>)"
    )
    ex.add_argument("--out", required=True, help="the folder to write")
    ex.add_argument(
        "--to",
        choices=["compressed-tensors"],
        default="compressed-tensors",
        help="compressed-tensors: what transformers and vLLM load (rtn, gptq, had32, "
        "had32+gptq; torq-had32 and torq-had32+gptq quantized with --fold-balance)",
    )
    ex.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    sub.add_parser("models", help="list the embedded default models")
    sub.add_parser("methods", help="list the registered quantization methods")
    return parser


def _add_run_arguments(run: argparse.ArgumentParser) -> None:
    """Arguments shared by ``torq run`` and ``torq eval``."""
    from torq.formats import SCALE_MODES

    run.add_argument(
        "--model", default="smollm2-135m", help="embedded default, HF folder, .gguf or hub id"
    )
    run.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (see 'torq methods'); default fp and torq's default "
        "recipe (torq+gptq: 'torq methods' marks it), or for a model saved quantized by "
        "--save-dir the method it was saved with",
    )
    run.add_argument(
        "--format",
        type=_format_name,
        default=argparse.SUPPRESS,
        help="weights and activations format (default mxfp4; a saved quantized model keeps "
        "its own)",
    )
    run.add_argument(
        "--w-format",
        type=_format_name,
        default=argparse.SUPPRESS,
        help="weight format, overrides --format ('none' keeps weights in float)",
    )
    run.add_argument(
        "--a-format",
        type=_format_name,
        default=argparse.SUPPRESS,
        help="activation format, overrides --format ('none' keeps activations in float)",
    )
    run.add_argument(
        "--scale-mode",
        choices=SCALE_MODES,
        default=argparse.SUPPRESS,
        help="MXFP4 block scale rule (default ocp; a saved quantized model keeps its own)",
    )
    run.add_argument(
        "--act-scale",
        choices=("dynamic", "static"),
        default="dynamic",
        help="NVFP4 activations' tensor scale: each tensor's own (dynamic, default) or one per "
        "activation quantizer calibrated on the calibration windows (static: what "
        "compressed-tensors and vLLM serve; needed to export NVFP4 W4A4)",
    )
    run.add_argument("--seqlen", type=_positive_int, default=2048, help="perplexity window length")
    run.add_argument(
        "--save-format",
        choices=["torq", "compressed-tensors"],
        default="torq",
        help="what --save-dir writes: torq's checkpoint, or compressed-tensors for transformers "
        "and vLLM (rtn, gptq, had32, had32+gptq, torq-had32 with --fold-balance; MXFP4, or "
        "NVFP4 weights with --a-format none; see torq export)",
    )
    run.add_argument(
        "--allow-long-windows",
        action="store_true",
        help="allow windows (--seqlen, --calib-seqlen) longer than the model's context",
    )
    run.add_argument(
        "--resume-dir",
        default=None,
        metavar="DIR",
        help="keep each method's perplexity windows and zero-shot answers in DIR as they are "
        "measured, and each quantized model; the same command again after a stop reloads the "
        "model instead of calibrating again and measures only what is missing; with --stream, "
        "keep the run's progress between layers: the same command again continues after the "
        "last layer kept",
    )
    run.add_argument(
        "--no-keep-models",
        action="store_true",
        help="with --resume-dir, keep the measurements but not the quantized models",
    )
    run.add_argument(
        "--max-windows", type=_positive_int, default=None, help="evaluate only the first N windows"
    )
    run.add_argument(
        "--eval-corpus",
        default="wikitext2-test",
        metavar="TEXT",
        help="the text perplexity is measured on: wikitext2-test (default, the paper's), "
        "wikipedia-en (held-out Wikipedia articles of the data directory) or a text file",
    )
    run.add_argument("--batch-size", type=_positive_int, default=1)
    run.add_argument(
        "--data-dir", default=None, help="data directory (default: $TORQ_DATA_DIR, else the HF hub)"
    )
    run.add_argument(
        "--seed",
        type=_nonnegative_int,
        default=0,
        help="seed of QuaRot's random Hadamard signs (calibration draws: --calib-seed)",
    )
    run.add_argument("--threads", type=_positive_int, default=None, help="torch intra-op threads")
    run.add_argument(
        "--device",
        default="cpu",
        help="where the model runs: cpu, cuda, cuda:N or auto (solvers stay on the CPU)",
    )
    run.add_argument(
        "--out", default=None, help="result JSON path (default: results/run-<model>-<time>.json)"
    )
    run.add_argument(
        "--save-dir",
        default=None,
        metavar="DIR",
        help="write each quantized model to DIR/<model>-<method>/ (config, tokenizer, packed "
        "4-bit weights and the online transforms in model.safetensors, or a shard per layer with "
        "--stream); evaluate it later "
        "with --model DIR/<model>-<method>, or load it with torq.export.load_quantized",
    )
    run.add_argument(
        "--stream",
        action="store_true",
        help="read the float checkpoint one decoder layer at a time: quantize and evaluate "
        "layer by layer in the memory of one layer, not the model; with --save-dir each "
        "quantized layer is written as it is done (zero-shot tasks then run on the saved "
        "checkpoint)",
    )
    run.add_argument(
        "--hidden-states",
        choices=("memory", "bfloat16", "disk"),
        default="memory",
        help="with --stream: keep the windows' hidden states between layers in memory in "
        "float32 (default, exact), in bfloat16 (half the memory; rounds them) or on disk "
        "(float32 files read one batch at a time: exact, for many calibration windows)",
    )
    run.add_argument(
        "--gguf-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="what a GGUF model is de-quantized to, once, tensor by tensor, in the cache "
        "(default float32: transformers' values; bfloat16 halves the disk and rounds them)",
    )
    run.add_argument(
        "--packed",
        action="store_true",
        help="load a saved quantized checkpoint with its MXFP4 W4A4 weights kept packed "
        "(4.25 bits a weight in memory instead of 32; the same arithmetic on a CPU within "
        "1e-5, the Triton kernels on a GPU)",
    )
    run.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="keep a saved quantized checkpoint's decoder layers on disk in a scratch folder "
        "under DIR while it is evaluated, read back one layer at a time (accelerate's "
        "device_map offload): for a model larger than memory, slowly; with --stream, for "
        "the --tasks on the checkpoints --save-dir writes",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bars")

    t = run.add_argument_group("TORQ (methods torq, torq-inter, torq-intra, torq-had32)")
    t.add_argument(
        "--calib-corpus",
        default="wikitext2-valid",
        help="wikitext2-valid, wikipedia-en, python-stdlib (this Python's standard library "
        "sources, a code corpus) or a text file",
    )
    t.add_argument("--calib-samples", type=_positive_int, default=128, help="calibration windows")
    t.add_argument(
        "--calib-seqlen", type=_positive_int, default=2048, help="calibration window length"
    )
    t.add_argument(
        "--calib-seed",
        type=_nonnegative_int,
        default=0,
        help="seed of the calibration windows, each group's token sample and the solver's "
        "subsample (the same for every method, whatever else runs)",
    )
    t.add_argument(
        "--sequential",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="calibrate each layer on the outputs of the already quantized layers",
    )
    t.add_argument(
        "--inter",
        choices=("givens", "closed_form"),
        default="givens",
        help="inter-block construction",
    )
    t.add_argument(
        "--angle",
        choices=("exact", "paper"),
        default="exact",
        help="Givens angle rule: exact equalization, or Algorithm 1's literal angle",
    )
    t.add_argument(
        "--shared-inter", action="store_true", help="one inter-block R for all positions"
    )
    t.add_argument(
        "--balance",
        type=_balance_alpha,
        default=0.5,
        help="channel balancing strength α before the rotations (torq's addition; "
        "0.5 is optimal), or 'none' for the paper's TORQ",
    )
    t.add_argument(
        "--torq-guard",
        type=float,
        default=None,
        metavar="FRACTION",
        help="hold back this fraction of each group's sampled tokens and keep TORQ's "
        "calibrated transform only where it lowers the W4A4 output error there, else the "
        "balanced 32-block Hadamard (torq-guard uses 0.25)",
    )
    t.add_argument(
        "--torq-calibrate",
        type=_linear_names,
        default=None,
        metavar="NAMES",
        help="comma-separated linear layers (e.g. o_proj) whose input groups get TORQ's "
        "calibrated rotations; the other groups get the balanced 32-block Hadamard "
        "(default: every group)",
    )
    t.add_argument(
        "--expert-down",
        choices=("per-expert", "shared"),
        default="per-expert",
        help="fused MoE experts: one down_proj input transform per expert, fitted on the "
        "tokens routed to it (default), or one shared, fitted on all experts' inputs pooled",
    )
    t.add_argument(
        "--fold-balance",
        action="store_true",
        help="do the channel balancing's division in the module that produces each input "
        "(the norm, v_proj's or up_proj's rows; o_proj's scales tied across the query heads "
        "of a value head) instead of online: torq-had32 can then be exported",
    )
    t.add_argument("--max-iter", type=int, default=10, help="intra-block MaxIter")
    t.add_argument("--pairs", type=_positive_int, default=None, help="intra-block P (default K/4)")
    t.add_argument("--lam", type=float, default=1.0, help="pair-selection weight λ")
    t.add_argument(
        "--k-top",
        type=_positive_int,
        default=None,
        help="intra-block candidate columns (default torq's: every column of the block, 32; "
        "the paper: K/2 = 16)",
    )
    t.add_argument(
        "--rotation-block",
        type=int,
        choices=ROTATION_BLOCKS,
        default=32,
        metavar="K",
        help="TORQ's block size K, the order of its rotations and of torq-had32's Hadamard "
        "(default 32, the MX block; 16 matches NVFP4's block)",
    )
    t.add_argument(
        "--objective", choices=("occupancy", "mse"), default="occupancy", help="intra-block loss"
    )
    t.add_argument(
        "--intra-init",
        choices=("identity", "hadamard"),
        default="hadamard",
        help="start Algorithm 2 from the block Hadamard (torq) or from I (the paper)",
    )
    t.add_argument(
        "--paper",
        action="store_true",
        help="TORQ exactly as the paper: no balancing, Algorithm 2 from I with K/2 candidates "
        "(overrides --balance, --intra-init and --k-top)",
    )
    t.add_argument(
        "--intra-samples",
        type=_positive_int,
        default=None,
        help="blocks the intra-block solver fits on (default: all sampled)",
    )
    t.add_argument("--gptq-damp", type=float, default=0.01, help="GPTQ dampening (× mean diag H)")
    t.add_argument(
        "--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal"
    )
    t.add_argument(
        "--gptq-scales",
        choices=["amax", "mse"],
        default="amax",
        help="GPTQ: each MX block's scale by the format's rule from its amax, or the "
        "power of two around it that rounds the block with the least error (as mr-gptq)",
    )
    t.add_argument(
        "--reservoir",
        type=_positive_int,
        default=1024,
        help="token vectors sampled per input group for the intra-block solver",
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(text).name or text).strip("_") or "model"


def torq_settings_from_args(args: argparse.Namespace) -> TorqSettings:
    """TORQ's settings (Algorithms 1–3 and torq's additions) as ``torq run``'s options give
    them; with no option given, :class:`~torq.methods.torq_rotation.TorqSettings`' defaults
    but the calibration's and the solver's seed, which ``--calib-seed`` sets. The benchmark
    scripts build theirs from the same defaults (a test holds them equal)."""
    from torq.calibration.data import CalibrationConfig
    from torq.methods.settings import TorqSettings
    from torq.rotations.inter_block import InterBlockConfig
    from torq.rotations.intra_block import IntraBlockConfig

    torq_settings = TorqSettings(
        inter=InterBlockConfig(construction=args.inter, angle=args.angle, shared=args.shared_inter),
        intra=IntraBlockConfig(
            max_iter=args.max_iter,
            pairs_per_step=args.pairs,
            lam=args.lam,
            # torq's default: every column of the block a candidate (32 for K = 32)
            k_top=args.rotation_block if args.k_top is None else args.k_top,
            objective=args.objective,
            max_samples=args.intra_samples,
            init=args.intra_init,
            seed=args.calib_seed,
        ),
        calibration=CalibrationConfig(
            corpus=args.calib_corpus,
            n_samples=args.calib_samples,
            seqlen=args.calib_seqlen,
            seed=args.calib_seed,
        ),
        sequential=args.sequential,
        reservoir_tokens=args.reservoir,
        block_size=args.rotation_block,
        balance=args.balance,
        guard=args.torq_guard,
        fold=args.fold_balance,
        calibrate=args.torq_calibrate,
        expert_down_shared=args.expert_down == "shared",
    )
    return torq_settings.paper() if args.paper else torq_settings


def _cmd_run(args: argparse.Namespace) -> int:
    import torch

    from torq.paths import check_destination
    from torq.pipeline import run
    from torq.results import write_json_atomic
    from torq.runs.config import RunConfig
    from torq.runs.report import markdown_table
    from torq.surgery.gptq import GPTQConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    fmt = getattr(args, "format", "mxfp4")
    w = getattr(args, "w_format", fmt)
    a = getattr(args, "a_format", fmt)
    scale_mode = getattr(args, "scale_mode", "ocp")
    torq_settings = torq_settings_from_args(args)
    from torq.runs.source import saved_formats, saved_manifest

    saved = saved_manifest(args.model)
    methods = args.methods
    if methods is None:
        from torq.methods import DEFAULT_METHOD

        methods = f"fp,{DEFAULT_METHOD}" if saved is None else (saved.get("method") or "saved")
    given = [f for f in ("format", "w_format", "a_format", "scale_mode") if hasattr(args, f)]
    formats = None if saved is None else saved_formats(saved)
    # the scale rule matters only to MXFP4 (saved_formats reports ocp otherwise)
    asked = (w, a, scale_mode if "mxfp4" in (w, a) else "ocp")
    if given and formats is not None and formats != asked:
        sw, sa, smode = formats
        raise TorqError(
            f"{args.model} was saved quantized with weights {sw or 'float'}, activations "
            f"{sa or 'float'}, scale rule {smode}; its formats cannot be changed by "
            f"{', '.join('--' + f.replace('_', '-') for f in given)}. Drop those flags, or "
            "quantize the float model again with them."
        )
    if args.act_scale == "static":
        if saved is not None:
            raise TorqError(
                f"{args.model} was saved quantized: it keeps its own activation scales; "
                "drop --act-scale, or quantize the float model again with it"
            )
        if (a or "none").lower() != "nvfp4":
            raise TorqError(
                "--act-scale static is NVFP4's static activation tensor scale: add "
                f"--a-format nvfp4 (activations here: {a or 'none'})"
            )
    config = RunConfig(
        model=args.model,
        methods=[m.strip() for m in methods.split(",") if m.strip()],
        weight_format=w,
        act_format=a,
        scale_mode=scale_mode,
        act_scale=args.act_scale,
        seqlen=args.seqlen,
        max_windows=args.max_windows,
        eval_corpus=args.eval_corpus,
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        seed=args.seed,
        resume_dir=args.resume_dir,
        keep_models=not args.no_keep_models,
        torq=torq_settings,
        gptq=GPTQConfig(
            damp=args.gptq_damp, act_order=args.act_order, scale_search=args.gptq_scales
        ),
        device=args.device,
        save_dir=args.save_dir,
        stream=args.stream,
        packed=args.packed,
        offload_dir=args.offload_dir,
        gguf_dtype=args.gguf_dtype,
        hidden_states=args.hidden_states,
        allow_long_windows=args.allow_long_windows,
        save_format=args.save_format,
    )
    if args.command == "eval":
        from torq.eval.zeroshot import parse_tasks

        config.tasks = parse_tasks(args.tasks)
        config.task_limit = args.limit
        config.task_subset = args.subset
        config.task_subset_seed = args.subset_seed
        config.task_batch_size = args.task_batch_size
        config.skip_ppl = args.skip_ppl
        config.shared_context = not args.no_shared_context
    out = Path(
        args.out
        or f"results/run-{_slug(args.model)}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    )

    check_destination(out, folder=False, what="--out")

    def save(record: dict) -> str:
        table = markdown_table(record)
        record["table"] = table
        write_json_atomic(out, record)
        status = "" if record["complete"] else "\n\n(partial: not every method has run yet)"
        out.with_suffix(".md").write_text(f"`{record['command']}`\n\n{table}{status}\n")
        return table

    with _library_bars(not args.no_progress):
        result = run(config, progress=not args.no_progress, on_row=save)
    table = save(result)
    print(table)
    if config.tasks and not config.skip_ppl:
        from torq.eval.figure import accuracy_perplexity_figure

        print(f"figure {accuracy_perplexity_figure(result, out.with_suffix('.png'))}")
    print(f"\nsaved {out} ({result['wall_seconds']:.0f} s)")
    return 0


@contextlib.contextmanager
def _library_bars(shown: bool) -> Iterator[None]:
    """``--no-progress`` also hides transformers' own bars (loading and writing weights),
    for the command only: the switch is process-wide, so it is put back afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not shown:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """The ``torq`` command: parse ``argv`` and run it; the exit status."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
        return status
    except BrokenPipeError:
        # the reader went away (`torq methods | head`): stop quietly, as Unix tools do, and
        # point stdout at /dev/null so that the interpreter's last flush cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="torq: %(message)s")
    quiet_libraries()  # torq's output and the libraries' errors only
    try:
        if args.command in ("run", "eval"):
            return _cmd_run(args)
        if args.command == "models":
            from torq.models.loading import EMBEDDED_MODELS

            for name, entry in EMBEDDED_MODELS.items():
                print(f"{name}\t{entry.description}\t({entry.install_hint})")
            return 0
        if args.command == "export":
            from torq.export.compressed_tensors import export_saved_compressed_tensors

            # read and written a decoder layer at a time: any model size
            out = export_saved_compressed_tensors(args.model, args.out, overwrite=args.overwrite)
            print(f"torq: wrote {out} ({args.to})")
            return 0
        if args.command == "methods":
            from torq.methods import DEFAULT_METHOD, METHODS, get_method

            default = get_method(DEFAULT_METHOD)
            print(f"{default.name}\t(default)\t{default.description}")
            for name, method in sorted(METHODS.items()):
                notes = []
                if method.supports_gptq:
                    notes.append(f"with GPTQ weights: {get_method(name + '+gptq').name}")
                print(f"{name}\t{method.description}" + "".join(f"\t({n})" for n in notes))
            return 0
    except (TorqError, ValueError, FileNotFoundError, NotImplementedError) as exc:
        print(f"torq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torq: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
