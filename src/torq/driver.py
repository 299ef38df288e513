"""The layer-streaming driver: quantize and evaluate a model one decoder layer at a time.

For a method's :class:`~torq.methods.registry.LayerPlan` and a
:class:`~torq.models.streaming.LayerSource`:

1. the calibration windows (when the method calibrates) and the evaluation windows are
   embedded (the input embedding loaded, used, freed);
2. for each decoder layer ``l``: the float layer is loaded; the statistics of its input
   groups are captured on the calibration hidden states (Algorithm 3's capture, with the
   Hessian for GPTQ); the method quantizes it in place; the calibration hidden states move
   on through the float layer's outputs, or the quantized layer's with ``sequential``; the
   evaluation hidden states move on through the quantized layer; the layer is freed;
3. the final norm and lm_head score the evaluation hidden states: WikiText-2 perplexity,
   as GPTQ's and QuaRot's layer-wise evaluation scripts compute it.

Peak memory is one decoder layer in float32 (and its quantized copy), the hidden states of
the calibration and evaluation windows (float32, as the layers compute), the statistics of
one layer, and the larger of the embedding and the head: never the whole model. The
arithmetic is the whole-model path's, step for step (the same layers, keyword arguments,
capture and loss), so the two give the same numbers bit for bit on a CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from torq.calibration.capture import LayerSolver, capture_layer, layer_outputs
from torq.calibration.data import CalibrationConfig
from torq.eval.perplexity import PerplexityResult, perplexity_from_nll, window_nll
from torq.methods.registry import LayerPlan
from torq.models.streaming import (
    LayerSource,
    ModelLayers,
    embed_windows,
    give_back_memory,
    head_logits,
)


@dataclass
class StreamedRun:
    """What one method's streamed pass produced."""

    details: dict[str, Any]
    quantize_seconds: float
    perplexity: PerplexityResult | None
    per_layer: list[dict[str, float]] = field(default_factory=list)


