"""The ``torq`` command line's arguments: the parser of each command, its everyday options
in groups and the research knobs under ``--help-all``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

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


def _strength(value: str) -> float:
    alpha = _balance_alpha(value)
    if alpha is None:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got '{value}'")
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


# what each command's default --help shows, by group; every other option is under --help-all
EVERYDAY: dict[str, tuple[str, ...]] = {
    "model": ("model", "format", "device", "threads"),
    "recipe": ("recipe", "methods", "calib_samples", "calib_corpus"),
    "data": ("max_windows", "data_dir", "tasks"),
    "output": ("out", "save_dir", "save_format", "resume_dir", "overwrite", "no_progress"),
}


def _arrange_help(parser: argparse.ArgumentParser, show_all: bool) -> None:
    """Put a command's everyday options in the groups of :data:`EVERYDAY`; the rest (the
    research knobs, long-run and memory options) are hidden from ``--help`` and shown by
    ``--help-all`` in a group of their own."""
    by_dest = {a.dest: a for a in parser._actions}
    for group in parser._action_groups:
        group._group_actions.clear()
    for title, dests in EVERYDAY.items():
        shown = [by_dest[d] for d in dests if d in by_dest]
        if shown:
            parser.add_argument_group(title)._group_actions.extend(shown)
    everyday = {d for dests in EVERYDAY.values() for d in dests} | {"help", "help_all"}
    rest = [a for a in parser._actions if a.dest not in everyday]
    if show_all:
        parser.add_argument_group("research and long runs")._group_actions.extend(rest)
    else:
        for action in rest:
            action.help = argparse.SUPPRESS
    options = next(g for g in parser._action_groups if g.title == "options")
    options._group_actions.extend(a for a in parser._actions if a.dest in ("help", "help_all"))


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """The `torq` command line: `quantize`, `eval`, `run` and the other subcommands over
    the Python API (:mod:`torq.api`). ``show_all``: every option in the help
    (``--help-all``), not only the everyday ones."""
    parser = _Parser(
        prog="torq", description="TORQ: rotation-based MXFP4 W4A4 quantization of LLMs"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    qz = sub.add_parser(
        "quantize",
        help="quantize a model with a recipe and write a checkpoint transformers and vLLM load",
    )
    _add_quantize_arguments(qz)
    run = sub.add_parser("run", help="quantize a model with several methods and compare perplexity")
    _add_run_arguments(run)
    ev = sub.add_parser(
        "eval",
        help="evaluate a model (float, or a folder torq wrote): perplexity, and with --tasks "
        "the paper's zero-shot tasks through lm-evaluation-harness",
    )
    _add_run_arguments(ev)
    ev.add_argument(
        "--tasks",
        default=None,
        help="zero-shot tasks, comma-separated: arc_challenge, arc_easy, hellaswag, "
        "lambada_openai, piqa, winogrande, or 'all' (read from <data-dir>/zeroshot/, hub "
        "fallback); default none: perplexity only",
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
    ex.add_argument(
        "--help-all", action="store_true", help="show every option (research knobs included)"
    )
    gen = sub.add_parser(
        "generate",
        help="generate text with a model (float, or a folder torq wrote), on torq's kernels "
        "with --packed",
    )
    gen.add_argument("--model", required=True, help="a folder torq wrote, or a float model")
    gen.add_argument("--prompt", default="The capital of France is", help="the text to go on from")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64)
    gen.add_argument(
        "--packed",
        action="store_true",
        help="its MXFP4 W4A4 layers on torq's packed kernels (the Triton kernels on a GPU)",
    )
    gen.add_argument(
        "--cuda-graph",
        action="store_true",
        help="decode with one step captured as a CUDA graph over a static cache, as a serving "
        "engine does (a GPU only)",
    )
    gen.add_argument(
        "--compile",
        action="store_true",
        help="decode with the step through torch.compile, one graph with torq's kernels in it "
        "(its first token takes a while; on a GPU with --cuda-graph, the fastest)",
    )
    gen.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when there)"
    )
    gen.add_argument("--threads", type=_positive_int, default=None, help="CPU threads")
    sub.add_parser("models", help="list the embedded default models")
    sub.add_parser("methods", help="list the recipes and the registered quantization methods")
    for command in (qz, run, ev, ex):
        _arrange_help(command, show_all)
    return parser


def _add_quantize_arguments(qz: argparse.ArgumentParser) -> None:
    """``torq quantize MODEL --out DIR``: one recipe, streamed, written to ``DIR``."""
    from torq.calibration.data import ARITHMETICS
    from torq.methods.recipes import DEFAULT_RECIPE, RECIPES

    qz.add_argument(
        "model", help="the float model: embedded name, Hugging Face folder or .gguf file"
    )
    qz.add_argument("--out", required=True, help="the folder to write")
    qz.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default=DEFAULT_RECIPE,
        help=f"what to quantize with (default: {DEFAULT_RECIPE}): "
        + "; ".join(f"{r.name}: {r.use_when}" for r in RECIPES.values()),
    )
    qz.add_argument(
        "--format",
        choices=("mxfp4", "nvfp4", "mxint4"),
        default="mxfp4",
        help="weights and activations in 4 bits (default mxfp4)",
    )
    qz.add_argument(
        "--calib-samples",
        type=_positive_int,
        default=128,
        help="calibration windows of 2048 tokens (default 128, the paper's)",
    )
    qz.add_argument(
        "--calib-corpus",
        default="wikitext2-valid",
        help="wikitext2-valid (default), wikipedia-en, python-stdlib or a text file",
    )
    qz.add_argument(
        "--data-dir", default=None, help="data directory (default: $TORQ_DATA_DIR, else the hub)"
    )
    qz.add_argument(
        "--save-format",
        choices=("compressed-tensors", "torq"),
        default=None,
        help="compressed-tensors when the recipe can be served (default), else torq's own",
    )
    qz.add_argument("--overwrite", action="store_true", help="replace --out if it holds files")
    qz.add_argument("--threads", type=_positive_int, default=None, help="torch intra-op threads")
    qz.add_argument(
        "--device",
        default="auto",
        help="where the layers calibrate, TORQ's rotation solvers included: cpu, cuda, "
        "cuda:N or auto (default: cuda when there)",
    )
    qz.add_argument("--no-progress", action="store_true", help="no progress bars")
    qz.add_argument(
        "--calib-arithmetic",
        choices=ARITHMETICS,
        default="exact",
        help="the calibration's products: exact, or tf32 on a CUDA GPU (faster; see "
        "docs/large-models.md)",
    )
    qz.add_argument(
        "--rotate-biased",
        action="store_true",
        help="rotate the inputs of linears with a bias too (Qwen2's q/k/v), which the default "
        "and fast recipes leave unrotated: a lower perplexity, but vLLM 0.32 cannot load the "
        "folder (transformers and torq can)",
    )
    qz.add_argument(
        "--calib-seqlen", type=_positive_int, default=2048, help="calibration window length"
    )
    qz.add_argument(
        "--calib-seed", type=_nonnegative_int, default=0, help="which calibration windows"
    )
    qz.add_argument(
        "--help-all", action="store_true", help="show every option (research knobs included)"
    )


def _add_run_arguments(run: argparse.ArgumentParser) -> None:
    """Arguments shared by ``torq run`` and ``torq eval``."""
    from torq.calibration.data import ARITHMETICS
    from torq.formats import SCALE_MODES
    from torq.methods.settings import BALANCE_PROBES, SOLVER_DEVICES

    run.add_argument(
        "--help-all", action="store_true", help="show every option (research knobs included)"
    )
    run.add_argument(
        "--model", default="smollm2-135m", help="embedded default, HF folder, .gguf or hub id"
    )
    run.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (see 'torq methods'); default: for a folder torq wrote, "
        "the method it holds; for a float model, torq eval: fp, torq run: fp and the default "
        "recipe (torq-had32+gptaq, balancing folded, nearest scales)",
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
        help="keep each method's progress in DIR as it goes (its quantized layers, zero-shot "
        "answers, its finished row): the same command again after a stop continues after the "
        "last layer kept and measures only what is missing",
    )
    run.add_argument(
        "--max-windows", type=_positive_int, default=None, help="evaluate only the first N windows"
    )
    run.add_argument(
        "--window-sample",
        type=_positive_int,
        default=None,
        metavar="N",
        help="evaluate N windows drawn at random with --window-sample-seed (the same for every "
        "row) instead of the first ones; ×FP is then the whole test's ratio estimated window "
        "by window, with its 95%% interval",
    )
    run.add_argument(
        "--window-sample-seed",
        type=int,
        default=0,
        metavar="S",
        help="which windows --window-sample draws (default 0)",
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
        help="where the model runs: cpu, cuda, cuda:N or auto",
    )
    run.add_argument(
        "--out", default=None, help="result JSON path (default: results/run-<model>-<time>.json)"
    )
    run.add_argument(
        "--save-dir",
        default=None,
        metavar="DIR",
        help="write each quantized model to DIR/<model>-<method>/ (config, tokenizer, packed "
        "4-bit weights and the online transforms, a shard per layer written as it is done); "
        "evaluate it later "
        "with --model DIR/<model>-<method>, or load it with torq.export.load_quantized",
    )
    run.add_argument(
        "--hidden-states",
        choices=("auto", "memory", "bfloat16", "disk"),
        default="auto",
        help="keep the windows' hidden states between layers in memory in float32 (exact), "
        "in bfloat16 (half the memory; rounds them) or on disk (float32 files read one batch "
        "at a time: exact); auto (default): memory up to 512 MiB of states, else disk",
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
        help="load a saved quantized checkpoint (torq's or compressed-tensors) with its MXFP4 "
        "W4A4 layers on torq's packed kernels (4.25 bits a weight in memory; the Triton "
        "kernels on a GPU, the same arithmetic on a CPU within 1e-5)",
    )
    run.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="keep a saved quantized checkpoint's decoder layers on disk in a scratch folder "
        "under DIR while it is evaluated, read back one layer at a time (accelerate's "
        "device_map offload): for a model larger than memory, slowly; also for the --tasks "
        "on each method's quantized checkpoint",
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
        "--balance-check",
        nargs="?",
        const="rtn",
        default=None,
        choices=BALANCE_PROBES,
        metavar="WEIGHTS",
        help="choose each group's balancing strength (the scales to the power 0, 1/2 or 1; "
        "0: none) by its W4A4 output error on the sampled tokens, the 32-block Hadamard as "
        "probe and WEIGHTS: rtn (the default) or gptq, GPTQ's on the group's Hessian "
        "(default: every group balanced in full)",
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
        "--unrotated",
        type=_linear_names,
        default=None,
        metavar="NAMES",
        help="comma-separated linear layers (e.g. q_proj) whose input groups get no rotation: "
        "TORQ's methods their balancing alone (with --fold-balance: no online transform), the "
        "block Hadamards none; vLLM runs no transform on a linear with a bias (default: every "
        "group rotated)",
    )
    t.add_argument(
        "--unrotated-balance",
        type=_strength,
        default=None,
        metavar="ALPHA",
        help="the balancing strength α of the --unrotated groups (default: --balance's)",
    )
    t.add_argument(
        "--residual-hadamard",
        action="store_true",
        help="q/k/v and gate/up rotated offline, by the 32-block Hadamard of the residual "
        "stream fused into the weights (the norms' weights folded into their readers), not "
        "online; TORQ's methods then balance them, folded into the norm; o_proj and down_proj "
        "keep their online transform (vLLM runs no transform on a linear with a bias)",
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
    t.add_argument(
        "--solver-device",
        choices=SOLVER_DEVICES,
        default="calibration",
        help="where TORQ's inter- and intra-block solvers run: the device the calibration "
        "runs on (default; a GPU with --device cuda) or the CPU",
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
    t.add_argument(
        "--calib-arithmetic",
        choices=ARITHMETICS,
        default="exact",
        help="the calibration's products: exact (float32 forwards, float64 statistics) or "
        "tf32 (TF32 on a CUDA GPU for the capture's forwards and statistics, each batch "
        "summed in float64; on a CPU, float32 statistics)",
    )
