"""HumanEval rows compared problem by problem (the paper's Table 4): every row of the
records of ``benchmarks/humaneval.py`` against a reference row (FP by default) and against
each other, on the problems both have: pass@1 of each, the paired difference with its
standard error, how many problems only one of the two solves, and the exact McNemar p.

    python benchmarks/humaneval_paired.py results/humaneval/qwen-coder.json \\
        results/humaneval/qwen-coder-torq-had32.json results/humaneval/qwen-coder-torq.json \\
        --out results/humaneval/qwen-coder-paired.json

Rows of one model and one problem set compare. A row is named by its method, with its
calibration corpus, seed and prompt where they are not the defaults (``torq (seed 1)``); a
name found in two records is refused (say which record to take). Writes JSON and a markdown
table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save
from torq.errors import TorqError
from torq.eval.paired import paired_difference
from torq.results import command_line, machine_info, now_iso


def problem_scores(row: dict) -> dict[int, float]:
    """A row's pass@1 per problem, keyed by HumanEval's problem number."""
    return {int(t.split("/")[-1]): float(rec["pass@1"]) for t, rec in row["tasks"].items()}


def row_name(record: dict, row: dict) -> str:
    """A row's name in the comparison: its method, with the calibration corpus, seed and
    prompt where they are not the defaults (a second seed, another corpus or another
    prompt of one method is another row)."""
    parts = []
    if row["method"] != "fp":  # FP is not calibrated: one row, whatever the records say
        if record.get("calib_corpus", "wikitext2-valid") != "wikitext2-valid":
            parts.append(record["calib_corpus"])
        if record.get("calib_seed", 0) != 0:
            parts.append(f"seed {record['calib_seed']}")
    if record.get("prompt", "completion") != "completion":
        parts.append(f"{record['prompt']} prompt")
    return row["method"] + (f" ({', '.join(parts)})" if parts else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="records written by benchmarks/humaneval.py")
    ap.add_argument("--reference", default="fp", help="the row every other is compared with")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows: dict[str, dict] = {}
    models = set()
    for path in args.records:
        record = json.loads(Path(path).read_text())
        if record.get("task", "humaneval") != "humaneval":
            raise TorqError(f"{path} is not a HumanEval record")
        models.add(record["model"])
        for row in record["rows"]:
            name = row_name(record, row)
            if name in rows:
                raise TorqError(f"{name} is in more than one record")
            rows[name] = {**row, "record": str(path)}
    if len(models) > 1:
        raise TorqError(f"records of different models: {', '.join(sorted(models))}")
    if args.reference not in rows:
        raise TorqError(f"no row named {args.reference} in the records")
    scores = {m: problem_scores(r) for m, r in rows.items()}
    pairs = []
    names = list(rows)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            first, second = (b, a) if a == args.reference else (a, b)
            diff = paired_difference(scores[first], scores[second])
            pairs.append({"a": first, "b": second, **asdict(diff)})
    record = {
        "model": models.pop(),
        "reference": args.reference,
        "rows": {
            m: {"pass@1": r["pass@1"], "problems": r["problems"], "record": r["record"]}
            for m, r in rows.items()
        },
        "pairs": pairs,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
    }
    save(args.out, record, _table(record))


def _table(record: dict) -> str:
    lines = [
        f"{record['model']}, HumanEval pass@1, rows compared problem by problem",
        "",
        "| a | b | problems | a % | b % | a − b (points) | only a / only b | McNemar p |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in record["pairs"]:
        lines.append(
            f"| {p['a']} | {p['b']} | {p['n']} | {100 * p['mean_a']:.1f} | "
            f"{100 * p['mean_b']:.1f} | {100 * p['diff']:+.1f} ± {100 * p['stderr']:.1f} | "
            f"{p['only_a']} / {p['only_b']} | {p['p_mcnemar']:.2g} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except TorqError as exc:
        sys.exit(f"humaneval_paired.py: error: {exc}")
