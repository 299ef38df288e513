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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from torq.calibration.data import CaptureSettings, calibration_data, calibration_windows
from torq.calibration.hidden import HIDDEN_MODES
from torq.data import load_eval_text
from torq.driver import LayerProgress, run_layerwise
from torq.driver.budget import PrecisionBudget, budgeted, check_budget
from torq.errors import TorqError
from torq.eval.perplexity import perplexity, sample_windows, windows_from_text
from torq.eval.zeroshot import evaluate_zeroshot
from torq.export import load_quantized
from torq.export.checkpoint import CheckpointWriter
from torq.export.compressed_tensors import EXPERTS_ROTATED, experts_unserved, fused_experts_in
from torq.export.loading import load_model
from torq.methods.layers import layer_plan
from torq.methods.registry import LayerPlan, Method, MethodContext, MethodSpec
from torq.models.loading import LoadedModel, model_folder
from torq.models.streaming import LayerStream, collecting_new_objects_only
from torq.paths import write_json_atomic
from torq.runs.checks import (
    check_compressed_tensors,
    check_data,
    check_destinations,
    check_options,
    check_settings,
)
from torq.runs.config import (
    EvalPlan,
    ModelSource,
    Outputs,
    RunConfig,
    TaskPlan,
    resolve_device,
)
from torq.runs.report import MethodRow, peak_memory, run_record
from torq.runs.source import (
    SavedMethod,
    offload_scratch,
    saved_info,
    saved_manifest,
    saved_model_dir,
    saved_run_formats,
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
    with offload_scratch(config.source.offload_dir) as scratch:
        saved = saved_manifest(config.source.model)
        if saved is not None:
            formats = saved_run_formats(
                config.source.model, config.method_names(), config.formats, saved
            )
            config = replace(config, formats=formats)
        else:  # each method with its own settings, as the record keeps them
            config = replace(config, methods=tuple(config.specs()))
        # every check before the model is loaded (a saved model's method is not checked: it
        # is evaluated as it is)
        specs = [] if saved is not None else config.specs()
        qconfig = config.quant_config()
        model = config.source.model
        check_destinations(config.outputs, model, specs)
        check_settings(model, config.evaluation, config.capture, qconfig, specs)
        check_compressed_tensors(
            config.outputs, config.formats, config.zeroshot, config.capture, specs
        )
        check_options(
            config.source, config.evaluation, config.zeroshot, config.outputs, saved is not None
        )
        check_data(
            config.source.data_dir, config.evaluation, config.zeroshot, config.capture, qconfig,
            specs,
        )  # fmt: skip
        if saved is None:
            check_budget(config.formats.budget(), qconfig)
        if saved is not None:
            return _evaluate_saved(config, saved, progress, scratch)
        return _run_streamed(config, progress, on_row, scratch)


def _evaluate_saved(
    config: RunConfig, saved: dict[str, Any], progress: bool, scratch: Path | None
) -> dict[str, Any]:
    """The row of a checkpoint torq saved already quantized, evaluated as it is: loaded
    whole (its weights packed with ``config.packed``, its layers offloaded to ``scratch``)."""
    method = SavedMethod(saved)
    qconfig = config.quant_config()
    record = config.record()
    evaluation, source = config.evaluation, config.source
    t_start = time.perf_counter()
    device = resolve_device(source.device)
    loaded = load_model(source.model, packed=evaluation.packed, offload_dir=scratch, device=device)
    saved = loaded.quantized or saved  # with how it loaded (time, fingerprint check)
    if getattr(loaded.model, "hf_device_map", None) is None:  # not dispatched by accelerate
        loaded.model.to(device)
    windows, sample = _eval_windows(evaluation, source.data_dir, loaded.tokenizer)
    resume = open_method_resume_dir(config.outputs.resume_dir, record, method.name)
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
            evaluation.batch_size,
            progress,
            desc=method.name,
            store=None if resume is None else FolderStore(resume),
            name=ppl_record_name(evaluation.eval_corpus, windows),
        )
    zeroshot = None
    if config.zeroshot.tasks:
        zeroshot = _zeroshot(
            config.zeroshot, source.data_dir, loaded.model, loaded.tokenizer, progress, details,
            resume,
        )  # fmt: skip
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
    return run_record(record, qconfig, loaded, windows, [row], t_start, True, sample)


