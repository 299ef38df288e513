"""The end-to-end job behind ``torq run``: load → quantize with each method → evaluate.

The data flow is one way: the float model is loaded once, each method gets its own copy,
quantizes it, and the copy is evaluated on the same perplexity windows as every other
method, so the rows of the table are directly comparable.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from torq.calibration.data import corpus_path
from torq.errors import TorqError
from torq.eval.data import DEFAULT_EVAL_CORPUS, eval_text_path, load_eval_text
from torq.eval.perplexity import perplexity, windows_from_text
from torq.eval.portable import export_portable, seed_resume_dir
from torq.eval.resume import MODEL_INFO, fingerprint_ids, keep_model, load_kept_model
from torq.methods.registry import Method, MethodContext, get_method
from torq.methods.torq_rotation import TorqSettings
from torq.models.loading import LoadedModel, context_length, load
from torq.paths import check_destination
from torq.results import command_line, machine_info, now_iso, versions
from torq.seeding import method_rng
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
    # with a resume directory: a portable copy of each method's kept evaluation (answers,
    # perplexity windows, sessions) in this directory, one small .npz per method, read to
    # seed a new resume directory (another machine) and rewritten as the evaluation goes
    # (:mod:`torq.eval.portable`)
    portable_dir: str | None = None
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


@dataclass
class MethodRow:
    method: str
    weights: str
    activations: str
    ppl: float | None
    quantize_seconds: float
    eval_seconds: float
    eval_tokens_per_s: float
    details: dict[str, Any] = field(default_factory=dict)
    zeroshot: dict[str, Any] | None = None  # headline scores (acc_norm / acc) and average


def run(
    config: RunConfig,
    loaded: LoadedModel | None = None,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every method of ``config`` on the same model and windows; return the result record.

    ``on_row`` receives the record as it stands after each method (``"complete": False``
    until the last), so a long comparison can be saved as it goes.
    """
    with offload_scratch(config.offload_dir) as scratch:
        return _run(config, loaded, progress, on_row, scratch)


@contextlib.contextmanager
def offload_scratch(folder: str | None) -> Iterator[Path | None]:
    """A new folder inside ``folder`` for the offloaded layers of the run (None without
    ``folder``), removed with everything in it when the run ends, however it ends."""
    if folder is None:
        yield None
        return
    check_destination(folder, folder=True, what="--offload-dir")
    created = not Path(folder).exists()
    Path(folder).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="torq-offload-", dir=folder))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):  # only if nothing else was put there
                Path(folder).rmdir()