@torch.no_grad()
def run_layerwise(
    source: LayerSource,
    plan: LayerPlan,
    calibration_windows: torch.Tensor | None,
    eval_windows: torch.Tensor | None,
    batch_size: int = 1,
    progress: bool = True,
    desc: str = "layers",
) -> StreamedRun:
    """Quantize with ``plan`` and evaluate, one layer of ``source`` at a time (module doc):
    the paper's Algorithm 3 per layer (capture, transform, fuse, quantize), then the
    WikiText-2 perplexity of ``eval_windows`` (method-notes §3) from the quantized layers.
    Either set of windows may be absent (no calibration; no evaluation)."""
    if plan.calibration is not None and calibration_windows is None:
        raise ValueError("the method calibrates: calibration windows are needed")
    t_quant = t_eval = t_fwd = t_solve = 0.0
    calib: list[torch.Tensor] | None = None
    calib_kwargs: list[dict[str, Any]] = []
    if plan.calibration is not None:
        assert calibration_windows is not None
        t0 = time.perf_counter()
        calib, calib_kwargs = embed_windows(source, calibration_windows)
        t_fwd += time.perf_counter() - t0
    hidden: list[torch.Tensor] | None = None
    eval_kwargs: list[dict[str, Any]] = []
    if eval_windows is not None:
        t0 = time.perf_counter()
        hidden, eval_kwargs = embed_windows(source, eval_windows, batch_size)
        t_eval += time.perf_counter() - t0
    records: list[dict[str, Any]] = []
    per_layer: list[dict[str, float]] = []
    # kept in memory (on the model's device) in the layers' float32, for exact arithmetic;
    # recorded so that a run's memory can be read off its record
    held = {
        "where": f"{source.device.type} memory, float32",
        "calibration_bytes": sum(h.numel() * h.element_size() for h in calib or []),
        "evaluation_bytes": sum(h.numel() * h.element_size() for h in hidden or []),
    }
    bar = tqdm(total=source.num_layers, desc=desc, unit="layer", disable=not progress, leave=False)
    for li in range(source.num_layers):
        t0 = time.perf_counter()
        layer = source.load_layer(li)
        load = time.perf_counter() - t0
        fwd = solve = 0.0
        groups, stats = [], {}
        outputs: list[torch.Tensor] = []
        if calib is not None:
            assert plan.calibration is not None
            t0 = time.perf_counter()
            groups, stats, outputs = capture_layer(
                li,
                layer,
                calib,
                calib_kwargs[li],
                plan.block_size,
                plan.reservoir,
                plan.calibration.seed,
                plan.hessian,
                keep_outputs=not plan.sequential,
            )
            fwd += time.perf_counter() - t0
        t0 = time.perf_counter()
        record = plan.quantize(li, layer, groups, stats) if plan.quantize is not None else {}
        solve = time.perf_counter() - t0
        del stats
        if calib is not None:
            if plan.sequential:
                t0 = time.perf_counter()
                outputs = layer_outputs(layer, calib, calib_kwargs[li])
                fwd += time.perf_counter() - t0
            calib = outputs
        ev = 0.0
        if hidden is not None:
            t0 = time.perf_counter()
            hidden = layer_outputs(layer, hidden, eval_kwargs[li])
            ev = time.perf_counter() - t0
        source.release_layer(li)
        del layer
        give_back_memory()
        t_fwd += fwd
        t_solve += solve
        t_eval += ev
        t_quant += load
        per_layer.append(
            {
                "load_seconds": load,
                "forward_seconds": fwd,
                "solve_seconds": solve,
                "eval_seconds": ev,
            }
        )
        if plan.calibration is not None or plan.quantize is not None:
            records.append({"layer": li, "groups": [g.__dict__ for g in groups], **record})
        bar.update(1)
    bar.close()
    t_quant += t_fwd + t_solve
    result = None
    if hidden is not None:
        assert eval_windows is not None
        t0 = time.perf_counter()
        source.load_head()
        try:
            total = 0.0
            for bi, h in enumerate(hidden):
                first = bi * batch_size
                batch = eval_windows[first : first + h.shape[0]].to(source.device)
                total += sum(window_nll(head_logits(source, h), batch, first))
        finally:
            source.release_head()
            give_back_memory()
        t_eval += time.perf_counter() - t0
        result = perplexity_from_nll(
            total, int(eval_windows.shape[0]), int(eval_windows.shape[1]), t_eval
        )
    details: dict[str, Any] = {**plan.record, "hidden_states": held}
    if plan.calibration is not None:
        details["calibration"] = plan.calibration.to_dict() | {"sequential": plan.sequential}
        details["calibration_seconds"] = {"capture_forward": t_fwd, "solve": t_solve}
    if plan.calibration is not None:
        details["layers"] = records
    elif records:
        # layers quantized without data: what was replaced, in total
        totals: dict[str, int] = {}
        for rec in records:
            for k, n in rec.get("replaced", {}).items():
                totals[k] = totals.get(k, 0) + n
        details["replaced"] = totals
    return StreamedRun(details, t_quant, result, per_layer)


@dataclass
class CaptureTimes:
    forward_seconds: float = 0.0
    solve_seconds: float = 0.0
    per_layer: list[dict[str, float]] = field(default_factory=list)


def calibrate_layerwise(
    model: nn.Module,
    windows: torch.Tensor,
    solve_layer: LayerSolver,
    block_size: int = 32,
    reservoir: int = 2048,
    sequential: bool = False,
    seed: int = 0,
    progress: bool = True,
    hessian: bool = False,
) -> tuple[list[dict[str, Any]], CaptureTimes]:
    """:func:`run_layerwise` on a model in memory with given calibration ``windows`` and a
    ``solve_layer(index, layer, groups, stats)`` callback (for experiments: the methods
    run through their :class:`~torq.methods.registry.LayerPlan`). The model is quantized
    in place; returns each layer's record and the capture and solve times."""
    calibration = CalibrationConfig(
        n_samples=int(windows.shape[0]), seqlen=int(windows.shape[1]), seed=seed
    )
    plan = LayerPlan(solve_layer, calibration, block_size, reservoir, sequential, hessian)
    run = run_layerwise(ModelLayers(model), plan, windows, None, progress=progress)
    seconds = run.details["calibration_seconds"]
    times = CaptureTimes(
        seconds["capture_forward"],
        seconds["solve"],
        [
            {"forward_seconds": p["forward_seconds"], "solve_seconds": p["solve_seconds"]}
            for p in run.per_layer
        ],
    )
    return run.details["layers"], times
