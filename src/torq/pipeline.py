"""The end-to-end job behind ``torq run``: load → quantize with each method → evaluate.

The data flow is one way: the float model is loaded once, each method gets its own copy,
quantizes it, and the copy is evaluated on the same perplexity windows as every other
method, so the rows of the table are directly comparable.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torq.errors import TorqError
from torq.eval.data import load_wikitext2_test
from torq.eval.perplexity import perplexity, windows_from_text
from torq.methods.registry import MethodContext, get_method
from torq.methods.torq_rotation import TorqSettings
from torq.models.loading import LoadedModel, load
from torq.results import command_line, machine_info, now_iso, versions
from torq.surgery.qlinear import QuantConfig


@dataclass
class RunConfig:
    """Everything that determines a comparison run; recorded verbatim with its results."""

    model: str = "smollm2-135m"
    methods: list[str] = field(default_factory=lambda: ["fp", "rtn"])
    weight_format: str | None = "mxfp4"
    act_format: str | None = "mxfp4"
    scale_mode: str = "ocp"
    seqlen: int = 2048
    max_windows: int | None = None
    batch_size: int = 1
    data_dir: str | None = None
    seed: int = 0
    torq: TorqSettings = field(default_factory=TorqSettings)

    def quant_config(self) -> QuantConfig:
        return QuantConfig.from_names(self.weight_format, self.act_format, self.scale_mode)


@dataclass
class MethodRow:
    method: str
    weights: str
    activations: str
    ppl: float
    quantize_seconds: float
    eval_seconds: float
    eval_tokens_per_s: float
    details: dict[str, Any] = field(default_factory=dict)


def run(
    config: RunConfig, loaded: LoadedModel | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run every method of ``config`` on the same model and windows; return the result record."""
    if not config.methods:
        raise TorqError("no methods given")
    methods = [get_method(m) for m in config.methods]
    qconfig = config.quant_config()
    t_start = time.perf_counter()
    torch.manual_seed(config.seed)
    if loaded is None:
        loaded = load(config.model)
    text = load_wikitext2_test(config.data_dir)
    windows = windows_from_text(text, loaded.tokenizer, config.seqlen, config.max_windows)

    rows: list[MethodRow] = []
    for method in methods:
        model = loaded.model if not method.quantizes else copy.deepcopy(loaded.model)
        t0 = time.perf_counter()
        ctx = MethodContext(
            tokenizer=loaded.tokenizer,
            options={
                "torq_settings": config.torq,
                "data_dir": config.data_dir,
                "progress": progress,
            },
        )
        details = method.apply(model, qconfig, ctx)
        t_quant = time.perf_counter() - t0
        res = perplexity(model, windows, config.batch_size, progress, desc=method.name)
        rows.append(
            MethodRow(
                method=method.name,
                weights=qconfig.weight.name if method.quantizes and qconfig.weight else "fp",
                activations=qconfig.activation.name
                if method.quantizes and qconfig.activation
                else "fp",
                ppl=res.ppl,
                quantize_seconds=t_quant,
                eval_seconds=res.seconds,
                eval_tokens_per_s=res.tokens_per_s,
                details={**details, "perplexity": res.to_dict()},
            )
        )
        if model is not loaded.model:
            del model
            gc.collect()

    return {
        "kind": "torq.run",
        "date": now_iso(),
        "command": command_line(),
        "config": asdict(config),
        "quant_config": qconfig.to_dict(),
        "model": loaded.describe(),
        "eval": {
            "dataset": "wikitext-2-raw test",
            "n_windows": int(windows.shape[0]),
            "seqlen": int(windows.shape[1]),
        },
        "rows": [asdict(r) for r in rows],
        "wall_seconds": time.perf_counter() - t_start,
        "versions": versions(),
        "machine": machine_info(),
    }


def markdown_table(result: dict[str, Any]) -> str:
    """The comparison table: one row per method, PPL and its ratio to the FP row."""
    rows = result["rows"]
    fp = next((r["ppl"] for r in rows if r["method"] == "fp"), None)
    out = [
        "| method | W | A | PPL | ×FP | quantize s | eval tok/s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = f"{r['ppl'] / fp:.2f}" if fp else "–"
        out.append(
            f"| {r['method']} | {r['weights']} | {r['activations']} | {r['ppl']:.2f} | {ratio} "
            f"| {r['quantize_seconds']:.1f} | {r['eval_tokens_per_s']:.0f} |"
        )
    ev = result["eval"]
    out.append("")
    out.append(
        f"WikiText-2 raw test, {ev['n_windows']} windows × {ev['seqlen']} tokens; "
        f"model {result['config']['model']}."
    )
    return "\n".join(out)
