"""How a HumanEval row's programs fail: for each row of ``benchmarks/humaneval.py``
records, how many pass, fail a test (``AssertionError``: a program that runs and computes
something else), are not Python (``SyntaxError``, ``IndentationError``), raise another
error, or reach a limit (time, memory); how many completions are caught in a repetition
loop (:func:`in_a_loop`); and the completions' mean length (docs/research/paper-tables.md §12.1):
``python -m benchmarks.diagnostics.humaneval_failures
docs/records/humaneval/qwen-coder-{fp,rtn}.json``.
No model: it reads the sandbox's verdicts kept in the records.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.humaneval_paired import row_name
from torq.experimental import read_record

KINDS = ("passed", "wrong result", "not Python", "other error", "a limit")


def failure_kind(first_failure: str | None) -> str:
    """One of :data:`KINDS` for a problem's sandbox verdict
    (:attr:`torq.eval.sandbox.SandboxResult.reason`: ``None`` when it passed, else the
    last line of the program's error output, ``timed out`` or ``killed (…)``)."""
    if first_failure is None or first_failure == "passed":
        return "passed"
    if first_failure == "timed out" or first_failure.startswith("killed"):
        return "a limit"
    error = first_failure.split(":", 1)[0].strip()
    if error == "AssertionError":
        return "wrong result"
    if error in ("SyntaxError", "IndentationError", "TabError"):
        return "not Python"
    return "other error"


def in_a_loop(completion: str, min_lines: int = 20) -> bool:
    """Whether a completion is caught in a greedy repetition loop: at least ``min_lines``
    non-blank lines, of which one line makes up more than 30 %, or whose last 20 lines hold
    at most 4 distinct ones (a loop that drifts: ``return 4``, ``return 5``, …). A
    heuristic, for counting; FP's completions of 20 lines or more are not loops."""
    lines = [line for line in completion.split("\n") if line.strip()]
    if len(lines) < min_lines:
        return False
    most = Counter(lines).most_common(1)[0][1]
    return most / len(lines) > 0.3 or len(set(lines[-20:])) <= 4


def failure_counts(row: dict[str, Any]) -> dict[str, float]:
    """Per kind of :data:`KINDS`, the problems of one row; with ``problems``, ``in a loop``
    (:func:`in_a_loop`) and ``mean_chars`` (the completions' mean length), where the record
    keeps the completions."""
    counts: dict[str, float] = dict.fromkeys(KINDS, 0)
    counts["in a loop"] = 0
    lengths = []
    for task in row["tasks"].values():
        counts[failure_kind(task["first_failure"])] += 1
        if "completion" in task:
            lengths.append(len(task["completion"]))
            counts["in a loop"] += in_a_loop(task["completion"])
    counts["problems"] = len(row["tasks"])
    counts["mean_chars"] = sum(lengths) / len(lengths) if lengths else float("nan")
    return counts


def table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| row | problems | " + " | ".join(KINDS) + " | in a loop | mean characters |",
        "| --- | ---: | " + " | ".join("---:" for _ in KINDS) + " | ---: | ---: |",
    ]
    for record in records:
        for row in record["rows"]:
            name = row_name(record, row)  # the paired tables' names
            c = failure_counts(row)
            kinds = " | ".join(f"{c[k]:.0f}" for k in KINDS)
            lines.append(
                f"| {name} | {c['problems']:.0f} | {kinds} | {c['in a loop']:.0f} "
                f"| {c['mean_chars']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path, nargs="+")
    args = ap.parse_args()
    records = []
    for path in args.records:
        record = read_record(path)
        rows = record.get("rows")
        if record.get("task", "humaneval") != "humaneval" or not isinstance(rows, list):
            raise SystemExit(f"{path}: not a record of benchmarks/humaneval.py's HumanEval rows")
        records.append(record)
    print(table(records))


if __name__ == "__main__":
    main()
