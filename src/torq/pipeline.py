"""The end-to-end job behind ``torq run``: load → quantize with each method → evaluate.

The data flow is one way: each method gets its own float model (read again from the
checkpoint, :func:`torq.runs.source.fresh_model`), quantizes it, and is evaluated on the
same perplexity windows as every other method, so the rows of the table are directly
comparable. With ``--stream`` the same happens one decoder layer at a time
(:mod:`torq.driver`). The run's parts live in :mod:`torq.runs`: its settings and their
checks, where its models come from, where its evaluation is kept, what it reports.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from torq.calibration.data import calibration_windows
from torq.data import load_eval_text
from torq.driver import LayerProgress, apply_method, run_layerwise
from torq.errors import TorqError
from torq.eval.perplexity import perplexity, windows_from_text
from torq.eval.zeroshot import evaluate_zeroshot
from torq.export import load_quantized
from torq.export.checkpoint import CheckpointWriter
from torq.export.loading import load_model
from torq.methods.layers import layer_plan
from torq.methods.registry import Method, MethodContext, get_method
from torq.models.fingerprint import fingerprint_ids
from torq.models.loading import LoadedModel, model_folder
from torq.models.streaming import LayerStream
from torq.runs.checks import check_run
from torq.runs.config import RunConfig, method_context, resolve_device
from torq.runs.kept import keep_model, load_kept_model
from torq.runs.report import MethodRow, peak_memory, run_record
from torq.runs.source import (
    SavedMethod,
    fresh_model,
    offload_scratch,
    save_model,
    saved_config,
    saved_info,
    saved_manifest,
    saved_model_dir,
    streamed_save_dir,
)
from torq.runs.store import open_method_resume_dir, ppl_checkpoint_name, setting_key
from torq.seeding import method_rng
from torq.surgery.qlinear import QuantConfig


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
        config = saved_config(config, saved)
        methods = [SavedMethod(saved)]
    check_run(config, methods, from_saved=saved is not None)
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
        loaded = load_model(
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
        resume = open_method_resume_dir(config, method.name)
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
            model = loaded.model if not method.quantizes else fresh_model(config, loaded, own)
            t0 = time.perf_counter()
            ctx = method_context(config, loaded.tokenizer, progress)
            # the method's draws depend on its own settings, never on what ran before it
            with method_rng(config.seed, setting_key(asdict(config), method.name)):
                details = apply_method(method, model, qconfig, ctx)
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
            details["saved"] = save_model(config, method.name, model, loaded, t_quant, details)
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
            )
        )
        zeroshot = None
        if config.tasks:
            zeroshot = _zeroshot(
                config,
                model,
                loaded.tokenizer,
                progress,
                details,
                request_cache=resume,
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
            on_row(run_record(config, qconfig, loaded, windows, rows, t_start, complete=False))

    return run_record(config, qconfig, loaded, windows, rows, t_start, complete=True)


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
        resume = open_method_resume_dir(config, method.name)
        t0 = time.perf_counter()
        ctx = replace(method_context(config, tokenizer, progress), model_config=source.model.config)
        with method_rng(config.seed, setting_key(asdict(config), method.name)):
            plan = layer_plan(method, qconfig, ctx)
            calib = None
            if plan.calibration is not None:
                calib = calibration_windows(tokenizer, plan.calibration, config.data_dir)
            t_data = time.perf_counter() - t0
            writer = None
            if config.save_dir is not None and method.quantizes:
                writer = CheckpointWriter(
                    streamed_save_dir(config, method.name),
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
                    writer.info = saved_info(config, source_name, t_q, result.details)
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
            on_row(run_record(config, qconfig, loaded, windows, rows, t_start, complete=False))
    assert loaded is not None
    return run_record(config, qconfig, loaded, windows, rows, t_start, complete=True)


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

    offload = None if scratch is None else Path(tempfile.mkdtemp(prefix="layers-", dir=scratch))
    try:
        model, tokenizer, manifest = load_quantized(
            folder, device=config.device, packed=config.packed, offload_dir=offload
        )
        row = _zeroshot(config, model, tokenizer, progress, details, **cache)
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
    returns the row's zero-shot part. ``cache``: where its answers are kept."""

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