def _eval_windows(
    evaluation: EvalPlan, data_dir: str | None, tokenizer: Any
) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
    """The perplexity windows (none with ``skip_ppl``) and, for a seeded window sample,
    which windows of how many it took (the record's ``eval.window_sample``)."""
    if evaluation.skip_ppl:
        return None, None
    text = load_eval_text(evaluation.eval_corpus, data_dir)
    windows = windows_from_text(text, tokenizer, evaluation.seqlen, evaluation.max_windows)
    if evaluation.window_sample is None:
        return windows, None
    total = int(windows.shape[0])
    seed = evaluation.window_sample_seed
    windows, ids = sample_windows(windows, evaluation.window_sample, seed)
    return windows, {"n": len(ids), "seed": seed, "of": total, "ids": ids}


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


def _float_windows(plan: LayerPlan) -> int:
    """The calibration windows whose float-model states ``plan`` carries (GPTAQ's)."""
    if not plan.asymmetric or plan.calibration is None:
        return 0
    # (the plan's reference windows are fewer than all, or 0 for all)
    return plan.reference_windows or plan.calibration.n_samples


def hidden_states_mode(
    evaluation: EvalPlan, plans: list[LayerPlan], hidden_size: int, n_windows: int
) -> str:
    """Where the streamed run keeps the windows' hidden states: ``evaluation.hidden_states``,
    or for ``"auto"`` memory when the largest method's states fit
    :data:`AUTO_HIDDEN_MEMORY_BYTES`, else files (exact float32 either way)."""
    if evaluation.hidden_states != "auto":
        return evaluation.hidden_states
    tokens = max(
        # an asymmetric plan (GPTAQ) carries the float model's calibration states too (on
        # its first reference windows only, where it names them)
        (p.calibration.seqlen * (p.calibration.n_samples + _float_windows(p)))
        if p.calibration is not None
        else 0
        for p in plans
    )
    tokens += n_windows * evaluation.seqlen
    return "memory" if tokens * hidden_size * 4 <= AUTO_HIDDEN_MEMORY_BYTES else "disk"


@dataclass
class _Streamed:
    """What every method of a streamed run shares: the run's record and the parts of its
    settings a method reads, the model's folder and tokenizer, the windows, where the
    hidden states and the models go."""

    record: dict[str, Any]
    qconfig: QuantConfig
    source: ModelSource
    capture: CaptureSettings
    seed: int
    evaluation: EvalPlan
    zeroshot: TaskPlan
    outputs: Outputs
    folder: Path
    source_name: str
    tokenizer: Any
    device: torch.device
    progress: bool
    scratch: Path | None
    windows: torch.Tensor | None = None
    hidden: str = "memory"
    budget: PrecisionBudget | None = None

    def context(self, spec: MethodSpec, progress: bool, model_config: Any) -> MethodContext:
        """What the method ``spec`` reads beyond the model."""
        return spec.context(
            self.capture,
            self.tokenizer,
            model_config,
            data_dir=self.source.data_dir,
            progress=progress,
            seed=self.seed,
        )


