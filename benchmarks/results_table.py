"""Merge ``torq run`` result JSONs into one markdown table (for ``docs/RESULTS.md``).

Each row keeps the command that produced it; ``×FP`` is relative to the ``fp`` row found
among the inputs (same model and windows).

Usage: ``python benchmarks/results_table.py results/full/*.json``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args()
    records = [json.loads(p.read_text()) for p in args.results]
    fp = {
        (r["config"]["model"], r["eval"]["n_windows"]): row["ppl"]
        for r in records
        for row in r["rows"]
        if row["method"] == "fp"
    }
    lines = [
        "| model | method | W | A | PPL | ×FP | windows | eval tok/s | wall s | command |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in records:
        key = (r["config"]["model"], r["eval"]["n_windows"])
        for row in r["rows"]:
            ratio = f"{row['ppl'] / fp[key]:.2f}" if key in fp else "–"
            lines.append(
                f"| {key[0]} | {row['method']} | {row['weights']} | {row['activations']} "
                f"| {row['ppl']:.2f} | {ratio} | {key[1]} | {row['eval_tokens_per_s']:.0f} "
                f"| {r['wall_seconds']:.0f} | `{r['command']}` |"
            )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
