"""The end-to-end job behind ``torq run`` and ``torq eval``: quantize with each method and
evaluate, one decoder layer at a time.

Every float model goes through the layer-streaming driver (:mod:`torq.driver`), whatever
its size: each method streams the checkpoint again from its folder, quantizes it layer by
layer and is evaluated on the same perplexity windows as every other method, so the rows
of the table are directly comparable and memory follows one layer, not the model. Zero-shot
tasks need the whole model: they run on the method's quantized checkpoint, written as its
layers are done (to ``--save-dir``, the resume folder, or a temporary folder) and loaded
back. A checkpoint torq saved already quantized is evaluated as it is. The run's parts live
in :mod:`torq.runs`: its settings and their checks, where its models come from and go,
where its evaluation is kept, what it reports.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from torq.calibration.data import calibration_windows
from torq.calibration.hidden import HIDDEN_MODES
from torq.data import load_eval_text
from torq.driver import LayerProgress, run_layerwise
from torq.errors import TorqError
from torq.eval.perplexity import perplexity, sample_windows, windows_from_text
from torq.eval.zeroshot import evaluate_zeroshot
from torq.export import load_quantized
from torq.export.checkpoint import CheckpointWriter
from torq.export.compressed_tensors import refuse_fused_experts
from torq.export.loading import load_model
from torq.methods.layers import layer_plan
from torq.methods.registry import LayerPlan, Method, MethodSpec
from torq.models.loading import LoadedModel, model_folder
from torq.models.streaming import LayerStream, collecting_new_objects_only
from torq.paths import write_json_atomic
from torq.runs.checks import check_run
from torq.runs.config import RunConfig, method_context, resolve_device
from torq.runs.report import MethodRow, peak_memory, run_record
from torq.runs.source import (
    SavedMethod,
    offload_scratch,
    saved_config,
    saved_info,
    saved_manifest,
    saved_model_dir,
    streamed_save_dir,
)
from torq.runs.store import FolderStore, open_method_resume_dir, ppl_record_name, setting_key
from torq.seeding import method_rng
from torq.surgery.qlinear import QuantConfig

# ``hidden_states="auto"`` keeps the windows' hidden states in memory up to this many bytes
# (one copy, float32; a layer holds its inputs and outputs, so twice that at its peak) and
# in files beyond it: the same numbers either way, and a full-test evaluation of a large
# model does not hold gigabytes of states
AUTO_HIDDEN_MEMORY_BYTES = 512 * 2**20
# the file in a method's resume folder that holds its finished row
ROW_FILE = "row-{}.json"


def run(
    config: RunConfig,
    progress: bool = True,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every method of ``config`` on the same model and windows; return the result record.

    ``on_row`` receives the record as it stands after each method (``"complete": False``
    until the last), so a long comparison can be saved as it goes.
    """
    if not config.methods:
        raise TorqError("no methods given")
    with offload_scratch(config.offload_dir) as scratch:
        saved = saved_manifest(config.model)
        if saved is not None:
            return _evaluate_saved(saved_config(config, saved), saved, progress, scratch)
        # each method with its own settings, as the record keeps them
        config = replace(config, methods=config.specs())
        check_run(config, from_saved=False)
        return _run_streamed(config, progress, on_row, scratch)


def _evaluate_saved(
    config: RunConfig, saved: dict[str, Any], progress: bool, scratch: Path | None
) -> dict[str, Any]:
    """The row of a checkpoint torq saved already quantized, evaluated as it is: loaded
    whole (its weights packed with ``config.packed``, its layers offloaded to ``scratch``)."""
    method = SavedMethod(saved)
    check_run(config, from_saved=True)
    qconfig = config.quant_config()
    t_start = time.perf_counter()
    device = resolve_device(config.device)
    loaded = load_model(config.model, packed=config.packed, offload_dir=scratch, device=device)
    saved = loaded.quantized or saved  # with how it loaded (time, fingerprint check)
    if getattr(loaded.model, "hf_device_map", None) is None:  # not dispatched by accelerate
        loaded.model.to(device)
    windows, sample = _eval_windows(config, loaded.tokenizer)
    resume = open_method_resume_dir(config, method.name)
    info = saved.get("info", {})
    details = {
        **info.get("details", {}),
        "loaded_from": {"path": loaded.path, **saved.get("load", {})},
    }
    res = None
    if windows is not None:
        res = perplexity(
            loaded.model,
            windows,
            config.batch_size,
            progress,
            desc=method.name,
            store=None if resume is None else FolderStore(resume),
            name=ppl_record_name(config.eval_corpus, windows),
        )
    zeroshot = None
    if config.tasks:
        zeroshot = _zeroshot(config, loaded.model, loaded.tokenizer, progress, details, resume)
    row = _row(
        method.name,
        qconfig,
        True,
        res,
        float(info.get("quantize_seconds", 0.0)),
        {**details, "perplexity": None if res is None else res.to_dict()},
        zeroshot,
    )
    row.details["peak_memory"] = peak_memory(device)
    return run_record(config, qconfig, loaded, windows, [row], t_start, True, sample)


