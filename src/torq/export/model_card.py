"""The model card (``README.md``) of a folder ``torq quantize`` writes: what the model is,
how it was made (the recipe, the calibration, the command, the versions), how to load it,
and the numbers measured on it, one row added by each ``torq eval`` of the folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CARD = "README.md"
_MEASURED = "## Measured on this folder"
_NOTHING_YET = "Nothing yet: `torq eval --model FOLDER --max-windows 16` adds a row here."
_HEAD = "| date | data | windows | PPL | command | machine |"


def _loading(path: str, save_format: str, guarded: bool) -> str:
    """How to load the folder: the code for the tools that read its format."""
    if save_format != "compressed-tensors":
        return (
            "torq's own format (the recipe's transforms have no compressed-tensors form); "
            "torq loads it:\n\n```python\nimport torq\n\n"
            f'model = torq.load("{path}")\n```\n'
        )
    if not guarded:
        remote, note = "", ""
    else:
        remote = ", trust_remote_code=True"
        note = (
            "\nThe linears read their inputs through an online Hadamard transform, which "
            "transformers does not attach by itself: `trust_remote_code=True` runs this "
            "folder's `modeling_torq.py`, which loads the model with transformers and "
            "attaches it (compressed-tensors' `apply_transform_config`). Without it, "
            "`from_pretrained` stops with an error that says so, rather than computing "
            "garbage. lm-eval's `--model hf` reads the quantization config itself and "
            "stops too: `torq eval --model FOLDER --tasks ...` runs lm-eval's tasks on the "
            "loaded model (or give lm-eval's `HFLM` the model `torq.load` returns).\n"
        )
    return (
        "compressed-tensors, for transformers and vLLM:\n\n```python\n"
        "from transformers import AutoModelForCausalLM\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{path}"{remote})\n```\n{note}\n'
        f'torq: `torq.load("{path}")`. vLLM: `vllm serve {path}` (it applies the '
        "transforms itself).\n"
    )


def _budget_line(budget: dict[str, Any] | None) -> list[str]:
    """The card's line for a precision budget (``--avg-bits``), if there was one."""
    if budget is None:
        return []
    kept = sum(1 for g in budget["groups"] if g["high"])
    return [
        f"- precision budget: {kept} of {len(budget['groups'])} input groups in MXFP8 W8A8 "
        f"(chosen by `{budget['by']}`), {budget['reached_bits']:.2f} bits a weight on average"
    ]


def write_model_card(folder: Path, facts: dict[str, Any]) -> Path:
    """Write ``folder``'s card from ``facts``: ``model``, ``recipe``, ``method``,
    ``format``, ``save_format``, ``calibration`` (corpus, samples, seqlen, seed),
    ``command``, ``date``, ``versions``, ``machine``, ``guarded`` (the folder carries
    torq's transformers loader) and ``precision_budget`` (the record's, if any)."""
    calib = facts["calibration"]
    versions = ", ".join(f"{k} {v}" for k, v in facts["versions"].items() if v)
    made = [
        f"- recipe `{facts['recipe']}`: method `{facts['method']}`, "
        f"{facts['format'].upper()} weights and activations (W4A4)",
        *_budget_line(facts.get("precision_budget")),
        f"- calibration: {calib['samples']} windows of {calib['seqlen']} tokens of "
        f"`{calib['corpus']}`, seed {calib['seed']}",
        f"- command: `{facts['command']}`",
        f"- made {facts['date']} on {facts['machine']} with {versions}",
    ]
    text = "\n".join(
        [
            "---",
            "library_name: transformers",
            "tags: [torq, quantized, w4a4, " + facts["format"] + "]",
            "---",
            "",
            f"# {facts['model']}, {facts['format'].upper()} W4A4",
            "",
            f"`{facts['model']}` quantized by torq with the `{facts['recipe']}` recipe: "
            f"weights and activations in {facts['format'].upper()}.",
            "",
            "## Loading",
            "",
            _loading(str(folder), facts["save_format"], facts["guarded"]),
            "## How it was made",
            "",
            *made,
            "",
            _MEASURED,
            "",
            _NOTHING_YET,
            "",
        ]
    )
    path = folder / CARD
    path.write_text(text)
    return path


def add_measurement(folder: str | Path, row: dict[str, Any]) -> bool:
    """Add one measured row (``date``, ``data``, ``windows``, ``ppl``, ``command``,
    ``machine``) to the card of a folder torq wrote; whether there was such a card."""
    path = Path(folder).expanduser() / CARD
    if not path.is_file() or _MEASURED not in (text := path.read_text()):
        return False
    line = (
        f"| {row['date']} | {row['data']} | {row['windows']} | {row['ppl']:.2f} | "
        f"`{row['command']}` | {row['machine']} |"
    )
    if _NOTHING_YET in text:
        text = text.replace(_NOTHING_YET, f"{_HEAD}\n| --- | --- | ---: | ---: | --- | --- |")
    head, _, rest = text.partition(_MEASURED)
    table_end = rest.rstrip("\n")
    path.write_text(f"{head}{_MEASURED}{table_end}\n{line}\n")
    return True


def guarded(folder: Path) -> bool:
    """Whether ``folder``'s config names torq's transformers loader (``auto_map``)."""
    config = folder / "config.json"
    return config.is_file() and "auto_map" in json.loads(config.read_text())
