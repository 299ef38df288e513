"""The ``torq`` command line's arguments: the parser of each command, its everyday options
in groups and the research knobs under ``--help-all``. A setting's option is declared on its
field (:mod:`torq.knobs`); this module adds the options that are the command's own (the
model's threads, where the record goes, the methods to compare)."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from torq.knobs import add_knobs, positive_int


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# the --help groups of the everyday options, in this order (a knob names its group)
GROUPS: tuple[str, ...] = ("model", "recipe", "data", "output")


def _add(parser: argparse.ArgumentParser, group: str | None, *flags: str, **kw: Any) -> None:
    """An option of the command itself (not a setting's knob), in ``group`` of ``--help``
    (``None``: under ``--help-all``)."""
    action = parser.add_argument(*flags, **kw)
    action.everyday_group = group  # type: ignore[attr-defined]


def _arrange_help(parser: argparse.ArgumentParser, show_all: bool) -> None:
    """Put a command's everyday options in the groups their knobs name (:data:`GROUPS`);
    the rest (the research knobs, long-run and memory options) are hidden from ``--help``
    and shown by ``--help-all`` in a group of their own."""
    for group in parser._action_groups:
        group._group_actions.clear()
    for title in GROUPS:
        shown = [a for a in parser._actions if getattr(a, "everyday_group", None) == title]
        if shown:
            parser.add_argument_group(title)._group_actions.extend(shown)
    special = ("help", "help_all")
    rest = [
        a
        for a in parser._actions
        if getattr(a, "everyday_group", None) is None and a.dest not in special
    ]
    if show_all:
        parser.add_argument_group("research and long runs")._group_actions.extend(rest)
    else:
        for action in rest:
            action.help = argparse.SUPPRESS
    options = next(g for g in parser._action_groups if g.title == "options")
    options._group_actions.extend(a for a in parser._actions if a.dest in special)


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
    _add_run_arguments(run, "run")
    ev = sub.add_parser(
        "eval",
        help="evaluate a model (float, or a folder torq wrote): perplexity, and with --tasks "
        "the paper's zero-shot tasks through lm-evaluation-harness",
    )
    _add_run_arguments(ev, "eval")

    ex = sub.add_parser(
        "export",
        help="write a quantized checkpoint torq saved (--save-dir) in another format",
    )
    _add(
        ex,
        "model",
        "--model",
        required=True,
        help="a folder torq saved (<save-dir>/<model>-<method>)",
    )
    _add(ex, "output", "--out", required=True, help="the folder to write")
    _add(
        ex,
        "output",
        "--to",
        choices=["compressed-tensors"],
        default="compressed-tensors",
        help="compressed-tensors: what transformers and vLLM load (rtn, gptq, had32, "
        "had32+gptq; torq-had32 and torq-had32+gptq quantized with --fold-balance)",
    )
    _add(ex, "output", "--overwrite", action="store_true", help="replace --out if it exists")
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
    gen.add_argument("--max-new-tokens", type=positive_int, default=64)
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
    gen.add_argument("--threads", type=positive_int, default=None, help="CPU threads")
    sub.add_parser("models", help="list the embedded default models")
    sub.add_parser("methods", help="list the recipes and the registered quantization methods")
    for command in (qz, run, ev, ex):
        _arrange_help(command, show_all)
    return parser


def _add_quantize_arguments(qz: argparse.ArgumentParser) -> None:
    """``torq quantize MODEL --out DIR``: one recipe, streamed, written to ``DIR``."""
    from torq.calibration.data import CaptureSettings
    from torq.methods.recipes import DEFAULT_RECIPE, RECIPES
    from torq.runs.config import Formats, ModelSource

    _add(
        qz,
        "model",
        "model",
        help="the float model: embedded name, Hugging Face folder or .gguf file",
    )
    _add(qz, "output", "--out", required=True, help="the folder to write")
    _add(
        qz,
        "recipe",
        "--recipe",
        choices=list(RECIPES),
        default=DEFAULT_RECIPE,
        help=f"what to quantize with (default: {DEFAULT_RECIPE}): "
        + "; ".join(f"{r.name}: {r.use_when}" for r in RECIPES.values()),
    )
    _add(
        qz,
        "model",
        "--format",
        choices=("mxfp4", "nvfp4", "mxint4"),
        default="mxfp4",
        help="weights and activations in 4 bits (default mxfp4)",
    )
    add_knobs(qz, "quantize", CaptureSettings, ModelSource, Formats)
    _add(
        qz,
        "output",
        "--save-format",
        choices=("compressed-tensors", "torq"),
        default=None,
        help="compressed-tensors when the recipe can be served (default), else torq's own",
    )
    _add(qz, "output", "--overwrite", action="store_true", help="replace --out if it holds files")
    _add(qz, "model", "--threads", type=positive_int, default=None, help="torch intra-op threads")
    _add(
        qz,
        "model",
        "--device",
        default="auto",
        help="where the layers calibrate, TORQ's rotation solvers included: cpu, cuda, "
        "cuda:N or auto (default: cuda when there)",
    )
    _add(qz, "output", "--no-progress", action="store_true", help="no progress bars")
    _add(
        qz,
        None,
        "--rotate-biased",
        action="store_true",
        help="rotate the inputs of linears with a bias too (Qwen2's q/k/v), which the default "
        "and fast recipes leave unrotated: a lower perplexity; transformers and torq load the "
        "folder, vLLM with torq's plugin (pip install integrations/vllm)",
    )
    qz.add_argument(
        "--help-all", action="store_true", help="show every option (research knobs included)"
    )


def _add_run_arguments(run: argparse.ArgumentParser, command: str) -> None:
    """The options of ``torq run`` and ``torq eval``: the run's settings and every method's
    (:mod:`torq.knobs`), and the command's own."""
    from torq.methods.hadamard import HadamardSettings
    from torq.methods.settings import TorqSettings
    from torq.runs.config import RunConfig, format_name
    from torq.surgery.gptq import GPTQConfig

    run.add_argument(
        "--help-all", action="store_true", help="show every option (research knobs included)"
    )
    add_knobs(run, command, RunConfig, TorqSettings, HadamardSettings, GPTQConfig)
    _add(
        run,
        "recipe",
        "--methods",
        default=None,
        help="comma-separated methods (see 'torq methods'); default: for a folder torq wrote, "
        "the method it holds; for a float model, torq eval: fp, torq run: fp and the default "
        "recipe (torq-had32+gptaq, balancing folded, nearest scales)",
    )
    _add(
        run,
        "model",
        "--format",
        type=format_name,
        default=argparse.SUPPRESS,
        help="weights and activations format (default mxfp4; a saved quantized model keeps "
        "its own)",
    )
    _add(run, "model", "--threads", type=positive_int, default=None, help="torch intra-op threads")
    _add(
        run,
        "output",
        "--out",
        default=None,
        help="result JSON path (default: results/run-<model>-<time>.json)",
    )
    _add(run, "output", "--no-progress", action="store_true", help="no progress bars")
    _add(
        run,
        None,
        "--paper",
        action="store_true",
        help="TORQ exactly as the paper: no balancing, Algorithm 2 from I with K/2 candidates "
        "(the other TORQ options given apply on top)",
    )