def _eval_windows(
    config: RunConfig, tokenizer: Any
) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
    """The perplexity windows (none with ``skip_ppl``) and, for a seeded window sample,
    which windows of how many it took (the record's ``eval.window_sample``)."""
    if config.skip_ppl:
        return None, None
    text = load_eval_text(config.eval_corpus, config.data_dir)
    windows = windows_from_text(text, tokenizer, config.seqlen, config.max_windows)
    if config.window_sample is None:
        return windows, None
    total = int(windows.shape[0])
    windows, ids = sample_windows(windows, config.window_sample, config.window_sample_seed)
    return windows, {"n": len(ids), "seed": config.window_sample_seed, "of": total, "ids": ids}


def _row(
    name: str,
    qconfig: QuantConfig,
    quantizes: bool,
    res: Any,
    quantize_seconds: float,
    details: dict[str, Any],
    zeroshot: dict[str, Any] | None,
) -> MethodRow:
    return MethodRow(
        method=name,
        weights=qconfig.weight.name if quantizes and qconfig.weight else "fp",
        activations=qconfig.activation.name if quantizes and qconfig.activation else "fp",
        ppl=None if res is None else res.ppl,
        quantize_seconds=quantize_seconds if quantizes else 0.0,
        eval_seconds=0.0 if res is None else res.seconds,
        eval_tokens_per_s=0.0 if res is None else res.tokens_per_s,
        details=details,
        zeroshot=zeroshot,
    )


def hidden_states_mode(
    config: RunConfig, plans: list[LayerPlan], hidden_size: int, n_windows: int
) -> str:
    """Where the streamed run keeps the windows' hidden states: ``config.hidden_states``,
    or for ``"auto"`` memory when the largest method's states fit
    :data:`AUTO_HIDDEN_MEMORY_BYTES`, else files (exact float32 either way)."""
    if config.hidden_states != "auto":
        return config.hidden_states
    tokens = max(
        # an asymmetric plan (GPTAQ) carries the float model's calibration states too
        (
            p.calibration.n_samples * p.calibration.seqlen * (2 if p.asymmetric else 1)
            if p.calibration is not None
            else 0
        )
        for p in plans
    )
    tokens += n_windows * config.seqlen
    return "memory" if tokens * hidden_size * 4 <= AUTO_HIDDEN_MEMORY_BYTES else "disk"


