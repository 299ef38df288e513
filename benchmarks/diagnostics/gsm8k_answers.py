"""What a GSM8K row lost: the answer's form or its arithmetic. For each row of a
``benchmarks/humaneval.py --task gsm8k`` record, how many answers end in lm-eval's
``#### N`` form (the strict filter found a number), how many of those are right, how many
the flexible filter gets right, and the answers' mean length (docs/research/paper-tables.md §12.1):
``python -m benchmarks.diagnostics.gsm8k_answers docs/records/gsm8k/qwen-coder-200.json``.
No model: it reads the answers kept in the record.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torq.experimental import read_record

INVALID = "[invalid]"  # lm-eval's filters' answer when their pattern finds nothing


def answer_forms(row: dict[str, Any]) -> dict[str, float]:
    """Counts over one row's answers: ``answers``, ``formatted`` (the strict filter found
    ``#### N``), ``strict`` and ``flexible`` (exact matches), ``mean_chars``."""
    answers = list(row["answers"].values())
    formatted = [a for a in answers if a["strict-match"]["answer"] != INVALID]
    return {
        "answers": len(answers),
        "formatted": len(formatted),
        "strict": sum(a["strict-match"]["exact_match"] for a in answers),
        "flexible": sum(a["flexible-extract"]["exact_match"] for a in answers),
        "mean_chars": sum(len(a["response"]) for a in answers) / max(len(answers), 1),
    }


def table(record: dict[str, Any]) -> str:
    lines = [
        "| method | answers | in `#### N` form | right, strict | right, flexible "
        "| right of the formatted | mean characters |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in record["rows"]:
        c = answer_forms(row)
        of_formatted = 100 * c["strict"] / c["formatted"] if c["formatted"] else 0.0
        lines.append(
            f"| {row['method']} | {c['answers']} | {c['formatted']} | {c['strict']:.0f} "
            f"| {c['flexible']:.0f} | {of_formatted:.1f} % | {c['mean_chars']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", type=Path)
    args = ap.parse_args()
    record = read_record(args.record)
    if record.get("task") != "gsm8k":
        raise SystemExit(f"{args.record}: not a GSM8K record (task {record.get('task')!r})")
    print(table(record))


if __name__ == "__main__":
    main()