def _refuse_unservable_experts(
    skeleton: torch.nn.Module, run: _Streamed, specs: list[MethodSpec]
) -> None:
    """Refuse, in one line before any layer is quantized, fused MoE experts that a
    compressed-tensors folder cannot hold: their architecture or format
    (:func:`~torq.export.compressed_tensors.experts_unserved`), or a method that keeps an
    online transform on their inputs."""
    name = fused_experts_in(skeleton)
    if name is None:
        return
    weight = run.qconfig.weight
    reason = experts_unserved(skeleton, None if weight is None else weight.name)
    if reason is not None:
        raise TorqError(reason)
    for spec in specs:
        ctx = run.context(spec, False, skeleton.config)
        if spec.method.quantizes and spec.method.transform.experts_online(run.qconfig, ctx):
            raise TorqError(f"{name}: {EXPERTS_ROTATED} ('{spec.method.name}')")


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

    t_start = time.perf_counter()
    torch.manual_seed(config.seed)
    device = resolve_device(config.source.device)
    folder, source_name = model_folder(config.source.model, config.source.gguf_dtype)
    run = _Streamed(
        config.record(), config.quant_config(), config.source, config.capture, config.seed,
        config.evaluation, config.zeroshot, config.outputs, folder, source_name,
        AutoTokenizer.from_pretrained(str(folder)), device, progress, scratch,
    )  # fmt: skip
    run.budget = config.formats.budget(config.seed)
    # a method whose offline rotation cannot be fused into this architecture fails now,
    # not after the methods before it have run
    skeleton = LayerStream(folder, device).model
    specs = [m for m in config.methods if isinstance(m, MethodSpec)]
    serving = run.outputs.save_dir is not None and run.outputs.save_format == "compressed-tensors"
    if serving:
        _refuse_unservable_experts(skeleton, run, specs)
    plans = []
    for spec in specs:
        ctx = run.context(spec, False, skeleton.config)
        parts = spec.method.transform.residual(ctx) if spec.method.quantizes else None
        if parts is not None:
            parts.check(skeleton)
        plans.append(layer_plan(spec.method, run.qconfig, ctx))
    run.windows, sample = _eval_windows(config.evaluation, config.source.data_dir, run.tokenizer)
    n_windows = 0 if run.windows is None else int(run.windows.shape[0])
    hidden_size = int(skeleton.config.hidden_size)
    run.hidden = hidden_states_mode(config.evaluation, plans, hidden_size, n_windows)
    rows: list[MethodRow] = []
    # what the record says of the model: its config and size, not its weights
    loaded = LoadedModel(skeleton, run.tokenizer, source_name, str(folder))

    def record(done: bool) -> dict[str, Any]:
        return run_record(run.record, run.qconfig, loaded, run.windows, rows, t_start, done, sample)

    for spec in specs:
        resume = open_method_resume_dir(run.outputs.resume_dir, run.record, spec.method.name)
        row_file = _row_file(run.zeroshot, run.outputs, run.windows)
        row = _finished_row(run.outputs, resume, row_file, spec.method)
        if row is None:
            row = _stream_method(run, spec, resume)
            if resume is not None:
                write_json_atomic(resume / row_file, asdict(row))
        rows.append(row)
        gc.collect()
        if on_row is not None and len(rows) < len(specs):
            on_row(record(False))
    return record(True)


def _row_file(zeroshot: TaskPlan, outputs: Outputs, windows: torch.Tensor | None) -> str:
    """The finished row's file in a method's resume folder, named by what else makes the
    row (the windows' tokens, the tasks, where the model is saved); the folder is named by
    the method's settings."""
    tokens = None if windows is None else hashlib.sha1(windows.numpy().tobytes()).hexdigest()
    what = {
        "windows": tokens,
        "tasks": list(zeroshot.tasks),
        "task_limit": zeroshot.task_limit,
        "task_subset": zeroshot.task_subset,
        "task_subset_seed": zeroshot.task_subset_seed,
        # skip_ppl: no windows, which ``tokens`` already says
        "skip_ppl": windows is None,
        "save": [outputs.save_dir, outputs.save_format],
    }
    digest = hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
    return ROW_FILE.format(digest[:12])


def _finished_row(
    outputs: Outputs, resume: Path | None, row_file: str, method: Method
) -> MethodRow | None:
    """A method's row that an earlier run with the same resume folder finished (its saved
    model still there, when one is asked for), else ``None``."""
    if resume is None:
        return None
    file = resume / row_file
    if not file.is_file():
        return None
    row = MethodRow(**json.loads(file.read_text()))
    saved = row.details.get("saved")
    wanted = outputs.save_dir is not None and method.quantizes
    if wanted and (saved is None or not Path(saved["path"]).is_dir()):
        return None  # its model is gone: quantize it again
    row.details["finished_row"] = {"reused_from": str(file)}
    return row


