"""The settings of a comparison run (:class:`RunConfig`, recorded verbatim with its
results) and the checks that refuse a run which cannot work, before any model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torq.calibration.data import corpus_path
from torq.errors import TorqError
from torq.eval.data import DEFAULT_EVAL_CORPUS, eval_text_path
from torq.eval.resume import MODEL_INFO
from torq.methods.registry import Method, MethodContext
from torq.methods.torq_rotation import TorqSettings
from torq.models.loading import context_length
from torq.paths import check_destination
from torq.runs.store import method_resume_dir
from torq.surgery.gptq import GPTQConfig
from torq.surgery.qlinear import QuantConfig


@dataclass
class RunConfig:
    """Everything that determines a comparison run; recorded verbatim with its results."""

    model: str = "smollm2-135m"
    methods: list[str] = field(default_factory=lambda: ["fp", "rtn"])
    weight_format: str | None = "mxfp4"
    act_format: str | None = "mxfp4"
    scale_mode: str = "ocp"
    # NVFP4 activations' tensor scale: each tensor's own ("dynamic") or calibrated once per
    # activation quantizer on the calibration windows ("static": what compressed-tensors
    # and vLLM serve, :class:`torq.surgery.qlinear.QuantConfig`)
    act_scale: str = "dynamic"
    seqlen: int = 2048
    max_windows: int | None = None
    batch_size: int = 1
    data_dir: str | None = None
    seed: int = 0
    torq: TorqSettings = field(default_factory=TorqSettings)
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    # zero-shot tasks through lm-eval (``torq eval``); empty: perplexity only
    tasks: list[str] = field(default_factory=list)
    task_limit: int | None = None
    # a seeded subset of each task's questions instead (:func:`torq.eval.zeroshot.seeded_subset`)
    task_subset: int | None = None
    task_subset_seed: int = 0
    task_batch_size: int = 8
    # choices of a question share one forward pass of their context (same scores, faster)
    shared_context: bool = True
    skip_ppl: bool = False
    # where each method's evaluation is kept as it goes (perplexity windows, zero-shot
    # answers), a sub-directory per method and setting (:func:`method_resume_dir`): the same
    # run again after a stop measures only what is missing
    resume_dir: str | None = None
    # with a resume directory, also keep each quantized model there, so that a restart
    # reloads it instead of calibrating again (:func:`torq.eval.resume.keep_model`)
    keep_models: bool = True
    # where the model runs: "cpu", "cuda", "cuda:1", or "auto" (cuda when available); the
    # rotation solvers always run on the CPU, where the calibration statistics are kept
    device: str = "cpu"
    # write each quantized model as a checkpoint folder <save_dir>/<model>-<method>
    # (packed 4-bit weights and the online transforms, :mod:`torq.export`)
    save_dir: str | None = None
    # read the float checkpoint one decoder layer at a time and quantize and evaluate layer
    # by layer (:mod:`torq.driver`): memory bounded by one layer, not the model
    stream: bool = False
    # windows longer than the model's context (max_position_embeddings) are refused unless
    allow_long_windows: bool = False
    # what --save-dir writes: torq's own checkpoint ("torq"), or "compressed-tensors"
    # (transformers, vLLM; rtn, gptq, had32, had32+gptq)
    save_format: str = "torq"
    # evaluate a saved quantized checkpoint with its MXFP4 W4A4 weights kept packed
    # (:class:`torq.kernels.linear.PackedMXFP4Linear`: 4.25 bits a weight in memory, not 32);
    # with --stream and --tasks, how each saved checkpoint is loaded for the tasks
    packed: bool = False
    # what a GGUF model is de-quantized to, once, in the cache: "float32" (transformers'
    # values; every number in docs/RESULTS.md) or "bfloat16" (half the disk, rounded)
    gguf_dtype: str = "float32"
    # keep a saved quantized checkpoint's decoder layers on disk under this folder while it
    # is evaluated (accelerate's device_map offload, :func:`torq.export.load_quantized`):
    # for a model larger than memory; a scratch folder inside it is removed after the run
    offload_dir: str | None = None
    # with --stream: how the windows' hidden states are kept between layers, "memory"
    # (float32, exact), "bfloat16" (half, rounded) or "disk" (float32 files, exact)
    hidden_states: str = "memory"
    # the text perplexity is measured on: "wikitext2-test" (the paper's), "wikipedia-en"
    # (held-out text of ../shared/data) or a text file; its first max_windows windows
    eval_corpus: str = DEFAULT_EVAL_CORPUS

    def quant_config(self) -> QuantConfig:
        return QuantConfig.from_names(
            self.weight_format, self.act_format, self.scale_mode, self.act_scale
        )


def method_context(config: RunConfig, tokenizer: Any, progress: bool) -> MethodContext:
    """What every method of the run reads beyond the model."""
    return MethodContext(
        tokenizer=tokenizer,
        options={
            "torq_settings": config.torq,
            "gptq_config": config.gptq,
            "data_dir": config.data_dir,
            "progress": progress,
            "seed": config.seed,
        },
    )


def check_settings(config: RunConfig, methods: list[Method]) -> None:
    """Fail before any work when a setting cannot work with the model or the methods: a
    window longer than the model's context (unless ``allow_long_windows``), TORQ's
    intra-block settings against its block size."""
    from torq.methods.torq_rotation import TorqTransform

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
    from torq.export.compressed_tensors import (
        CT_HOLDS,
        CT_METHODS,
        FOLDED_METHODS,
        NVFP4_ACTIVATIONS,
    )
    from torq.methods.torq_rotation import TorqTransform

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
    from torq.runs.source import saved_model_dir  # (source reads this module's RunConfig)

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


def resolve_device(name: str) -> torch.device:
    """``"auto"`` → the first CUDA device when one is visible, else the CPU; any other name
    is checked: asking for CUDA on a machine without it is an error, not a silent CPU run."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise TorqError(f"unknown device '{name}' (use cpu, cuda, cuda:N or auto)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TorqError(f"device '{name}' asked for, but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise TorqError(f"device '{name}' is not supported (use cpu, cuda, cuda:N or auto)")
    return device
