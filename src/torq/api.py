"""torq's Python API: quantize a model with a recipe, save it, load it, evaluate it.

    import torq

    model = torq.quantize("smollm2-135m", recipe="default", calib_samples=32)
    torq.save(model, "smollm2-mxfp4")            # compressed-tensors: transformers loads it
    print(torq.evaluate(model, max_windows=16)["ppl"])
    again = torq.load("smollm2-mxfp4")           # either kind of saved folder, or a float model

:func:`quantize` holds the whole model in memory (a model object, or a checkpoint read
whole); :func:`quantize_checkpoint` streams a checkpoint of any size one decoder layer at
a time and writes the quantized folder as it goes (``torq quantize``).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.data import load_eval_text
from torq.driver import apply_method
from torq.driver.budget import PrecisionBudget, check_budget
from torq.errors import TorqError
from torq.eval.perplexity import perplexity, windows_from_text
from torq.export import save_quantized
from torq.export.compressed_tensors import (
    QUANTIZE_RECORD,
    experts_unserved,
    export_compressed_tensors,
)
from torq.export.loading import load_model
from torq.export.model_card import guarded, write_model_card
from torq.formats import FORMAT_NAMES
from torq.formats.config import run_scale_mode, side_scale_modes
from torq.kernels.accelerate import AccelerateReport
from torq.kernels.accelerate import accelerate as accelerate_layers
from torq.methods.recipes import DEFAULT_RECIPE, Recipe, get_recipe
from torq.models.architecture import layer_linear_names, served_unrotated
from torq.models.loading import model_folder
from torq.models.streaming import LayerStream
from torq.paths import check_destination
from torq.pipeline import run
from torq.results import write_record
from torq.runs.config import RunConfig
from torq.runs.source import saved_model_dir
from torq.runs.store import setting_digest
from torq.surgery.qlinear import ignored

SAVE_FORMATS = ("compressed-tensors", "torq")


@dataclass
class Quantized:
    """What :func:`quantize` attaches to the model it returns (``model.torq``): the
    recipe, the tokenizer (for :func:`save` and :func:`evaluate`) and the run's record."""

    recipe: Recipe
    tokenizer: Any
    record: dict[str, Any]
    format: str


def _format(fmt: str) -> str:
    if fmt not in FORMAT_NAMES:
        raise TorqError(f"unknown format '{fmt}'; choose from {', '.join(FORMAT_NAMES)}")
    return fmt


def quantize(
    model: str | Path | nn.Module,
    recipe: str = DEFAULT_RECIPE,
    *,
    format: str = "mxfp4",
    calibration: str = "wikitext2-valid",
    calib_samples: int = 128,
    calib_seqlen: int = 2048,
    tokenizer: Any = None,
    data_dir: str | None = None,
    seed: int = 0,
    progress: bool = True,
    rotate_biased: bool = False,
    ignore: tuple[str, ...] | list[str] = (),
    avg_bits: float | None = None,
    budget_by: str = "block",
    budget_windows: int = 16,
) -> nn.Module:
    """Quantize ``model`` (a Hugging Face causal LM, or a name or path :func:`load` reads)
    to W4A4 ``format`` with ``recipe`` (:data:`torq.methods.recipes.RECIPES`), calibrating
    on ``calib_samples`` windows of ``calibration`` (a corpus name or a text file). The model
    is quantized in place and returned, with ``model.torq`` (:class:`Quantized`).
    ``rotate_biased``: rotate the inputs of linears with a bias too, which the servable
    recipes leave unrotated so that vLLM can load the model (Qwen2's q/k/v); they leave MoE
    experts' inputs unrotated too, for transformers and vLLM alike. ``ignore``:
    linears kept in float, by name pattern (``torq quantize --ignore``). ``avg_bits``: a
    precision budget, the average stored bits per weight of the quantized linears, the input
    groups that hurt most kept in MXFP8 (``--avg-bits``; ``budget_by``, ``budget_windows``:
    ``--budget-by``, ``--budget-windows``)."""
    fmt = _format(format)
    chosen = get_recipe(recipe, fmt)
    calib = CalibrationConfig(
        corpus=calibration, n_samples=calib_samples, seqlen=calib_seqlen, seed=seed
    )
    if isinstance(model, nn.Module):
        if tokenizer is None and chosen.calibrates:
            raise TorqError(f"recipe '{chosen.name}' calibrates: pass the model's tokenizer=")
    else:
        loaded = load_model(str(model))
        if loaded.quantized is not None:
            raise TorqError(f"{model} is already quantized: quantize the float model")
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
    spec = chosen.spec(unrotated=served_unrotated(model, rotate_biased))
    ctx = spec.context(
        chosen.capture(calib), tokenizer, data_dir=data_dir, progress=progress, seed=seed
    )
    t0 = time.perf_counter()
    qconfig = replace(chosen.quant_config(fmt), ignore=tuple(ignore))
    _check_ignore(model, qconfig.ignore)
    budget = (
        None if avg_bits is None else PrecisionBudget(avg_bits, budget_by, budget_windows, seed)
    )
    check_budget(budget, qconfig)
    record = apply_method(spec.method, model, qconfig, ctx, budget)
    record["seconds"] = time.perf_counter() - t0
    model.torq = Quantized(chosen, tokenizer, record, fmt)  # type: ignore[assignment]
    return model