def _run(
    config: RunConfig,
    loaded: LoadedModel | None,
    progress: bool,
    on_row: Callable[[dict[str, Any]], None] | None,
    scratch: Path | None,
) -> dict[str, Any]:
    if not config.methods:
        raise TorqError("no methods given")
    saved = loaded.quantized if loaded is not None else saved_manifest(config.model)
    if saved is None:
        methods = [get_method(m) for m in config.methods]
        seen: dict[str, str] = {}
        for given, method in zip(config.methods, methods, strict=True):
            if method.name in seen:
                first = seen[method.name]
                twice = f"'{given}' is given twice"
                if first.strip().lower() != given.strip().lower():
                    twice = f"'{first}' and '{given}' are the same method"
                raise TorqError(f"methods: {twice}")
            seen[method.name] = given
    else:
        config = _saved_config(config, saved)
        methods = [_SavedMethod(saved)]
    # what would fail only when the work is done (a file where a folder goes) fails now
    for option, folder in (
        ("--save-dir", config.save_dir),
        ("--resume-dir", config.resume_dir),
        ("--portable-dir", config.portable_dir),
    ):
        if folder is not None:
            check_destination(folder, folder=True, what=option)
    if config.save_dir is not None and saved is None:
        for method in methods:
            if method.quantizes:
                check_destination(
                    saved_model_dir(config, method.name), folder=True, what="--save-dir"
                )
    if config.stream:
        check_streamable(config, methods if saved is None else [])
    check_settings(config, methods if saved is None else [])
    if config.save_format != "torq":
        check_exportable(config, methods if saved is None else [])
    if config.hidden_states != "memory" and not config.stream:
        raise TorqError("--hidden-states applies to a streamed run (--stream)")
    if config.packed and saved is None and not (config.stream and config.tasks):
        raise TorqError(
            "--packed loads a saved quantized checkpoint (--model <save-dir>/<model>-<method>), "
            "or with --stream the checkpoints its --save-dir writes for --tasks"
        )
    if config.offload_dir is not None and saved is None and not (config.stream and config.tasks):
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
    if config.portable_dir is not None and config.resume_dir is None:
        raise TorqError("a portable copy (--portable-dir) needs a resume directory (--resume-dir)")
    # a saved quantized checkpoint is not calibrated again: its evaluation data is checked
    check_data(config, methods if saved is None else [])
    qconfig = config.quant_config()
    t_start = time.perf_counter()
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    if config.stream:
        if saved is not None or loaded is not None:
            raise TorqError("--stream reads a float checkpoint; a loaded or saved model is not one")
        return _run_streamed(config, methods, qconfig, device, progress, on_row, t_start, scratch)
    own = loaded is None  # the run loads the model itself, so it can read it again
    if loaded is None:
        loaded = load(
            config.model,
            packed=config.packed,
            gguf_dtype=config.gguf_dtype,
            offload_dir=scratch,
            device=device,
        )
    if saved is not None and loaded.quantized is not None:
        saved = loaded.quantized  # with how it loaded (time, fingerprint check)
    if getattr(loaded.model, "hf_device_map", None) is None:  # not dispatched by accelerate
        loaded.model.to(device)
    windows = None
    if not config.skip_ppl:
        text = load_eval_text(config.eval_corpus, config.data_dir)
        windows = windows_from_text(text, loaded.tokenizer, config.seqlen, config.max_windows)

    rows: list[MethodRow] = []
    for method in methods:
        resume = None if config.resume_dir is None else Path(method_resume_dir(config, method.name))
        keep_dir = resume if method.quantizes and config.keep_models and saved is None else None
        kept = None
        if keep_dir is not None:
            kept = load_kept_model(keep_dir, fingerprint_ids(loaded.tokenizer), device)
        if saved is not None:
            # a checkpoint torq saved already quantized: evaluated as it is
            model = loaded.model
            info = saved.get("info", {})
            details = {
                **info.get("details", {}),
                "loaded_from": {"path": loaded.path, **saved.get("load", {})},
            }
            t_quant = float(info.get("quantize_seconds", 0.0))
        elif kept is not None:
            model, info = kept
            details = info["details"]
            # the row reports what the calibration cost when it ran, and says it was reloaded
            t_quant = float(info["quantize_seconds"])
            details["kept_model"] = {"reloaded": True, "load_seconds": info["load_seconds"]}
        else:
            model = loaded.model if not method.quantizes else _fresh_model(config, loaded, own)
            t0 = time.perf_counter()
            ctx = method_context(config, loaded.tokenizer, progress)
            # the method's draws depend on its own settings, never on what ran before it
            with method_rng(config.seed, setting_key(asdict(config), method.name)):
                details = method.apply(model, qconfig, ctx)
            t_quant = time.perf_counter() - t0
            if keep_dir is not None:
                t0 = time.perf_counter()
                keep_model(
                    keep_dir,
                    model,
                    fingerprint_ids(loaded.tokenizer),
                    {
                        "method": method.name,
                        "setting_key": setting_key(asdict(config), method.name),
                        "quantize_seconds": t_quant,
                        "details": details,
                    },
                )
                details["kept_model"] = {
                    "reloaded": False,
                    "save_seconds": time.perf_counter() - t0,
                }
        if config.save_dir is not None and method.quantizes and saved is None:
            details["saved"] = _save(config, method.name, model, loaded, t_quant, details)
        portable, seeds = None, None
        if config.portable_dir is not None and resume is not None:
            portable = portable_path(config, resume)
            seeds = seed_resume_dir(portable, resume, model, loaded.tokenizer)
            details["portable"] = {"file": str(portable), "answers_carried": len(seeds)}
        res = (
            None
            if windows is None
            else perplexity(
                model,
                windows,
                config.batch_size,
                progress,
                desc=method.name,
                checkpoint=None
                if resume is None
                else resume / ppl_checkpoint_name(config.eval_corpus, windows),
                on_checkpoint=None
                if portable is None or resume is None
                else _every(60.0, partial(export_portable, resume, portable)),
            )
        )
        if portable is not None and resume is not None:
            export_portable(resume, portable)
        zeroshot = None
        if config.tasks:
            zeroshot = _zeroshot(
                config,
                model,
                loaded.tokenizer,
                progress,
                details,
                request_cache=resume,
                seeds=seeds,
                portable=portable,
            )
        rows.append(
            MethodRow(
                method=method.name,
                weights=qconfig.weight.name if method.quantizes and qconfig.weight else "fp",
                activations=qconfig.activation.name
                if method.quantizes and qconfig.activation
                else "fp",
                ppl=None if res is None else res.ppl,
                quantize_seconds=t_quant,
                eval_seconds=0.0 if res is None else res.seconds,
                eval_tokens_per_s=0.0 if res is None else res.tokens_per_s,
                details={
                    **details,
                    "perplexity": None if res is None else res.to_dict(),
                    "peak_memory": peak_memory(device),
                },
                zeroshot=zeroshot,
            )
        )
        if model is not loaded.model:
            del model
            gc.collect()
        if on_row is not None and len(rows) < len(methods):
            on_row(_record(config, qconfig, loaded, windows, rows, t_start, complete=False))

    return _record(config, qconfig, loaded, windows, rows, t_start, complete=True)


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


