"""The checks that refuse a run which cannot work, before any model is loaded: its
destinations, its options together, and each method's settings, formats and data."""

from __future__ import annotations

from torq.calibration.data import corpus_path
from torq.calibration.hidden import HIDDEN_MODES
from torq.data import eval_text_path
from torq.errors import TorqError
from torq.export.compressed_tensors import CT_HOLDS, NVFP4_ACTIVATIONS
from torq.methods.registry import MethodSpec
from torq.models.loading import context_length
from torq.paths import check_destination
from torq.runs.config import RunConfig
from torq.runs.source import saved_model_dir


def check_settings(config: RunConfig, specs: list[MethodSpec]) -> None:
    """Fail before any work when a setting cannot work with the model or the methods: a
    window longer than the model's context (unless ``allow_long_windows``), TORQ's
    intra-block settings against its block size."""

    qconfig = config.quant_config()
    calibrates = any(s.method.calibrates(qconfig) for s in specs)
    limit = None if config.allow_long_windows else context_length(config.model)
    if limit is not None:
        lengths = [("--seqlen", config.seqlen)]
        if calibrates:
            lengths.append(("--calib-seqlen", config.capture.calibration.seqlen))
        for option, n in lengths:
            if n > limit:
                raise TorqError(
                    f"{option} {n} is longer than the model's context ({limit} positions); "
                    "add --allow-long-windows if you mean it"
                )
    for spec in specs:  # each method's own settings, before the model is read
        try:
            spec.method.transform.check(qconfig, spec.context(config.capture))
        except TorqError as exc:
            raise TorqError(f"{spec.name}: {exc}") from None


def check_compressed_tensors(config: RunConfig, specs: list[MethodSpec]) -> None:
    """Fail before any work when ``--save-format compressed-tensors`` cannot hold a method
    (what the model's layers hold, a bias under a transform, is checked as each is saved)."""

    if config.save_format != "compressed-tensors":
        raise TorqError(f"unknown --save-format '{config.save_format}'")
    if config.save_dir is None:
        raise TorqError("--save-format applies to what --save-dir writes: add --save-dir")
    if config.tasks:
        raise TorqError(
            "--save-format compressed-tensors with --tasks is not supported yet (the tasks "
            "read torq's own checkpoint): save with the default format, then torq export"
        )
    act = (config.act_format or "fp").lower()
    act = None if act in ("fp", "none", "float") else act
    if config.weight_format == "nvfp4" and act is not None:
        if act != "nvfp4":
            raise TorqError(f"--save-format compressed-tensors: {CT_HOLDS}")
        if config.act_scale != "static":
            raise TorqError(f"--save-format compressed-tensors: {NVFP4_ACTIVATIONS}")
    elif config.weight_format not in ("mxfp4", "nvfp4") or act not in (None, "mxfp4"):
        raise TorqError(f"--save-format compressed-tensors: {CT_HOLDS}")
    qconfig = config.quant_config()
    for spec in specs:
        method, ctx = spec.method, spec.context(config.capture)
        reason = method.transform.compressed_tensors(qconfig, ctx) if method.quantizes else None
        if reason is not None:
            raise TorqError(
                f"--save-format compressed-tensors cannot hold '{method.name}': {reason}"
            )


def check_data(config: RunConfig, specs: list[MethodSpec]) -> None:
    """Fail before any work when data the run will read is missing: a method's calibration
    corpus (unless its quantized model is kept in the resume directory), the WikiText-2 test
    file in a configured data directory, the zero-shot tasks' files (or the hub)."""
    for spec in specs:
        calibration = spec.method.calibration(spec.context(config.capture), config.quant_config())
        if calibration is None:
            continue
        try:
            corpus_path(calibration.corpus, config.data_dir)
        except TorqError as exc:
            raise TorqError(f"method '{spec.name}' calibrates: {exc}") from None
    if not config.skip_ppl:
        eval_text_path(config.eval_corpus, config.data_dir)
    if config.tasks:
        from torq.eval.zeroshot import seeded_subset, task_data_files

        if config.task_subset is not None:  # also draws it: needs every task's local file
            subset = (config.task_subset, config.task_subset_seed)
            seeded_subset(config.tasks, *subset, config.data_dir)
        else:
            task_data_files(config.tasks, config.data_dir)


def check_run(config: RunConfig, from_saved: bool) -> None:
    """Every check of a run before its model is loaded: its destinations, its options
    together, and each method's settings, formats and data (its methods are not checked
    for a model that was ``from_saved`` quantized: it is evaluated as it is)."""
    checked = [] if from_saved else config.specs()
    # what would fail only when the work is done (a file where a folder goes) fails now
    for option, folder in (
        ("--save-dir", config.save_dir),
        ("--resume-dir", config.resume_dir),
    ):
        if folder is not None:
            check_destination(folder, folder=True, what=option)
    if config.save_dir is not None and not from_saved:
        for spec in checked:
            if spec.method.quantizes:
                check_destination(
                    saved_model_dir(config, spec.name), folder=True, what="--save-dir"
                )
    check_settings(config, checked)
    if config.save_format != "torq":
        check_compressed_tensors(config, checked)
    if config.hidden_states not in (*HIDDEN_MODES, "auto"):
        raise TorqError(
            f"--hidden-states {config.hidden_states}: use auto, {', '.join(HIDDEN_MODES)}"
        )
    if config.packed and not from_saved and not config.tasks:
        raise TorqError(
            "--packed loads a saved quantized checkpoint (--model <save-dir>/<model>-<method>), "
            "or with --tasks each method's quantized checkpoint for its tasks"
        )
    if config.offload_dir is not None and not from_saved and not config.tasks:
        raise TorqError(
            "--offload-dir keeps a saved quantized checkpoint's layers on disk "
            "(--model <save-dir>/<model>-<method>, or with --tasks each method's quantized "
            "checkpoint while its tasks run)"
        )
    if config.skip_ppl and not config.tasks and config.save_dir is None:
        raise TorqError("nothing to do: no perplexity, no zero-shot tasks, nothing saved")
    if config.window_sample is not None and config.max_windows is not None:
        raise TorqError(
            "give either --max-windows (the first windows) or --window-sample, not both"
        )
    if config.window_sample is not None and config.window_sample < 2:
        raise TorqError(f"--window-sample needs at least 2 windows: {config.window_sample}")
    if config.task_subset is not None and config.task_limit is not None:
        raise TorqError("give either --limit (the first questions) or --subset, not both")
    if config.task_subset is not None and config.task_subset < 1:
        raise TorqError(f"--subset must be a positive number of questions: {config.task_subset}")
    # a saved quantized checkpoint is not calibrated again: its evaluation data is checked
    check_data(config, checked)
