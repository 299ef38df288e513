"""Merge ``torq run`` result JSONs into one markdown table (for ``docs/research/``).

Each row keeps the command that produced it; ``×FP`` is relative to the ``fp`` row found
among the inputs (same model and windows). The calibration column is the method's
quantization wall time, split into the capture forward passes and the solving (GPTQ,
rotations) where the method calibrates; a record saved before its run finished
(``"complete": false``) contributes the rows it has.

Usage: ``python -m benchmarks.results_table results/full/*.json [--sort ppl]``
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torq.experimental import read_record


def calibration_tokens(row: dict[str, Any]) -> int | None:
    """Calibration tokens of a calibrated row (TORQ rows keep them under ``settings``)."""
    details = row.get("details", {})
    cal = details.get("calibration") or details.get("settings", {}).get("calibration")
    if not cal:
        return None
    samples = cal.get("samples", cal.get("n_samples"))
    return int(samples) * int(cal["seqlen"]) if samples else None


def calibration_cell(row: dict[str, Any]) -> str:
    """``total s (capture + solve), ×fwd`` for calibrated methods, where ``×fwd`` divides the
    total by one plain forward pass over the calibration tokens at the row's own evaluation
    speed (same process, same load); the plain quantize time otherwise."""
    cal = row.get("details", {}).get("calibration_seconds")
    if not cal:
        return f"{row['quantize_seconds']:.1f} s"
    cell = (
        f"{row['quantize_seconds']:.0f} s ({cal['capture_forward']:.0f} capture"
        f" + {cal['solve']:.0f} solve)"
    )
    tokens = calibration_tokens(row)
    if tokens and row.get("eval_tokens_per_s"):
        cell += f", {row['quantize_seconds'] / (tokens / row['eval_tokens_per_s']):.2f}× fwd"
    return cell


def table(records: list[dict[str, Any]], sort: str = "input") -> str:
    """The markdown table of every row of ``records``."""
    fp = {
        (r["config"]["model"], r["eval"]["n_windows"]): row["ppl"]
        for r in records
        for row in r["rows"]
        if row["method"] == "fp"
    }
    entries = [(r, row) for r in records for row in r["rows"] if row.get("ppl") is not None]
    if sort == "ppl":
        entries.sort(key=lambda e: e[1]["ppl"])
    lines = [
        "| model | method | W | A | PPL | ×FP | windows | calibration | eval tok/s | command |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for r, row in entries:
        key = (r["config"]["model"], r["eval"]["n_windows"])
        ratio = f"{row['ppl'] / fp[key]:.2f}" if key in fp else "–"
        lines.append(
            f"| {key[0]} | {row['method']} | {row['weights']} | {row['activations']} "
            f"| {row['ppl']:.2f} | {ratio} | {key[1]} | {calibration_cell(row)} "
            f"| {row['eval_tokens_per_s']:.0f} | `{r['command']}` |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--sort", choices=["input", "ppl"], default="input")
    args = ap.parse_args()
    print(table([read_record(p) for p in args.results], args.sort))


if __name__ == "__main__":
    main()