def save(
    model: nn.Module,
    out: str | Path,
    format: str = "compressed-tensors",
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write a model :func:`quantize` returned to the folder ``out``: ``compressed-tensors``
    (transformers and vLLM load it; the default) or ``torq`` (torq's own checkpoint, for
    every method). The folder appears complete or not at all."""
    if format not in SAVE_FORMATS:
        raise TorqError(f"unknown save format '{format}'; choose from {', '.join(SAVE_FORMATS)}")
    info: Quantized | None = getattr(model, "torq", None)
    tokenizer = tokenizer or (info.tokenizer if info is not None else None)
    _check_out(out, overwrite, "the output folder")
    if format == "compressed-tensors":
        if info is not None:
            reason = info.recipe.cannot_serve(info.format)
            if reason is not None:
                raise TorqError(f"{reason}: save it with format='torq'")
        return export_compressed_tensors(model, Path(out), tokenizer, overwrite=overwrite)
    method = info.recipe.method if info is not None else None
    return save_quantized(model, out, tokenizer, method=method, overwrite=overwrite)


def load(path: str | Path, packed: bool = False) -> nn.Module:
    """A model from ``path``: a compressed-tensors folder (through transformers, its online
    transforms attached), a folder torq saved (``packed``: MXFP4 weights kept packed), or a
    float model (an embedded name, a Hugging Face folder or a ``.gguf`` file), with its
    tokenizer as ``model.tokenizer``."""
    loaded = load_model(str(path), packed=packed)
    loaded.model.tokenizer = loaded.tokenizer
    return loaded.model


def accelerate(model: nn.Module, backend: str = "auto", share: bool = True) -> AccelerateReport:
    """Run ``model``'s MXFP4 W4A4 layers on torq's packed kernels, in place: the Triton
    kernels on a CUDA GPU, the same arithmetic in float32 elsewhere
    (:func:`torq.kernels.accelerate.accelerate`; ``share``: layers that read one input as
    one product). Returns what was swapped and, for each layer kept as it was, why
    (``report.summary()``: one line)."""
    if backend not in ("auto", "triton", "reference"):
        raise TorqError(f"unknown backend '{backend}' (use auto, triton or reference)")
    return accelerate_layers(model, backend, share)  # type: ignore[arg-type]


def generate(
    model: nn.Module,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    tokenizer: Any = None,
    cuda_graph: bool = False,
    compiled: bool = False,
) -> dict[str, Any]:
    """Greedy text from ``model`` (on its device) after ``prompt``, with transformers'
    ``generate``, or step by step over a static cache
    (:func:`torq.models.decoding.greedy_decode`): with ``cuda_graph`` one decoding step
    captured as a CUDA graph and replayed for each token (a GPU only), with ``compiled`` the
    step through ``torch.compile`` as one graph (torq's products as operators,
    :mod:`torq.kernels.ops`), or both: ``{"text", "new_tokens", "seconds", "tokens_per_s",
    "prefill_seconds", "decode_tokens_per_s"}``. ``seconds`` is the whole call;
    ``prefill_seconds`` runs until the first new token (the prompt's forward, and the
    compilation and the capture), and ``decode_tokens_per_s`` counts the tokens after it
    over the time after it (``None`` with fewer than two new tokens)."""
    from torq.models.decoding import timed_generate

    if max_new_tokens < 1:
        raise TorqError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    if cuda_graph and device.type != "cuda":
        raise TorqError(f"a CUDA graph needs the model on a CUDA device; it is on {device}")
    tokenizer = tokenizer or _tokenizer_of(model)
    return timed_generate(model, tokenizer, prompt, max_new_tokens, cuda_graph, compiled)


def evaluate(
    model: nn.Module,
    tokenizer: Any = None,
    *,
    max_windows: int | None = None,
    seqlen: int = 2048,
    corpus: str = "wikitext2-test",
    tasks: list[str] | None = None,
    task_limit: int | None = None,
    data_dir: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity on ``corpus`` (WikiText-2's test text, its first ``max_windows`` windows
    of ``seqlen`` tokens; the paper's protocol) and, with ``tasks``, the zero-shot accuracies
    (lm-eval); ``{"ppl", "windows", "tasks"}``."""
    tokenizer = tokenizer or _tokenizer_of(model)
    windows = windows_from_text(load_eval_text(corpus, data_dir), tokenizer, seqlen, max_windows)
    result: dict[str, Any] = {
        "ppl": perplexity(model, windows, progress=progress).ppl,
        "windows": int(windows.shape[0]),
        "tasks": None,
    }
    if tasks:
        from torq.eval.zeroshot import evaluate_zeroshot

        scores = evaluate_zeroshot(
            model, tokenizer, tasks, data_dir, limit=task_limit, progress=progress
        )
        result["tasks"] = scores["scores"]
    return result


def _check_out(out: str | Path, overwrite: bool, what: str) -> None:
    """Refuse, before any work, a destination that is a file, cannot be written, or holds
    something already (unless ``overwrite``)."""
    check_destination(out, folder=True, what=what)
    if not overwrite and Path(out).is_dir() and any(Path(out).iterdir()):
        raise TorqError(
            f"{what} {out} is not empty: choose a new folder, or replace it (--overwrite, "
            "overwrite=True)"
        )


def _tokenizer_of(model: nn.Module) -> Any:
    info = getattr(model, "torq", None)
    tokenizer = info.tokenizer if info is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise TorqError("pass the model's tokenizer= (the model has none attached)")
    return tokenizer


def _check_ignore(model: nn.Module, patterns: tuple[str, ...]) -> None:
    """Refuse an ``--ignore`` pattern that matches no linear of ``model``'s decoder layers
    (a misspelt name would otherwise keep nothing in float, silently)."""
    names = layer_linear_names(model)
    for pattern in patterns:
        if not any(ignored(n, (pattern,)) for n in names):
            some = ", ".join(sorted({n.split(".", 2)[2] for n in names})[:8])
            raise TorqError(
                f"--ignore '{pattern}' matches no linear of the model's decoder layers "
                f"(named layers.<i>.NAME; NAME: {some})"
            )


def _skeleton(model: str, gguf_dtype: str = "float32") -> nn.Module:
    """The float checkpoint ``model``'s modules, no weights (its layer stream's skeleton;
    a GGUF file converted as the run will convert it, ``gguf_dtype``)."""
    return LayerStream(model_folder(str(model), gguf_dtype)[0]).model


def _write_card(
    out: Path,
    model: str,
    recipe: Recipe,
    fmt: str,
    save_format: str,
    calibration: dict[str, Any],
    record: dict[str, Any],
) -> None:
    """The model card of a folder :func:`quantize_checkpoint` wrote, from its run record."""
    facts = {"model": model, "recipe": recipe.name, "method": recipe.method, "format": fmt}
    facts |= {"save_format": save_format, "calibration": calibration, "guarded": guarded(out)}
    facts |= {k: record[k] for k in ("command", "date", "versions")}
    facts["precision_budget"] = record["rows"][0]["details"].get("precision_budget")
    write_model_card(out, {**facts, "machine": record["machine"]["cpu"]})


def _save_format(
    recipe: Recipe, fmt: str, asked: str | None, skeleton: nn.Module
) -> tuple[str, str | None]:
    """The folder's format: ``asked``, or compressed-tensors where the recipe, the format and
    the model can be served, else torq's; and why compressed-tensors cannot hold it (asking
    it of what it cannot hold is refused)."""
    recipe_reason = recipe.cannot_serve(fmt)
    reason = recipe_reason or experts_unserved(skeleton, fmt)
    if asked is None:
        return ("torq" if reason else "compressed-tensors"), reason
    if asked not in SAVE_FORMATS:
        raise TorqError(f"unknown save format '{asked}'; choose from {', '.join(SAVE_FORMATS)}")
    if asked == "compressed-tensors" and recipe_reason:
        other = "" if fmt not in ("mxfp4", "nvfp4") else ", or use --recipe default"
        raise TorqError(f"{recipe_reason}: write it with --save-format torq{other}")
    if asked == "compressed-tensors" and reason:  # the experts' reason names the way out
        raise TorqError(reason)
    return asked, reason


def quantize_checkpoint(
    model: str,
    out: str | Path,
    recipe: str = DEFAULT_RECIPE,
    *,
    format: str = "mxfp4",
    save_format: str | None = None,
    calibration: str = "wikitext2-valid",
    calib_samples: int = 128,
    calib_seqlen: int = 2048,
    data_dir: str | None = None,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    device: str = "cpu",
    calib_arithmetic: str = "exact",
    rotate_biased: bool = False,
    ignore: tuple[str, ...] | list[str] = (),
    avg_bits: float | None = None,
    budget_by: str = "block",
    budget_windows: int = 16,
) -> dict[str, Any]:
    """Quantize the float checkpoint ``model`` (any size: read one decoder layer at a time)
    with ``recipe`` and write it to ``out``: compressed-tensors when the recipe, the format
    and the model (fused MoE experts have no form there) can be served, else torq's
    checkpoint (``save_format`` forces one; asking compressed-tensors of what it cannot hold
    is refused before any work). ``device``: where each layer calibrates (``cpu``,
    ``cuda``, ``cuda:N`` or ``auto``); ``calib_arithmetic``: ``exact`` or ``tf32``
    (:func:`torq.calibration.capture.calibration_arithmetic`); ``rotate_biased``,
    ``ignore``, ``avg_bits``, ``budget_by`` and ``budget_windows``: as for
    :func:`quantize`; a stopped call goes on, called again with the same arguments, from its
    last finished layer. Returns
    ``{"path", "format", "why_format", "bytes", "seconds", "recipe", "method", "unrotated",
    "record"}`` (``why_format``: why torq's format, where it was chosen for the caller;
    ``unrotated``: the names whose groups got no rotation, linears with a bias and MoE
    ``experts``)."""
    fmt = _format(format)
    chosen = get_recipe(recipe, fmt)
    skeleton = _skeleton(model)
    chosen_for_you = save_format is None
    save_format, reason = _save_format(chosen, fmt, save_format, skeleton)
    out = Path(out)
    _check_out(out, overwrite, "--out")
    qconfig = replace(chosen.quant_config(fmt), ignore=tuple(ignore))
    _check_ignore(skeleton, qconfig.ignore)
    if avg_bits is not None:
        check_budget(PrecisionBudget(avg_bits, budget_by), qconfig)
    # only a compressed-tensors folder is for the engines: torq's format keeps every group
    # rotated
    served = save_format == "compressed-tensors"
    spec = chosen.spec(unrotated=served_unrotated(skeleton, rotate_biased) if served else ())
    config = RunConfig.of(
        model=str(model),
        methods=[spec],
        weight_format=fmt,
        act_format=fmt,
        scale_mode=run_scale_mode(qconfig.weight.scale_mode, qconfig.activation.scale_mode),
        act_scale="static" if qconfig.static_activations else "dynamic",
        ignore=qconfig.ignore,
        avg_bits=avg_bits,
        budget_by=budget_by,
        budget_windows=budget_windows,
        data_dir=data_dir,
        seed=seed,
        capture=replace(
            chosen.capture(
                CalibrationConfig(
                    corpus=calibration, n_samples=calib_samples, seqlen=calib_seqlen, seed=seed
                )
            ),
            arithmetic=calib_arithmetic,
        ),
        skip_ppl=True,
        save_format=save_format,
        device=device,
    )
    # written beside ``out`` and moved into place when whole: a stop leaves no half folder,
    # and the same command again goes on from the last finished layer (its progress and
    # the layers written so far wait there, under the digest of the run's settings)
    staging = out.with_name(f".{out.name}.partial")
    kept = staging / setting_digest(config.record(), chosen.method)
    config = config.replace(save_dir=str(kept / "model"), resume_dir=str(kept / "progress"))
    t0 = time.perf_counter()
    record = run(config, progress=progress)
    written = saved_model_dir(config.outputs, str(model), chosen.method)
    if out.exists():
        shutil.rmtree(out)
    written.rename(out)
    shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    (out / QUANTIZE_RECORD).write_text(
        json.dumps(
            {"recipe": chosen.name, "method": chosen.method, "format": fmt, "record": record},
            indent=1,
            default=str,
        )
    )
    calib = {"corpus": calibration, "samples": calib_samples, "seqlen": calib_seqlen, "seed": seed}
    _write_card(out, str(model), chosen, fmt, save_format, calib, record)
    return {
        "path": str(out),
        "format": save_format,
        # why torq's format where compressed-tensors was not asked for and cannot hold it
        "why_format": reason if chosen_for_you and save_format == "torq" else None,
        "bytes": size,
        "seconds": time.perf_counter() - t0,
        "recipe": chosen.name,
        "method": chosen.method,
        # the groups the recipe left unrotated (a linear's bias: vLLM; MoE experts: both)
        "unrotated": getattr(spec.settings, "unrotated", None),
        "record": record,
    }


def compare(
    model: str,
    methods: list[str] | None = None,
    settings: tuple[Any, ...] = (),
    *,
    capture: CaptureSettings | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Quantize ``model`` with each of ``methods`` and evaluate every one on the same
    windows (``torq run`` / ``torq eval``); the run's record (rows, table, provenance).

    ``settings`` are settings values (:class:`~torq.methods.settings.TorqSettings`,
    :class:`~torq.surgery.gptq.GPTQConfig`…): each method takes those of its own types
    (:func:`~torq.methods.registry.method_spec`). ``capture`` is the calibration every
    calibrating method reads; ``options`` are :class:`~torq.runs.config.RunConfig`'s other
    fields (formats, windows, tasks, folders). Without ``methods``: a folder torq saved is
    evaluated as it is, a float model is compared with the ``default`` recipe (its method,
    its balancing folded and its scale rule in the format unless ``scale_mode`` is given).
    With ``out`` the record is written there (and its table beside it, ``.md``) after each
    method."""
    from torq.methods.recipes import DEFAULT_RECIPE, get_recipe
    from torq.methods.registry import method_specs
    from torq.runs.report import markdown_table
    from torq.runs.source import saved_formats, saved_manifest

    saved = saved_manifest(model)
    if methods is None and saved:  # a folder torq wrote: the method it holds, as it is
        methods = [saved.get("method") or "saved"]
    elif methods is None:  # a float model: FP and the default recipe, with its settings
        recipe = get_recipe(DEFAULT_RECIPE)
        skeleton = _skeleton(model, options.get("gguf_dtype", "float32"))
        methods = ["fp", recipe.spec(*settings, unrotated=served_unrotated(skeleton))]
        w, a = options.get("weight_format", "mxfp4"), options.get("act_format", "mxfp4")
        mode = recipe.scale_mode_in(w or a or "mxfp4")
        if set(side_scale_modes(w, a, mode)) - {None, "ocp"}:  # a rule these formats take
            options.setdefault("scale_mode", mode)
    formats = None if saved is None else saved_formats(saved)
    given = [f for f in ("weight_format", "act_format", "scale_mode") if f in options]
    weight = options.get("weight_format", "mxfp4")
    act = options.get("act_format", "mxfp4")
    scale_mode = options.get("scale_mode", "ocp")
    # the rule the formats take from it (saved_formats reports the same way)
    asked = (weight, act, run_scale_mode(*side_scale_modes(weight, act, scale_mode)))
    if given and formats is not None and formats != asked:
        sw, sa, smode = formats
        raise TorqError(
            f"{model} was saved quantized with weights {sw or 'float'}, activations "
            f"{sa or 'float'}, scale rule {smode}; its formats cannot be changed (asked: "
            f"{asked[0] or 'float'}, {asked[1] or 'float'}, {asked[2]}). Drop --format, "
            "--w-format, --a-format and --scale-mode (weight_format=, act_format=, "
            "scale_mode=), or quantize the float model again with them."
        )
    if options.get("act_scale", "dynamic") == "static":
        if saved is not None:
            raise TorqError(
                f"{model} was saved quantized: it keeps its own activation scales; "
                "drop --act-scale, or quantize the float model again with it"
            )
        if (act or "none").lower() != "nvfp4":
            raise TorqError(
                "--act-scale static is NVFP4's static activation tensor scale: add "
                f"--a-format nvfp4 (activations here: {act or 'none'})"
            )
    config = RunConfig.of(
        model=model,
        # a saved model's method is evaluated as it is; a float model's methods each take
        # their own settings from ``settings``
        methods=list(methods) if saved is not None else method_specs(methods, *settings),
        capture=capture or CaptureSettings(),
        **options,
    )
    path = None if out is None else Path(out)
    if path is not None:
        check_destination(path, folder=False, what="--out")

    def write(record: dict[str, Any]) -> None:
        record["table"] = markdown_table(record)
        if path is None:
            return
        write_record(path, record)
        status = "" if record["complete"] else "\n\n(partial: not every method has run yet)"
        path.with_suffix(".md").write_text(f"`{record['command']}`\n\n{record['table']}{status}\n")

    record = run(config, progress=progress, on_row=write)
    write(record)
    return record
