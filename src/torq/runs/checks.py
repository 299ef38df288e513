"""The checks that refuse a run which cannot work, before any model is loaded: its
destinations, its options together, and each method's settings, formats and data."""

from __future__ import annotations

from torq.calibration.data import CaptureSettings
from torq.calibration.hidden import HIDDEN_MODES
from torq.calibration.sources import check_source, parse_sources, window_counts
from torq.data import eval_text_path
from torq.errors import TorqError
from torq.export.compressed_tensors import (
    CT_HOLDS,
    FOUR_OVER_SIX_ACTIVATIONS,
    NVFP4_ACTIVATIONS,
)
from torq.methods.registry import MethodSpec
from torq.models.loading import context_length
from torq.paths import check_destination
from torq.runs.config import EvalPlan, Formats, ModelSource, Outputs, TaskPlan
from torq.runs.source import saved_model_dir
from torq.surgery.qlinear import QuantConfig


def check_settings(
    model: str,
    evaluation: EvalPlan,
    capture: CaptureSettings,
    qconfig: QuantConfig,
    specs: list[MethodSpec],
) -> None:
    """Fail before any work when a setting cannot work with the model or the methods: a
    window longer than the model's context (unless ``allow_long_windows``), TORQ's
    intra-block settings against its block size."""
    calibrates = any(s.method.calibrates(qconfig) for s in specs)
    limit = None if evaluation.allow_long_windows else context_length(model)
    if limit is not None:
        lengths = [("--seqlen", evaluation.seqlen)]
        if calibrates:
            lengths.append(("--calib-seqlen", capture.calibration.seqlen))
        for option, n in lengths:
            if n > limit:
                raise TorqError(
                    f"{option} {n} is longer than the model's context ({limit} positions); "
                    "add --allow-long-windows if you mean it"
                )
    for spec in specs:  # each method's own settings, before the model is read
        try:
            spec.method.transform.check(qconfig, spec.context(capture))
        except TorqError as exc:
            raise TorqError(f"{spec.name}: {exc}") from None


def check_compressed_tensors(
    outputs: Outputs,
    formats: Formats,
    zeroshot: TaskPlan,
    capture: CaptureSettings,
    specs: list[MethodSpec],
) -> None:
    """Fail before any work when ``--save-format compressed-tensors`` cannot hold a method
    (what the model's layers hold, a bias under a transform, is checked as each is saved)."""
    if outputs.save_format == "torq":
        return
    if outputs.save_format != "compressed-tensors":
        raise TorqError(f"unknown --save-format '{outputs.save_format}'")
    if outputs.save_dir is None:
        raise TorqError("--save-format applies to what --save-dir writes: add --save-dir")
    if zeroshot.tasks:
        raise TorqError(
            "--save-format compressed-tensors with --tasks is not supported yet (the tasks "
            "read torq's own checkpoint): save with the default format, then torq export"
        )
    act = (formats.act_format or "fp").lower()
    act = None if act in ("fp", "none", "float") else act
    if formats.weight_format == "nvfp4" and act is not None:
        if act != "nvfp4":
            raise TorqError(f"--save-format compressed-tensors: {CT_HOLDS}")
        if formats.act_scale != "static":
            raise TorqError(f"--save-format compressed-tensors: {NVFP4_ACTIVATIONS}")
        if formats.scale_mode == "4over6":
            raise TorqError(f"--save-format compressed-tensors: {FOUR_OVER_SIX_ACTIVATIONS}")
    elif formats.weight_format not in ("mxfp4", "nvfp4") or act not in (None, "mxfp4"):
        raise TorqError(f"--save-format compressed-tensors: {CT_HOLDS}")
    qconfig = formats.quant_config()
    for spec in specs:
        method, ctx = spec.method, spec.context(capture)
        reason = method.transform.compressed_tensors(qconfig, ctx) if method.quantizes else None
        if reason is not None:
            raise TorqError(
                f"--save-format compressed-tensors cannot hold '{method.name}': {reason}"
            )


def check_data(
    data_dir: str | None,
    evaluation: EvalPlan,
    zeroshot: TaskPlan,
    capture: CaptureSettings,
    qconfig: QuantConfig,
    specs: list[MethodSpec],
) -> None:
    """Fail before any work when data the run will read is missing or unreadable: a
    method's calibration data (unless its quantized model is kept in the resume directory),
    the WikiText-2 test file in a configured data directory, the zero-shot tasks' files (or
    the hub)."""
    for spec in specs:
        calibration = spec.method.calibration(spec.context(capture), qconfig)
        if calibration is None:
            continue
        try:
            sources = parse_sources(calibration.corpus)
            window_counts(sources, calibration.n_samples)
            for source in sources:
                check_source(source, data_dir)
        except TorqError as exc:
            raise TorqError(f"method '{spec.name}' calibrates: {exc}") from None
    if not evaluation.skip_ppl:
        eval_text_path(evaluation.eval_corpus, data_dir)
    if zeroshot.tasks:
        from torq.eval.zeroshot import seeded_subset, task_data_files

        if zeroshot.task_subset is not None:  # also draws it: needs every task's local file
            subset = (zeroshot.task_subset, zeroshot.task_subset_seed)
            seeded_subset(list(zeroshot.tasks), *subset, data_dir)
        else:
            task_data_files(list(zeroshot.tasks), data_dir)


def check_destinations(outputs: Outputs, model: str, specs: list[MethodSpec]) -> None:
    """What would fail only when the work is done (a file where a folder goes) fails now."""
    for option, folder in (("--save-dir", outputs.save_dir), ("--resume-dir", outputs.resume_dir)):
        if folder is not None:
            check_destination(folder, folder=True, what=option)
    if outputs.save_dir is not None:
        for spec in specs:
            if spec.method.quantizes:
                where = saved_model_dir(outputs, model, spec.name)
                check_destination(where, folder=True, what="--save-dir")


def check_options(
    source: ModelSource,
    evaluation: EvalPlan,
    zeroshot: TaskPlan,
    outputs: Outputs,
    from_saved: bool,
) -> None:
    """The options together: what one asks of another (a model ``from_saved`` quantized is
    evaluated as it is)."""
    if evaluation.hidden_states not in (*HIDDEN_MODES, "auto"):
        raise TorqError(
            f"--hidden-states {evaluation.hidden_states}: use auto, {', '.join(HIDDEN_MODES)}"
        )
    if evaluation.packed and not from_saved and not zeroshot.tasks:
        raise TorqError(
            "--packed loads a saved quantized checkpoint (--model <save-dir>/<model>-<method>), "
            "or with --tasks each method's quantized checkpoint for its tasks"
        )
    if source.offload_dir is not None and not from_saved and not zeroshot.tasks:
        raise TorqError(
            "--offload-dir keeps a saved quantized checkpoint's layers on disk "
            "(--model <save-dir>/<model>-<method>, or with --tasks each method's quantized "
            "checkpoint while its tasks run)"
        )
    if evaluation.skip_ppl and not zeroshot.tasks and outputs.save_dir is None:
        raise TorqError("nothing to do: no perplexity, no zero-shot tasks, nothing saved")
    if evaluation.window_sample is not None and evaluation.max_windows is not None:
        raise TorqError(
            "give either --max-windows (the first windows) or --window-sample, not both"
        )
