"""The checks that refuse a run which cannot work, before any model is loaded: its
destinations, its options together, and each method's settings, formats and data."""

from __future__ import annotations

from pathlib import Path

from torq.calibration.data import corpus_path
from torq.data import eval_text_path
from torq.errors import TorqError
from torq.export.compressed_tensors import CT_HOLDS, CT_METHODS, FOLDED_METHODS, NVFP4_ACTIVATIONS
from torq.methods.registry import Method, MethodContext
from torq.methods.torq_rotation import TorqTransform
from torq.models.loading import context_length
from torq.paths import check_destination
from torq.runs.config import RunConfig
from torq.runs.kept import MODEL_INFO
from torq.runs.source import saved_model_dir
from torq.runs.store import method_resume_dir


def check_settings(config: RunConfig, methods: list[Method]) -> None:
    """Fail before any work when a setting cannot work with the model or the methods: a
    window longer than the model's context (unless ``allow_long_windows``), TORQ's
    intra-block settings against its block size."""

    qconfig = config.quant_config()
    calibrates = any(m.calibrates(qconfig) for m in methods)
    limit = None if config.allow_long_windows else context_length(config.model)
    if limit is not None:
        lengths = [("--seqlen", config.seqlen)]
        if calibrates:
            lengths.append(("--calib-seqlen", config.torq.calibration.seqlen))
        for option, n in lengths:
            if n > limit:
                raise TorqError(
                    f"{option} {n} is longer than the model's context ({limit} positions); "
                    "add --allow-long-windows if you mean it"
                )
    if any(isinstance(m.transform, TorqTransform) for m in methods):
        try:
            config.torq.intra.resolved(config.torq.block_size)
        except ValueError as exc:
            raise TorqError(f"TORQ's intra-block settings: {exc}") from None
    for m in methods:
        if isinstance(m.transform, TorqTransform):
            try:  # each method's own settings (torq-perm's permutation needs the balancing)
                ctx = MethodContext(options={"torq_settings": config.torq})
                m.transform.settings(config.quant_config(), ctx)
            except ValueError as exc:
                raise TorqError(f"{m.name}: {exc}") from None


def check_compressed_tensors(config: RunConfig, methods: list[Method]) -> None:
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
    for method in methods:
        if method.quantizes and method.name not in CT_METHODS:
            raise TorqError(
                f"--save-format compressed-tensors cannot hold '{method.name}' yet: {CT_HOLDS}"
            )
        if isinstance(method.transform, TorqTransform) and config.torq.block_size != 32:
            raise TorqError(
                f"--save-format compressed-tensors holds '{method.name}' with its 32-block "
                f"Hadamard only, not blocks of {config.torq.block_size}: drop --rotation-block"
            )
        if method.name in FOLDED_METHODS and not config.torq.fold:
            raise TorqError(
                f"--save-format compressed-tensors holds '{method.name}' with its balancing "
                "folded: add --fold-balance"
            )


def check_streamable(config: RunConfig, methods: list[Method]) -> None:
    """Fail before any work when a streamed run asks for what it cannot do yet."""
    if not methods:
        raise TorqError("--stream reads a float checkpoint; this model is already quantized")
    if config.skip_ppl:
        raise TorqError("--stream does not support --skip-ppl yet; drop one of them")
    if config.tasks:
        # zero-shot tasks need the whole model: the saved quantized checkpoint, loaded back
        if config.save_dir is None:
            raise TorqError(
                "--stream with zero-shot tasks needs --save-dir: the tasks run on each saved "
                "quantized checkpoint (add --packed to keep its weights packed in memory)"
            )
        for method in methods:
            if not method.quantizes:
                raise TorqError(
                    f"--stream with zero-shot tasks: '{method.name}' is the float model, which "
                    "would be loaded whole; run its tasks without --stream"
                )


def check_data(config: RunConfig, methods: list[Method]) -> None:
    """Fail before any work when data the run will read is missing: a method's calibration
    corpus (unless its quantized model is kept in the resume directory), the WikiText-2 test
    file in a configured data directory, the zero-shot tasks' files (or the hub)."""
    ctx = MethodContext(options={"torq_settings": config.torq, "gptq_config": config.gptq})
    for method in methods:
        calibration = method.calibration(ctx, config.quant_config())
        if calibration is None:
            continue
        if config.resume_dir is not None and config.keep_models:
            kept = Path(method_resume_dir(config, method.name)) / MODEL_INFO
            if kept.is_file():
                continue  # reloaded, not calibrated again
        try:
            corpus_path(calibration.corpus, config.data_dir)
        except TorqError as exc:
            raise TorqError(f"method '{method.name}' calibrates: {exc}") from None
    if not config.skip_ppl:
        eval_text_path(config.eval_corpus, config.data_dir)
    if config.tasks:
        from torq.eval.zeroshot import seeded_subset, task_data_files

        if config.task_subset is not None:  # also draws it: needs every task's local file
            subset = (config.task_subset, config.task_subset_seed)
            seeded_subset(config.tasks, *subset, config.data_dir)
        else:
            task_data_files(config.tasks, config.data_dir)


def check_run(config: RunConfig, methods: list[Method], from_saved: bool) -> None:
    """Every check of a run before its model is loaded: its destinations, its options
    together, and each method's settings, formats and data (``methods`` are not checked
    for a model that was ``from_saved`` quantized: it is evaluated as it is)."""
    checked = [] if from_saved else methods
    # what would fail only when the work is done (a file where a folder goes) fails now
    for option, folder in (
        ("--save-dir", config.save_dir),
        ("--resume-dir", config.resume_dir),
    ):
        if folder is not None:
            check_destination(folder, folder=True, what=option)
    if config.save_dir is not None and not from_saved:
        for method in methods:
            if method.quantizes:
                check_destination(
                    saved_model_dir(config, method.name), folder=True, what="--save-dir"
                )
    if config.stream:
        check_streamable(config, checked)
    check_settings(config, checked)
    if config.save_format != "torq":
        check_compressed_tensors(config, checked)
    if config.hidden_states != "memory" and not config.stream:
        raise TorqError("--hidden-states applies to a streamed run (--stream)")
    if config.packed and not from_saved and not (config.stream and config.tasks):
        raise TorqError(
            "--packed loads a saved quantized checkpoint (--model <save-dir>/<model>-<method>), "
            "or with --stream the checkpoints its --save-dir writes for --tasks"
        )
    if config.offload_dir is not None and not from_saved and not (config.stream and config.tasks):
        raise TorqError(
            "--offload-dir keeps a saved quantized checkpoint's layers on disk "
            "(--model <save-dir>/<model>-<method>, or with --stream the checkpoints its "
            "--save-dir writes for --tasks)"
        )
    if config.skip_ppl and not config.tasks:
        raise TorqError("nothing to evaluate: no perplexity and no zero-shot tasks")
    if config.task_subset is not None and config.task_limit is not None:
        raise TorqError("give either --limit (the first questions) or --subset, not both")
    if config.task_subset is not None and config.task_subset < 1:
        raise TorqError(f"--subset must be a positive number of questions: {config.task_subset}")
    # a saved quantized checkpoint is not calibrated again: its evaluation data is checked
    check_data(config, checked)
