"""The ``torq`` command line: it parses (:mod:`torq.cli.arguments`) and calls the Python API
(:mod:`torq.api`) or the comparison run (:mod:`torq.pipeline`).

torq quantize smollm2-135m --out smollm2-mxfp4
torq eval --model smollm2-mxfp4 --max-windows 16
torq generate --model smollm2-mxfp4 --packed
torq run --model smollm2-135m --methods fp,rtn,had32 --max-windows 16
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from torq.cli.arguments import build_parser
from torq.errors import TorqError
from torq.logs import quiet_libraries

if TYPE_CHECKING:
    from torq.calibration.data import CaptureSettings
    from torq.methods.settings import TorqSettings

__all__ = ["build_parser", "capture_from_args", "main", "torq_settings_from_args"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(text).name or text).strip("_") or "model"


def torq_settings_from_args(args: argparse.Namespace) -> TorqSettings:
    """TORQ's settings (Algorithms 1–3 and torq's additions) as ``torq run``'s options give
    them over :class:`~torq.methods.settings.TorqSettings`' defaults, or over the paper's
    with ``--paper``."""
    from torq.knobs import from_args
    from torq.methods.settings import TorqSettings

    return from_args(TorqSettings().paper() if args.paper else TorqSettings(), args)


def capture_from_args(args: argparse.Namespace) -> CaptureSettings:
    """The calibration every calibrating method of the run reads, as the options give it."""
    from torq.calibration.data import CaptureSettings
    from torq.knobs import from_args

    return from_args(CaptureSettings(), args)


def _cmd_run(args: argparse.Namespace) -> int:
    import torch

    from torq.api import compare
    from torq.knobs import from_args, given
    from torq.methods.hadamard import HadamardSettings
    from torq.runs.config import PARTS, RunConfig
    from torq.surgery.gptq import GPTQConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    # the run's settings that were given (a saved quantized model keeps its own formats)
    defaults = RunConfig()
    options: dict = given(defaults, args)
    for part in PARTS:
        options.update(given(getattr(defaults, part), args))
    model = options.pop("model", defaults.source.model)
    if hasattr(args, "format"):  # both formats, where --w-format / --a-format do not say
        options.setdefault("weight_format", args.format)
        options.setdefault("act_format", args.format)
    if "tasks" in options:
        from torq.eval.zeroshot import parse_tasks

        options["tasks"] = parse_tasks(args.tasks)
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",")]
    if methods is None and args.command == "eval":
        from torq.runs.source import saved_manifest

        if saved_manifest(model) is None:
            methods = ["fp"]  # a float model: evaluated as it is
    out = Path(
        args.out or f"results/run-{_slug(model)}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    )
    settings = (
        torq_settings_from_args(args),
        from_args(GPTQConfig(), args),
        from_args(HadamardSettings(), args),
    )
    with _library_bars(not args.no_progress):
        result = compare(
            model,
            [m for m in methods if m] if methods is not None else None,
            settings,
            capture=capture_from_args(args),
            out=out,
            progress=not args.no_progress,
            **options,
        )
    print(result["table"])
    if args.command == "eval":
        _record_in_model_card(model, result)
    if result["config"]["tasks"] and not result["config"]["skip_ppl"]:
        from torq.eval.figure import accuracy_perplexity_figure

        print(f"figure {accuracy_perplexity_figure(result, out.with_suffix('.png'))}")
    print(f"\nsaved {out} ({result['wall_seconds']:.0f} s)")
    return 0


def _record_in_model_card(folder: str, result: dict) -> None:
    """Each perplexity ``torq eval`` measured on a folder ``torq quantize`` wrote, added
    to that folder's model card."""
    from torq.export.model_card import add_measurement

    for row in result["rows"]:
        if row["ppl"] is not None:
            measured = {
                "date": result["date"][:10],
                "data": result["eval"]["dataset"],
                "windows": result["eval"]["n_windows"],
                "ppl": row["ppl"],
                "command": result["command"],
                "machine": result["machine"]["cpu"],
            }
            if add_measurement(folder, measured):
                print(f"added to {folder}/README.md, the folder's model card")