@contextlib.contextmanager
def _task_checkpoint(run: _Streamed, method: Method, resume: Path | None) -> Iterator[Path | None]:
    """Where a method's quantized model is written for its zero-shot tasks when no
    ``--save-dir`` is given: the resume folder (kept: a stop in the tasks does not
    quantize again) or a temporary folder removed after the tasks."""
    if not run.zeroshot.tasks or run.outputs.save_dir is not None or not method.quantizes:
        yield None
    elif resume is not None:
        yield resume / "model"
    else:
        tmp = Path(tempfile.mkdtemp(prefix="torq-tasks-", dir=run.scratch))
        try:
            yield tmp / "model"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _stream_method(run: _Streamed, spec: MethodSpec, resume: Path | None) -> MethodRow:
    """One method's row: quantized and evaluated layer by layer, saved as it goes, then
    its zero-shot tasks."""
    method = spec.method
    with (
        method_rng(run.seed, setting_key(run.record, method.name)),
        _task_checkpoint(run, method, resume) as task_dir,
    ):
        result, details, out = _quantize_streamed(run, spec, resume, task_dir)
        zeroshot = None
        if run.zeroshot.tasks:
            if out is not None:
                # answers kept as they come: a stop in the tasks loses none of them
                zeroshot = _saved_zeroshot(run, out, details, resume)
            else:  # the float model, loaded whole for the tasks
                loaded = load_model(run.source.model, gguf_dtype=run.source.gguf_dtype)
                loaded.model.to(run.device)
                zeroshot = _zeroshot(
                    run.zeroshot, run.source.data_dir, loaded.model, run.tokenizer,
                    run.progress, details, resume,
                )  # fmt: skip
                del loaded
                gc.collect()
    t_data = details.pop("data_seconds")
    save_seconds = details.pop("save_seconds", 0.0)
    if out is not None and run.outputs.save_dir is not None:
        details["saved"] = _finish_save(run, method.name, out, save_seconds)
    return _row(
        method.name,
        run.qconfig,
        method.quantizes,
        result.perplexity,
        result.quantize_seconds + t_data,
        details,
        zeroshot,
    )


def _quantize_streamed(
    run: _Streamed, spec: MethodSpec, resume: Path | None, task_dir: Path | None
) -> tuple[Any, dict[str, Any], Path | None]:
    """A method quantized and evaluated layer by layer (:func:`torq.driver.run_layerwise`),
    its checkpoint written as it goes when one is asked for; the driver's result, the
    row's details and where its checkpoint is."""
    source = LayerStream(run.folder, run.device)
    t0 = time.perf_counter()
    method = spec.method
    ctx = run.context(spec, run.progress, source.model.config)
    qconfig, budget, windows = run.qconfig, None, None
    if run.budget is not None and method.quantizes:
        # which linears stay in MXFP8: measured on the float model first, streamed
        windows = calibration_windows(run.tokenizer, ctx.capture.calibration, run.source.data_dir)
        probe = LayerStream(run.folder, run.device)
        qconfig, budget = budgeted(probe, windows, qconfig, run.budget, run.progress)
        budget["seconds"] = time.perf_counter() - t0
        del probe
    plan = layer_plan(method, qconfig, ctx)
    calib, data = None, None
    if plan.calibration is not None:
        calib = (
            windows  # the budget's windows are the method's own: not read twice
            if windows is not None and plan.calibration is ctx.capture.calibration
            else calibration_windows(run.tokenizer, plan.calibration, run.source.data_dir)
        )
        data = calibration_data(plan.calibration, run.source.data_dir)
    t_data = time.perf_counter() - t0
    writer = None
    out = task_dir
    if run.outputs.save_dir is not None:
        out = streamed_save_dir(run.outputs, run.source.model, method.name)
    if out is not None and method.quantizes:
        writer = CheckpointWriter(
            out,
            source.model,
            run.tokenizer,
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
            run.windows,
            run.evaluation.batch_size,
            run.progress,
            desc=method.name,
            sink=writer,
            hidden_states=run.hidden,
            # a stopped run continues after its last saved layer
            progress_file=None if resume is None else LayerProgress(resume),
        )
        if data is not None:
            result.details["calibration_data"] = data
        if budget is not None:
            result.details["precision_budget"] = budget
        if writer is not None:
            assert result.fingerprint is not None
            t_q = result.quantize_seconds + t_data
            writer.info = saved_info(run.record, run.source_name, t_q, result.details)
            writer.finish(result.fingerprint)
    res = result.perplexity
    details = {
        **result.details,
        "streamed": {
            "stored_dtypes": source.stored_dtypes,
            "per_layer": result.per_layer,
            "peak_memory": peak_memory(run.device),
        },
        "perplexity": None if res is None else res.to_dict(),
        "data_seconds": t_data,
    }
    if "calibration_seconds" in details:
        details["calibration_seconds"]["data"] = t_data
    del source
    gc.collect()
    return result, details, None if writer is None else writer.out