@collecting_new_objects_only
def _run_streamed(
    config: RunConfig,
    progress: bool,
    on_row: Callable[[dict[str, Any]], None] | None,
    scratch: Path | None,
) -> dict[str, Any]:
    """Each method streams the checkpoint again from its folder, one decoder layer at a
    time (:mod:`torq.driver`), so no copy of the model is made or held. The objects alive
    before the run stay out of the garbage collector's sight until it returns, so the
    collection after each method walks only what the run made (a full one per method cost
    0.2 s in a test process, more than a tiny model's whole method)."""
    from transformers import AutoTokenizer

    qconfig = config.quant_config()
    t_start = time.perf_counter()
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    folder, source_name = model_folder(config.model, config.gguf_dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    # a method whose offline rotation cannot be fused into this architecture fails now,
    # not after the methods before it have run
    skeleton = LayerStream(folder, device).model
    if config.save_dir is not None and config.save_format == "compressed-tensors":
        refuse_fused_experts(skeleton)
    specs = [m for m in config.methods if isinstance(m, MethodSpec)]
    plans = []
    for spec in specs:
        method = spec.method
        ctx = method_context(config, spec, tokenizer, False, skeleton.config)
        parts = method.transform.residual(ctx) if method.quantizes else None
        if parts is not None:
            parts.check(skeleton)
        plans.append(layer_plan(method, qconfig, ctx))
    hidden_size = int(skeleton.config.hidden_size)
    windows, sample = _eval_windows(config, tokenizer)
    n_windows = 0 if windows is None else int(windows.shape[0])
    hidden = hidden_states_mode(config, plans, hidden_size, n_windows)
    rows: list[MethodRow] = []
    # what the record says of the model: its config and size, not its weights
    loaded = LoadedModel(skeleton, tokenizer, source_name, str(folder))
    for spec in specs:
        method = spec.method
        resume = open_method_resume_dir(config, method.name)
        row = _finished_row(config, resume, windows, method)
        if row is None:
            row = _stream_method(
                config, spec, qconfig, folder, source_name, tokenizer, windows, hidden,
                device, progress, scratch, resume,
            )  # fmt: skip
            if resume is not None:
                write_json_atomic(resume / _row_file(config, windows), asdict(row))
        rows.append(row)
        gc.collect()
        if on_row is not None and len(rows) < len(specs):
            on_row(run_record(config, qconfig, loaded, windows, rows, t_start, False, sample))
    return run_record(config, qconfig, loaded, windows, rows, t_start, True, sample)


def _row_file(config: RunConfig, windows: torch.Tensor | None) -> str:
    """The finished row's file in a method's resume folder, named by what else makes the
    row (the windows' tokens, the tasks, where the model is saved); the folder is named by
    the method's settings."""
    tokens = None if windows is None else hashlib.sha1(windows.numpy().tobytes()).hexdigest()
    keys = ("tasks", "task_limit", "task_subset", "task_subset_seed", "skip_ppl")
    what = {"windows": tokens, **{k: getattr(config, k) for k in keys}}
    what["save"] = [config.save_dir, config.save_format]
    digest = hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    return ROW_FILE.format(digest[:12])


def _finished_row(
    config: RunConfig, resume: Path | None, windows: torch.Tensor | None, method: Method
) -> MethodRow | None:
    """A method's row that an earlier run with the same resume folder finished (its saved
    model still there, when one is asked for), else ``None``."""
    if resume is None:
        return None
    file = resume / _row_file(config, windows)
    if not file.is_file():
        return None
    row = MethodRow(**json.loads(file.read_text()))
    saved = row.details.get("saved")
    wanted = config.save_dir is not None and method.quantizes
    if wanted and (saved is None or not Path(saved["path"]).is_dir()):
        return None  # its model is gone: quantize it again
    row.details["finished_row"] = {"reused_from": str(file)}
    return row


@contextlib.contextmanager
def _task_checkpoint(
    config: RunConfig, method: Method, resume: Path | None, scratch: Path | None
) -> Iterator[Path | None]:
    """Where a method's quantized model is written for its zero-shot tasks when no
    ``--save-dir`` is given: the resume folder (kept: a stop in the tasks does not
    quantize again) or a temporary folder removed after the tasks."""
    if not config.tasks or config.save_dir is not None or not method.quantizes:
        yield None
    elif resume is not None:
        yield resume / "model"
    else:
        tmp = Path(tempfile.mkdtemp(prefix="torq-tasks-", dir=scratch))
        try:
            yield tmp / "model"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _stream_method(
    config: RunConfig,
    spec: MethodSpec,
    qconfig: QuantConfig,
    folder: Path,
    source_name: str,
    tokenizer: Any,
    windows: torch.Tensor | None,
    hidden: str,
    device: torch.device,
    progress: bool,
    scratch: Path | None,
    resume: Path | None,
) -> MethodRow:
    """One method's row: quantized and evaluated layer by layer, saved as it goes."""
    source = LayerStream(folder, device)
    t0 = time.perf_counter()
    method = spec.method
    ctx = method_context(config, spec, tokenizer, progress, source.model.config)
    with (
        method_rng(config.seed, setting_key(asdict(config), method.name)),
        _task_checkpoint(config, method, resume, scratch) as task_dir,
    ):
        plan = layer_plan(method, qconfig, ctx)
        calib = None
        if plan.calibration is not None:
            calib = calibration_windows(tokenizer, plan.calibration, config.data_dir)
        t_data = time.perf_counter() - t0
        writer = None
        out = streamed_save_dir(config, method.name) if config.save_dir is not None else task_dir
        if out is not None and method.quantizes:
            writer = CheckpointWriter(
                out,
                source.model,
                tokenizer,
                method=method.name,
                overwrite=True,
                # with kept progress, a stopped run's parts stay for the next to go on
                resumable=resume is not None,
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
                hidden_states=hidden,
                # a stopped run continues after its last saved layer
                progress_file=None if resume is None else LayerProgress(resume),
            )
            if writer is not None:
                assert result.fingerprint is not None
                t_q = result.quantize_seconds + t_data
                writer.info = saved_info(config, source_name, t_q, result.details)
                writer.finish(result.fingerprint)
        res = result.perplexity
        details = {
            **result.details,
            "streamed": {
                "stored_dtypes": source.stored_dtypes,
                "per_layer": result.per_layer,
                "peak_memory": peak_memory(device),
            },
            "perplexity": None if res is None else res.to_dict(),
        }
        if "calibration_seconds" in details:
            details["calibration_seconds"]["data"] = t_data
        del source
        gc.collect()
        zeroshot = None
        if config.tasks:
            if writer is not None:
                # answers kept as they come: a stop in the tasks loses none of them
                zeroshot = _saved_zeroshot(config, writer.out, details, progress, scratch, resume)
            else:  # the float model, loaded whole for the tasks
                loaded = load_model(config.model, gguf_dtype=config.gguf_dtype)
                loaded.model.to(device)
                zeroshot = _zeroshot(config, loaded.model, tokenizer, progress, details, resume)
                del loaded
                gc.collect()
    save_seconds = details.pop("save_seconds", 0.0)
    if writer is not None and config.save_dir is not None:
        details["saved"] = _finish_save(config, method.name, writer.out, save_seconds)
    return _row(
        method.name,
        qconfig,
        method.quantizes,
        res,
        result.quantize_seconds + t_data,
        details,
        zeroshot,
    )


def _finish_save(config: RunConfig, name: str, written: Path, seconds: float) -> dict[str, Any]:
    """What ``--save-dir`` holds of a method: torq's checkpoint written part by part, or
    for compressed-tensors that checkpoint exported layer by layer, then removed."""
    saved_at = written
    how = "part by part, as the layers were quantized"
    if config.save_format == "compressed-tensors":
        from torq.export.compressed_tensors import export_saved_compressed_tensors

        t_export = time.perf_counter()
        saved_at = export_saved_compressed_tensors(
            written, saved_model_dir(config, name), overwrite=True
        )
        shutil.rmtree(written)
        seconds += time.perf_counter() - t_export
        how += ", then exported layer by layer"
    return {
        "path": str(saved_at),
        "format": config.save_format,
        "bytes": sum(f.stat().st_size for f in saved_at.iterdir() if f.is_file()),
        "seconds": seconds,
        "written": how,
    }


def _saved_zeroshot(
    config: RunConfig,
    folder: Path,
    details: dict[str, Any],
    progress: bool,
    scratch: Path | None,
    resume: Path | None,
) -> dict[str, Any]:
    """The zero-shot tasks of a method on the checkpoint it saved, loaded whole (packed with
    ``config.packed``; its layers offloaded to a folder in ``scratch`` when given) and freed
    after."""

    offload = None if scratch is None else Path(tempfile.mkdtemp(prefix="layers-", dir=scratch))
    try:
        model, tokenizer, manifest = load_quantized(
            folder, device=config.device, packed=config.packed, offload_dir=offload
        )
        row = _zeroshot(config, model, tokenizer, progress, details, resume)
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
    resume: Path | None,
) -> dict[str, Any]:
    """The run's zero-shot tasks on ``model`` (lm-eval's full output into ``details``);
    returns the row's zero-shot part. Its answers are kept in ``resume`` as they come."""

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
        store=None if resume is None else FolderStore(resume),
    )
    details["lm_eval"] = zs["lm_eval"]
    keys = ("seconds", "limit", "subset", "shared_context", "request_cache")
    return {**zs["scores"], **{k: zs[k] for k in keys}}


__all__ = ["AUTO_HIDDEN_MEMORY_BYTES", "HIDDEN_MODES", "hidden_states_mode", "run"]