def _cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from torq.api import quantize_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    capture = capture_from_args(args)
    calib = capture.calibration
    with _library_bars(not args.no_progress):
        done = quantize_checkpoint(
            args.model,
            args.out,
            args.recipe,
            format=args.format,
            save_format=args.save_format,
            calibration=calib.corpus,
            calib_samples=calib.n_samples,
            calib_seqlen=calib.seqlen,
            data_dir=getattr(args, "data_dir", None),
            seed=calib.seed,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            device=args.device,
            calib_arithmetic=capture.arithmetic,
            rotate_biased=args.rotate_biased,
            ignore=getattr(args, "ignore", ()),
            avg_bits=getattr(args, "avg_bits", None),
            budget_by=getattr(args, "budget_by", "block"),
            budget_windows=getattr(args, "budget_windows", 16),
        )
    print(
        f"torq: wrote {done['path']} ({done['format']}, {done['bytes'] / 1e6:.0f} MB; recipe "
        f"{done['recipe']} = {done['method']}, {args.format.upper()} W4A4) in "
        f"{done['seconds']:.0f} s"
    )
    budget = done["record"]["rows"][0]["details"].get("precision_budget")
    if budget is not None:
        kept = [g for g in budget["groups"] if g["high"]]
        print(
            f"{len(kept)} of {len(budget['groups'])} input groups in MXFP8 W8A8: "
            f"{budget['reached_bits']:.2f} bits a weight on average (asked {budget['avg_bits']:g})"
        )
    resumed = done["record"]["rows"][0]["details"].get("resumed_at_layer")
    if resumed is not None:
        print(f"went on from layer {resumed}, where the same command had stopped")
    if done.get("why_format"):
        print(f"torq's format: {done['why_format']}")
    unrotated = done.get("unrotated") or ()
    biased = [n for n in unrotated if n != "experts"]
    if biased:
        print(
            f"{', '.join(biased)} have a bias: their inputs are not rotated, so "
            "that vLLM serves the folder (it runs no transform on a linear with a bias); "
            "--rotate-biased rotates them, for a lower perplexity, served by transformers, "
            "torq, and vLLM with torq's plugin (pip install integrations/vllm, from torq's "
            "repository)"
        )
    if "experts" in unrotated:
        print(
            "the MoE experts' inputs are balanced (folded) but not rotated: transformers and "
            "vLLM run no online transform inside the experts; transformers also runs their "
            "activations in bf16"
        )
    if done["format"] == "compressed-tensors":
        print(
            f"load it: python -c \"import torq; print(torq.load('{done['path']}'))\"  "
            "(transformers: docs/serving.md)"
        )
    print(f"measure it: torq eval --model {done['path']} --max-windows 16")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from torq.api import accelerate, generate, load
    from torq.runs.config import resolve_device
    from torq.runs.source import saved_manifest

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.packed and saved_manifest(args.model) is None:  # before the model is loaded
        raise TorqError(f"--packed: {args.model} is not a quantized checkpoint (a float model)")
    if args.cuda_graph and device.type != "cuda":
        raise TorqError(f"--cuda-graph needs a CUDA device; this run is on {device}")
    model = load(args.model).to(device)
    note = ""
    if args.packed:
        report = accelerate(model)
        if not report.swapped:
            raise TorqError(f"--packed: {args.model} has no layer torq's kernels run")
        note = f"; {report.summary()}"
    done = generate(
        model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        cuda_graph=args.cuda_graph,
        compiled=args.compile,
    )
    print(args.prompt + done["text"])
    decode = done["decode_tokens_per_s"]
    speed = "" if decode is None else f", then {decode:.1f} tokens/s"
    print(
        f"torq: {done['new_tokens']} tokens in {done['seconds']:.2f} s (the prompt and first "
        f"token {done['prefill_seconds']:.2f} s{speed}) on {device}{note}"
        + ("; the step through torch.compile" if args.compile else "")
        + ("; the step as a CUDA graph" if args.cuda_graph else ""),
        file=sys.stderr,
    )
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
    argv = list(sys.argv[1:] if argv is None else argv)
    show_all = "--help-all" in argv
    if show_all:  # every option in the help, research knobs included
        argv = ["--help" if a == "--help-all" else a for a in argv]
    parser = build_parser(show_all)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="torq: %(message)s")
    quiet_libraries()  # torq's output and the libraries' errors only
    try:
        if args.command == "quantize":
            return _cmd_quantize(args)
        if args.command in ("run", "eval"):
            return _cmd_run(args)
        if args.command == "generate":
            return _cmd_generate(args)
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
            from torq.methods import METHODS, get_method
            from torq.methods.recipes import DEFAULT_RECIPE, RECIPES

            print("recipes (torq quantize --recipe):")
            for r in RECIPES.values():
                mark = " (default)" if r.name == DEFAULT_RECIPE else ""
                serves = "torq only" if r.cannot_serve() else "servable"
                # the method and scale rule it runs in each format where they are others
                method = ", ".join([r.method, *(f"{f}: {r.described_in(f)}" for f in r.formats())])
                print(f"  {r.name}{mark}\t{method}\t{serves}\t{r.use_when}")
            print("methods (torq run --methods; without it, fp and the default recipe):")
            for name, method in sorted(METHODS.items()):
                notes = []
                if method.supports_gptq:
                    notes.append(f"with GPTQ weights: {get_method(name + '+gptq').name}")
                    notes.append(f"GPTAQ: {get_method(name + '+gptaq').name}")
                    notes.append(f"Qronos: {get_method(name + '+qronos').name}")
                print(f"{name}\t{method.description}" + "".join(f"\t({n})" for n in notes))
            return 0
    except (TorqError, ValueError, FileNotFoundError, NotImplementedError) as exc:
        print(f"torq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torq: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
