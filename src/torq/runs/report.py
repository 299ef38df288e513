"""What a run reports: one row per method, the whole record (with the command, machine
and versions) and its markdown table."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torq.eval.perplexity import paired_log_ratio
from torq.models.loading import LoadedModel
from torq.results import command_line, machine_info, now_iso, versions
from torq.runs.config import resolve_device
from torq.runs.store import eval_dataset_label
from torq.surgery.qlinear import QuantConfig


@dataclass
class MethodRow:
    """One method's row of a run: its formats, perplexity, the cost of quantizing and
    evaluating, and what the method and the evaluation report (``details``)."""

    method: str
    weights: str
    activations: str
    ppl: float | None
    quantize_seconds: float
    eval_seconds: float
    eval_tokens_per_s: float
    details: dict[str, Any] = field(default_factory=dict)
    zeroshot: dict[str, Any] | None = None  # headline scores (acc_norm / acc) and average


def peak_memory(device: torch.device | None = None) -> dict[str, int]:
    """The process's peak resident set so far (bytes) and, on a GPU, its peak allocation."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"host_rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
    if device is not None and device.type == "cuda":
        out["gpu_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def run_record(
    settings: dict[str, Any],
    qconfig: QuantConfig,
    loaded: LoadedModel,
    windows: torch.Tensor | None,
    rows: list[MethodRow],
    t_start: float,
    complete: bool,
    window_sample: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result record of a run (``torq run --out``): its settings (``settings``, as
    :meth:`~torq.runs.config.RunConfig.record` gives them) and command, the model,
    the evaluation's windows (``window_sample``: which of the test's windows a seeded
    sample took) and tasks, one row per method done so far (``complete`` once every method
    has run), time, memory, versions and machine."""
    return {
        "kind": "torq.run",
        "complete": complete,
        "date": now_iso(),
        "command": command_line(),
        "config": settings,
        "quant_config": qconfig.to_dict(),
        "model": loaded.describe(),
        "eval": {
            "dataset": eval_dataset_label(settings["eval_corpus"]),
            "n_windows": 0 if windows is None else int(windows.shape[0]),
            "window_sample": window_sample,
            "seqlen": settings["seqlen"],
            "zeroshot_tasks": list(settings["tasks"]),
            "zeroshot_limit": settings["task_limit"],
            "zeroshot_subset": None
            if settings["task_subset"] is None
            else {"n": settings["task_subset"], "seed": settings["task_subset_seed"]},
        },
        "rows": [asdict(r) for r in rows],
        "wall_seconds": time.perf_counter() - t_start,
        "peak_memory": peak_memory(resolve_device(settings["device"])),
        "versions": versions(),
        "machine": machine_info(),
    }


def _sampled_ratio(fp_row: dict[str, Any], row: dict[str, Any], seqlen: int, total: int) -> str:
    """A row's ×FP on a window sample: the whole test's ratio estimated window by window,
    with its 95 % interval (:func:`torq.eval.perplexity.paired_log_ratio`)."""
    a = (fp_row["details"].get("perplexity") or {}).get("window_nll") or []
    b = (row["details"].get("perplexity") or {}).get("window_nll") or []
    if not a or len(a) != len(b) or len(a) < 2:
        return f"{row['ppl'] / fp_row['ppl']:.2f}"
    est = paired_log_ratio(a, b, seqlen, total)
    return f"{est.ratio:.3f} ({est.low:.3f}–{est.high:.3f})"


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
        fp_row = next((r for r in rows if r["method"] == "fp" and r["ppl"] is not None), None)
        sample = result["eval"].get("window_sample")
        for r in rows:
            ratio = f"{r['ppl'] / fp:.2f}" if fp else "–"
            if sample and fp_row is not None and r is not fp_row:
                ratio = _sampled_ratio(fp_row, r, result["eval"]["seqlen"], sample["of"])
            out.append(
                f"| {r['method']} | {r['weights']} | {r['activations']} | {r['ppl']:.2f} | "
                f"{ratio} | {r['quantize_seconds']:.1f} | {r['eval_tokens_per_s']:.0f} |"
            )
    ev = result["eval"]
    out.append("")
    notes = []
    if ev["n_windows"]:
        sample = ev.get("window_sample")
        drawn = "" if not sample else f" drawn at random (seed {sample['seed']}) of {sample['of']}"
        notes.append(f"{ev['dataset']}, {ev['n_windows']} windows{drawn} × {ev['seqlen']} tokens")
        if sample:
            notes.append("×FP: the whole test's ratio estimated window by window (95 % interval)")
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
    out.append("; ".join(notes) + f"; model {result['config']['model']}.")
    return "\n".join(out)