def _fresh_model(config: RunConfig, loaded: LoadedModel, own: bool) -> torch.nn.Module:
    """A float model for one method to quantize in place: read again from its source when
    the run loaded it (each method reads the checkpoint anew, as the streamed path does),
    a copy only of a model object the caller handed in."""
    device = next(loaded.model.parameters()).device
    if own:
        return load(config.model, gguf_dtype=config.gguf_dtype).model.to(device)
    return copy.deepcopy(loaded.model)


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


def check_exportable(config: RunConfig, methods: list[Method]) -> None:
    """Fail before any work when ``--save-format compressed-tensors`` cannot hold a method
    (what the model's layers hold, a bias under a transform, is checked as each is saved)."""
    from torq.export.compressed_tensors import (
        EXPORTABLE,
        EXPORTABLE_METHODS,
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
            raise TorqError(f"--save-format compressed-tensors: {EXPORTABLE}")
        if config.act_scale != "static":
            raise TorqError(f"--save-format compressed-tensors: {NVFP4_ACTIVATIONS}")
    elif config.weight_format not in ("mxfp4", "nvfp4") or act not in (None, "mxfp4"):
        raise TorqError(f"--save-format compressed-tensors: {EXPORTABLE}")
    for method in methods:
        if method.quantizes and method.name not in EXPORTABLE_METHODS:
            raise TorqError(
                f"--save-format compressed-tensors cannot hold '{method.name}' yet: {EXPORTABLE}"
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
    if config.portable_dir is not None and not config.tasks:
        raise TorqError(
            "with --stream, --portable-dir carries the zero-shot answers: add --tasks, or drop it"
        )
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


def _run_streamed(
    config: RunConfig,
    methods: list[Method],
    qconfig: QuantConfig,
    device: torch.device,
    progress: bool,
    on_row: Callable[[dict[str, Any]], None] | None,
    t_start: float,
    scratch: Path | None = None,
) -> dict[str, Any]:
    """:func:`run` one decoder layer at a time (:mod:`torq.driver`): each method streams the
    checkpoint again from its folder, so no copy of the model is made or held."""
    from transformers import AutoTokenizer

    from torq.calibration.data import calibration_windows
    from torq.driver import LayerProgress, run_layerwise
    from torq.export.checkpoint import CheckpointWriter
    from torq.models.loading import model_folder
    from torq.models.streaming import LayerStream

    folder, source_name = model_folder(config.model, config.gguf_dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    # a method whose offline rotation cannot be fused into this architecture fails now,
    # not after the methods before it have run
    skeleton = LayerStream(folder, device).model
    for method in methods:
        ctx = MethodContext(options={"seed": config.seed}, model_config=skeleton.config)
        parts = method.transform.residual(ctx) if method.quantizes else None
        if parts is not None:
            parts.check(skeleton)
    del skeleton
    text = load_eval_text(config.eval_corpus, config.data_dir)
    windows = windows_from_text(text, tokenizer, config.seqlen, config.max_windows)
    rows: list[MethodRow] = []
    loaded = None
    for method in methods:
        source = LayerStream(folder, device)
        loaded = LoadedModel(source.model, tokenizer, source_name, str(folder))
        # the method's resume folder: its layer progress and its zero-shot answers
        resume = None if config.resume_dir is None else Path(method_resume_dir(config, method.name))
        t0 = time.perf_counter()
        ctx = replace(method_context(config, tokenizer, progress), model_config=source.model.config)
        with method_rng(config.seed, setting_key(asdict(config), method.name)):
            plan = method.layer_plan(qconfig, ctx)
            calib = None
            if plan.calibration is not None:
                calib = calibration_windows(tokenizer, plan.calibration, config.data_dir)
            t_data = time.perf_counter() - t0
            writer = None
            if config.save_dir is not None and method.quantizes:
                writer = CheckpointWriter(
                    _streamed_save_dir(config, method.name),
                    source.model,
                    tokenizer,
                    method=method.name,
                    overwrite=True,
                    # with kept progress, a stopped run's parts stay for the next to go on
                    resumable=config.resume_dir is not None,
                )
            with writer if writer is not None else contextlib.nullcontext():
                result = run_layerwise(
                    source,
                    plan,
                    calib,
                    windows,
                    config.batch_size,
                    progress,
                    desc=method.name,
                    sink=writer,
                    hidden_states=config.hidden_states,
                    # a stopped run continues after its last saved layer
                    progress_file=None if resume is None else LayerProgress(resume),
                )
                if writer is not None:
                    assert result.fingerprint is not None
                    t_q = result.quantize_seconds + t_data
                    writer.info = _saved_info(config, source_name, t_q, result.details)
                    writer.finish(result.fingerprint)
        res = result.perplexity
        assert res is not None
        details = {
            **result.details,
            "streamed": {
                "stored_dtypes": source.stored_dtypes,
                "per_layer": result.per_layer,
                "peak_memory": peak_memory(device),
            },
            "perplexity": res.to_dict(),
        }
        if "calibration_seconds" in details:
            details["calibration_seconds"]["data"] = t_data
        zeroshot = None
        if config.tasks:
            assert writer is not None
            zeroshot = _saved_zeroshot(
                config,
                writer.out,
                details,
                progress,
                scratch,
                # answers kept as they come: a stop in the tasks loses none of them
                request_cache=resume,
            )
        if writer is not None:
            saved_at, seconds = writer.out, details.pop("save_seconds")
            written = "part by part, as the layers were quantized"
            if config.save_format == "compressed-tensors":
                from torq.export.compressed_tensors import export_saved_compressed_tensors

                t_export = time.perf_counter()
                saved_at = export_saved_compressed_tensors(
                    writer.out, saved_model_dir(config, method.name), overwrite=True
                )
                shutil.rmtree(writer.out)
                seconds += time.perf_counter() - t_export
                written += ", then exported layer by layer"
            details["saved"] = {
                "path": str(saved_at),
                "format": config.save_format,
                "bytes": sum(f.stat().st_size for f in saved_at.iterdir() if f.is_file()),
                "seconds": seconds,
                "written": written,
            }
        quantizes = method.quantizes
        rows.append(
            MethodRow(
                method=method.name,
                weights=qconfig.weight.name if quantizes and qconfig.weight else "fp",
                activations=qconfig.activation.name if quantizes and qconfig.activation else "fp",
                ppl=res.ppl,
                quantize_seconds=(result.quantize_seconds + t_data) if quantizes else 0.0,
                eval_seconds=res.seconds,
                eval_tokens_per_s=res.tokens_per_s,
                details=details,
                zeroshot=zeroshot,
            )
        )
        del source
        gc.collect()
        if on_row is not None and len(rows) < len(methods):
            on_row(_record(config, qconfig, loaded, windows, rows, t_start, complete=False))
    assert loaded is not None
    return _record(config, qconfig, loaded, windows, rows, t_start, complete=True)


def _saved_zeroshot(
    config: RunConfig,
    folder: Path,
    details: dict[str, Any],
    progress: bool,
    scratch: Path | None = None,
    **cache: Any,
) -> dict[str, Any]:
    """The zero-shot tasks of a streamed method, on the checkpoint it saved, loaded whole
    (packed with ``config.packed``; its layers offloaded to a folder in ``scratch`` when
    given) and freed after. ``cache``: :func:`_zeroshot`'s (the kept answers)."""
    from torq.export import load_quantized

    offload = None if scratch is None else Path(tempfile.mkdtemp(prefix="layers-", dir=scratch))
    try:
        model, tokenizer, manifest = load_quantized(
            folder, device=config.device, packed=config.packed, offload_dir=offload
        )
        resume = cache.get("request_cache")
        if config.portable_dir is not None and resume is not None:
            # answers carried from another machine: checked against this model, then used
            portable = portable_path(config, resume)
            cache["seeds"] = seed_resume_dir(portable, resume, model, tokenizer)
            cache["portable"] = portable
            details["portable"] = {"file": str(portable), "answers_carried": len(cache["seeds"])}
        row = _zeroshot(config, model, tokenizer, progress, details, **cache)
        if "portable" in cache:
            export_portable(resume, cache["portable"])
        del model
    finally:
        gc.collect()
        if offload is not None:
            shutil.rmtree(offload, ignore_errors=True)
    details["zeroshot_model"] = {"loaded_from": str(folder), **manifest.get("load", {})}
    return row


def _zeroshot(
    config: RunConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    progress: bool,
    details: dict[str, Any],
    **cache: Any,
) -> dict[str, Any]:
    """The run's zero-shot tasks on ``model`` (lm-eval's full output into ``details``);
    returns the row's zero-shot part. ``cache``: the resume and portable options."""
    from torq.eval.zeroshot import evaluate_zeroshot

    zs = evaluate_zeroshot(
        model,
        tokenizer,
        config.tasks,
        data_dir=config.data_dir,
        limit=config.task_limit,
        subset=config.task_subset,
        subset_seed=config.task_subset_seed,
        batch_size=config.task_batch_size,
        shared_context=config.shared_context,
        progress=progress,
        **cache,
    )
    details["lm_eval"] = zs["lm_eval"]
    keys = ("seconds", "limit", "subset", "shared_context", "request_cache")
    return {**zs["scores"], **{k: zs[k] for k in keys}}


def peak_memory(device: torch.device | None = None) -> dict[str, int]:
    """The process's peak resident set so far (bytes) and, on a GPU, its peak allocation."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"host_rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
    if device is not None and device.type == "cuda":
        out["gpu_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


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


def saved_manifest(model: str) -> dict[str, Any] | None:
    """The manifest when ``model`` is a checkpoint folder torq saved quantized, else None."""
    from torq.export import is_quantized_checkpoint, read_manifest

    path = Path(model).expanduser()
    return read_manifest(path) if path.is_dir() and is_quantized_checkpoint(path) else None


class _SavedMethod:
    """The row of a model that was quantized before it was saved: nothing to apply."""

    quantizes = True

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.name = manifest.get("method") or "saved"


def _saved_config(config: RunConfig, manifest: dict[str, Any]) -> RunConfig:
    """``config`` with the saved model's formats; its methods must name the saved method."""
    name = manifest.get("method") or "saved"
    if config.methods != [name]:
        raise TorqError(
            f"{config.model} holds a model already quantized with '{name}'; evaluate it with "
            f"--methods {name} (or without --methods). To compare other methods, start from "
            "the float model."
        )
    formats = saved_formats(manifest)
    if formats is None:
        return config
    weight_format, act_format, scale_mode = formats
    return replace(
        config, weight_format=weight_format, act_format=act_format, scale_mode=scale_mode
    )


def saved_formats(manifest: dict[str, Any]) -> tuple[str | None, str | None, str] | None:
    """``(weight format, activation format, MXFP4 scale rule)`` of a saved quantized model's
    linear layers (None for a float side), or None when it has no quantized linear layer."""
    linear = next((e for e in manifest["modules"].values() if e["kind"] == "linear"), None)
    if linear is None:
        return None

    def name_of(spec: dict[str, Any] | None) -> str | None:
        return None if spec is None else spec["name"]

    specs = [s for s in (linear["weight"], linear["activation"]) if s is not None]
    scale_mode = next((s["scale_mode"] for s in specs if s["name"] == "mxfp4"), "ocp")
    return name_of(linear["weight"]), name_of(linear["activation"]), scale_mode


def saved_model_dir(config: RunConfig, method: str) -> Path:
    """``<save_dir>/<model>-<method>``: where ``--save-dir`` writes one method's model."""
    if config.save_dir is None:
        raise TorqError("no save directory configured")
    stem = Path(config.model).name or config.model
    model = "".join(c if c.isalnum() or c in "-._" else "_" for c in stem)
    return Path(config.save_dir) / f"{model}-{method.replace('+', '-')}"


def _streamed_save_dir(config: RunConfig, method: str) -> Path:
    """Where a streamed run writes a method's torq checkpoint as the layers are done: its
    ``--save-dir`` folder, or for ``--save-format compressed-tensors`` a staging folder beside
    it (``.<name>.torq``) that is exported and removed once the model is whole."""
    out = saved_model_dir(config, method)
    if config.save_format == "compressed-tensors":
        return out.with_name(f".{out.name}.torq")
    return out


def _save(
    config: RunConfig,
    method: str,
    model: torch.nn.Module,
    loaded: LoadedModel,
    quantize_seconds: float,
    details: dict[str, Any],
) -> dict[str, Any]:
    from torq.export import save_quantized

    t0 = time.perf_counter()
    out = saved_model_dir(config, method)
    if config.save_format == "compressed-tensors":
        from torq.export.compressed_tensors import export_compressed_tensors

        export_compressed_tensors(model, out, loaded.tokenizer, overwrite=True)
    else:
        save_quantized(
            model,
            out,
            loaded.tokenizer,
            method=method,
            info=_saved_info(config, loaded.source, quantize_seconds, details),
            overwrite=True,
        )
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {
        "path": str(out),
        "format": config.save_format,
        "bytes": size,
        "seconds": time.perf_counter() - t0,
    }


def _saved_info(
    config: RunConfig, source: str, quantize_seconds: float, details: dict[str, Any]
) -> dict[str, Any]:
    """What a saved checkpoint's manifest keeps of the run that made it."""
    return {
        "model": config.model,
        "source": source,
        "quantize_seconds": quantize_seconds,
        "details": {k: v for k, v in details.items() if k not in ("kept_model", "save_seconds")},
        "config": asdict(config),
        "command": command_line(),
        "saved_at": now_iso(),
    }


def eval_dataset_label(corpus: str) -> str:
    """How a result names its perplexity text (``"wikitext-2-raw test"``, as it always has)."""
    return {DEFAULT_EVAL_CORPUS: "wikitext-2-raw test", "wikipedia-en": "wikipedia-en"}.get(
        corpus, f"file {corpus}"
    )


def ppl_checkpoint_name(corpus: str, windows: torch.Tensor) -> str:
    """The kept perplexity windows' file in a method's resume folder: one per text and
    window shape (the WikiText-2 test split's name is the one it always had)."""
    shape = f"{windows.shape[0]}x{windows.shape[1]}"
    if corpus == DEFAULT_EVAL_CORPUS:
        return f"ppl-{shape}.json"
    digest = hashlib.sha1(corpus.encode()).hexdigest()[:8]
    return f"ppl-{_slug_name(corpus)}-{digest}-{shape}.json"


def _slug_name(text: str) -> str:
    name = Path(text).name or text
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)[:40]


def setting_key(config: dict[str, Any], method: str) -> str:
    """What makes two rows of one method the same quantized model (``config`` is
    ``asdict(RunConfig)``): the method's own settings key, :meth:`Method.settings_key`."""
    return get_method(method).settings_key(config)


def method_resume_dir(config: RunConfig, method: str) -> str:
    """``<resume_dir>/<model>/<method>-<hash of its setting key>``: one quantized model's
    kept evaluation (the fingerprints stored there guard against a stale directory)."""
    if config.resume_dir is None:
        raise TorqError("no resume directory configured")
    digest = hashlib.sha1(setting_key(asdict(config), method).encode()).hexdigest()[:10]
    model = "".join(c if c.isalnum() or c in "-._" else "_" for c in config.model)
    return str(Path(config.resume_dir) / model / f"{method}-{digest}")


def _every(seconds: float, fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn``, run at most once per ``seconds`` (the first call runs it)."""
    last = [-float("inf")]

    def call() -> None:
        if time.perf_counter() - last[0] >= seconds:
            last[0] = time.perf_counter()
            fn()

    return call


def portable_path(config: RunConfig, resume: Path) -> Path:
    """``<portable_dir>/<model>-<method>-<hash>.npz``: named after the method's resume
    directory (:func:`method_resume_dir`), so one file belongs to one setting."""
    assert config.portable_dir is not None
    return Path(config.portable_dir) / f"{resume.parent.name}-{resume.name}.npz"


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


def _record(
    config: RunConfig,
    qconfig: QuantConfig,
    loaded: LoadedModel,
    windows: torch.Tensor | None,
    rows: list[MethodRow],
    t_start: float,
    complete: bool,
) -> dict[str, Any]:
    return {
        "kind": "torq.run",
        "complete": complete,
        "date": now_iso(),
        "command": command_line(),
        "config": asdict(config),
        "quant_config": qconfig.to_dict(),
        "model": loaded.describe(),
        "eval": {
            "dataset": eval_dataset_label(config.eval_corpus),
            "n_windows": 0 if windows is None else int(windows.shape[0]),
            "seqlen": config.seqlen,
            "zeroshot_tasks": list(config.tasks),
            "zeroshot_limit": config.task_limit,
            "zeroshot_subset": None
            if config.task_subset is None
            else {"n": config.task_subset, "seed": config.task_subset_seed},
        },
        "rows": [asdict(r) for r in rows],
        "wall_seconds": time.perf_counter() - t_start,
        "peak_memory": peak_memory(resolve_device(config.device)),
        "versions": versions(),
        "machine": machine_info(),
    }


def markdown_table(result: dict[str, Any]) -> str:
    """The comparison table: one row per method, PPL and its ratio to the FP row, and the
    zero-shot scores (acc_norm where the task has it, else acc; percent) when evaluated."""
    rows = result["rows"]
    fp = next((r["ppl"] for r in rows if r["method"] == "fp" and r["ppl"] is not None), None)
    tasks = list(result["eval"].get("zeroshot_tasks") or [])
    if tasks:
        from torq.eval.zeroshot import TASKS

        label = "Wiki2 PPL" if result["eval"]["dataset"] == "wikitext-2-raw test" else "PPL"
        head = f"| method | W | A | {label} | " + " | ".join(TASKS[t].label for t in tasks)
        out = [head + " | Avg |", "| --- | --- | --- | ---: |" + " ---: |" * (len(tasks) + 1)]
        for r in rows:
            z = r["zeroshot"]["tasks"]
            ppl = "–" if r["ppl"] is None else f"{r['ppl']:.2f}"
            cells = " | ".join(f"{100 * z[t]['value']:.1f}" for t in tasks)
            out.append(
                f"| {r['method']} | {r['weights']} | {r['activations']} | {ppl} | {cells} "
                f"| {100 * r['zeroshot']['average']:.1f} |"
            )
    else:
        out = [
            "| method | W | A | PPL | ×FP | quantize s | eval tok/s |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            ratio = f"{r['ppl'] / fp:.2f}" if fp else "–"
            out.append(
                f"| {r['method']} | {r['weights']} | {r['activations']} | {r['ppl']:.2f} | "
                f"{ratio} | {r['quantize_seconds']:.1f} | {r['eval_tokens_per_s']:.0f} |"
            )
    ev = result["eval"]
    out.append("")
    notes = []
    if ev["n_windows"]:
        notes.append(f"{ev['dataset']}, {ev['n_windows']} windows × {ev['seqlen']} tokens")
    if tasks:
        limit = ev.get("zeroshot_limit")
        subset = ev.get("zeroshot_subset")
        which = (
            f"{subset['n']} questions per task drawn with seed {subset['seed']}"
            if subset
            else f"first {limit} examples per task"
            if limit
            else "full tasks"
        )
        notes.append(f"zero-shot (lm-eval, 0-shot, acc_norm where defined, else acc; {which})")
    peak = (result.get("peak_memory") or {}).get("host_rss_bytes")
    if peak:
        notes.append(f"peak RSS {peak / 2**30:.2f} GiB")
    if result["config"].get("stream"):
        notes.append("streamed one decoder layer at a time")
    out.append("; ".join(notes) + f"; model {result['config']['model']}.")
    return "\n".join(out)