def _finish_save(run: _Streamed, name: str, written: Path, seconds: float) -> dict[str, Any]:
    """What ``--save-dir`` holds of a method: torq's checkpoint written part by part, or
    for compressed-tensors that checkpoint exported layer by layer, then removed."""
    saved_at = written
    how = "part by part, as the layers were quantized"
    if run.outputs.save_format == "compressed-tensors":
        from torq.export.compressed_tensors import export_saved_compressed_tensors

        t_export = time.perf_counter()
        saved_at = export_saved_compressed_tensors(
            written, saved_model_dir(run.outputs, run.source.model, name), overwrite=True
        )
        shutil.rmtree(written)
        seconds += time.perf_counter() - t_export
        how += ", then exported layer by layer"
    return {
        "path": str(saved_at),
        "format": run.outputs.save_format,
        "bytes": sum(f.stat().st_size for f in saved_at.iterdir() if f.is_file()),
        "seconds": seconds,
        "written": how,
    }


def _saved_zeroshot(
    run: _Streamed, folder: Path, details: dict[str, Any], resume: Path | None
) -> dict[str, Any]:
    """The zero-shot tasks of a method on the checkpoint it saved, loaded whole (packed with
    ``--packed``; its layers offloaded to a folder in the run's scratch folder when given)
    and freed after."""
    scratch = run.scratch
    offload = None if scratch is None else Path(tempfile.mkdtemp(prefix="layers-", dir=scratch))
    try:
        model, tokenizer, manifest = load_quantized(
            folder, device=run.source.device, packed=run.evaluation.packed, offload_dir=offload
        )
        row = _zeroshot(
            run.zeroshot, run.source.data_dir, model, tokenizer, run.progress, details, resume
        )
        del model
    finally:
        gc.collect()
        if offload is not None:
            shutil.rmtree(offload, ignore_errors=True)
    details["zeroshot_model"] = {"loaded_from": str(folder), **manifest.get("load", {})}
    return row


def _zeroshot(
    plan: TaskPlan,
    data_dir: str | None,
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
        list(plan.tasks),
        data_dir=data_dir,
        limit=plan.task_limit,
        subset=plan.task_subset,
        subset_seed=plan.task_subset_seed,
        batch_size=plan.task_batch_size,
        shared_context=plan.shared_context,
        progress=progress,
        store=None if resume is None else FolderStore(resume),
    )
    details["lm_eval"] = zs["lm_eval"]
    keys = ("seconds", "limit", "subset", "shared_context", "request_cache")
    return {**zs["scores"], **{k: zs[k] for k in keys}}


__all__ = ["AUTO_HIDDEN_MEMORY_BYTES", "HIDDEN_MODES", "hidden_states_mode", "run"]
