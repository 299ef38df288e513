"""HumanEval or GSM8K rows compared problem by problem (the paper's Table 4): every row of
the records of ``benchmarks/humaneval.py`` against a reference row (FP by default) and
against each other, on the problems both have: the score of each (HumanEval's pass@1,
GSM8K's exact match under ``--filter``), the paired difference with its standard error, how
many problems only one of the two solves, and the exact McNemar p.

    python -m benchmarks.humaneval_paired results/humaneval/qwen-coder.json \\
        results/humaneval/qwen-coder-torq-had32.json results/humaneval/qwen-coder-torq.json \\
        --out results/humaneval/qwen-coder-paired.json

Rows of one model and one task compare. GSM8K rows compare only within one subset
(``--n`` and ``--seed``) and one batch size, and others are refused: lm-eval draws each
problem's five examples in turn over the subset, so a problem's prompt differs between
subsets (at n = 50 and n = 200, seed 0, none of the 50 shared problems had the same prompt;
docs/research/paper-tables.md §12.1), and the batch changes W4A4 answers. A row is named by its
method, with its
calibration corpus, seed and prompt where they are not the defaults (``torq (seed 1)``); a
name found in two records is refused (say which record to take). Writes JSON and a markdown
table (``<out>.md``).

With ``--seed-means`` the rows of one method (and corpus and prompt) measured with several
calibration seeds are replaced by one row, ``torq (mean of seeds 0, 1)``: its score on each
problem is the mean over the seeds, so the comparison is between methods rather than between
one calibration draw of each (on Qwen2.5-Coder-0.5B a second seed moved one method by 6
points, docs/research/paper-tables.md §12.1). The paired standard error is still over
problems: it does not cover a shift that a seed gives every problem alike, so each such row
also lists its seeds' own pass@1 (their spread is that shift, seen directly); its "only a /
only b" count problems where one row's mean is higher, and its p is then the exact sign
test over them.
Each pair then also has an error that covers the calibration draw, ``stderr_with_seeds``:
the paired error over problems combined with each averaged side's seed error, the standard
deviation of its seeds' scores over √(number of seeds) (:func:`seed_stderr`). It is a little
conservative: a problem's change from seed to seed counts in both terms. A method measured
with one seed has no seed error to add, so a pair with such a row understates the spread
(say so where it is read).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import save
from torq.experimental import (
    TorqError,
    command_line,
    machine_info,
    now_iso,
    paired_difference,
    read_record,
)

GSM8K_FILTERS = ("flexible-extract", "strict-match")


def problem_scores(
    row: dict, task: str = "humaneval", gsm8k_filter: str = GSM8K_FILTERS[0]
) -> dict[int, float]:
    """A row's score per problem: HumanEval's pass@1 keyed by its problem number, or
    GSM8K's exact match under ``gsm8k_filter`` keyed by the test problem's index."""
    if task == "gsm8k":
        return {int(q): float(a[gsm8k_filter]["exact_match"]) for q, a in row["answers"].items()}
    return {int(t.split("/")[-1]): float(rec["pass@1"]) for t, rec in row["tasks"].items()}


def gsm8k_protocol(record: dict, row: dict) -> tuple[int, int, int]:
    """What GSM8K rows must share to be compared problem by problem: the subset's size and
    seed (they fix each problem's 5-shot prompt) and the batch size (module doc)."""
    return int(row["n"]), int(row["seed"]), int(row.get("batch_size", 1))


def row_name(record: dict, row: dict, seed: bool = True) -> str:
    """A row's name in the comparison: its method, with the calibration corpus, seed and
    prompt where they are not the defaults (a second seed, another corpus or another
    prompt of one method is another row); ``seed=False``: the name without the seed (what
    the rows of one method's seeds share)."""
    parts = []
    if row["method"] != "fp":  # FP is not calibrated: one row, whatever the records say
        if record.get("calib_corpus", "wikitext2-valid") != "wikitext2-valid":
            parts.append(record["calib_corpus"])
        if seed and record.get("calib_seed", 0) != 0:
            parts.append(f"seed {record['calib_seed']}")
    if record.get("prompt", "completion") != "completion":
        parts.append(f"{record['prompt']} prompt")
    return row["method"] + (f" ({', '.join(parts)})" if parts else "")


def seed_stderr(seed_scores: list[float]) -> float:
    """The standard error that the calibration draw gives a mean over ``seed_scores`` (one
    row's score per calibration seed, on the same problems): their sample standard
    deviation over √S; 0 for one seed (nothing measured; module doc)."""
    n = len(seed_scores)
    if n < 2:
        return 0.0
    mean = sum(seed_scores) / n
    return math.sqrt(sum((x - mean) ** 2 for x in seed_scores) / (n - 1) / n)


def seed_means(
    rows: dict[str, dict], scores: dict[str, dict[int, float]]
) -> tuple[dict[str, dict], dict[str, dict[int, float]]]:
    """The rows and scores with the rows that share a name but for their calibration seed
    (two or more seeds) replaced by one row, where the first of them stood, whose score per
    problem is the mean over the seeds, on the problems every seed has (module doc)."""
    groups: dict[str, list[str]] = {}
    for name, row in rows.items():
        groups.setdefault(row["seedless"], []).append(name)
    new_rows: dict[str, dict] = {}
    new_scores: dict[str, dict[int, float]] = {}
    for base, names in groups.items():
        if len(names) < 2:
            (name,) = names
            new_rows[name], new_scores[name] = rows[name], scores[name]
            continue
        names.sort(key=lambda n: rows[n]["calib_seed"])
        seeds = ", ".join(str(rows[n]["calib_seed"]) for n in names)
        shared = sorted(set.intersection(*(set(scores[n]) for n in names)))
        mean = {q: sum(scores[n][q] for n in names) / len(names) for q in shared}
        # ``torq`` → ``torq (mean of seeds 0, 1)``; ``torq (python-stdlib)`` →
        # ``torq (python-stdlib, mean of seeds 0, 1)``
        if base.endswith(")"):
            name = f"{base[:-1]}, mean of seeds {seeds})"
        else:
            name = f"{base} (mean of seeds {seeds})"
        new_rows[name] = {
            "method": rows[names[0]]["method"],
            "score": sum(mean.values()) / len(mean),
            "problems": len(mean),
            "record": [rows[n]["record"] for n in names],
            "seeds": {str(rows[n]["calib_seed"]): rows[n]["score"] for n in names},
            # each seed's score on the problems the mean is over (a seed may have more)
            "seed_stderr": seed_stderr(
                [sum(scores[n][q] for q in shared) / len(shared) for n in names]
            ),
        }
        new_scores[name] = mean
    return new_rows, new_scores


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="records written by benchmarks/humaneval.py")
    ap.add_argument("--reference", default="fp", help="the row every other is compared with")
    ap.add_argument(
        "--seed-means",
        action="store_true",
        help="one row per method for its calibration seeds: the mean over seeds per problem",
    )
    ap.add_argument(
        "--filter",
        choices=GSM8K_FILTERS,
        default=GSM8K_FILTERS[0],
        help="GSM8K: the answer filter whose exact match is compared",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows: dict[str, dict] = {}
    scores: dict[str, dict[int, float]] = {}
    models, tasks, protocols = set(), set(), set()
    for path in args.records:
        record = read_record(Path(path))
        task = record.get("task", "humaneval")
        if task not in ("humaneval", "gsm8k"):
            raise TorqError(f"{path} is neither a HumanEval nor a GSM8K record")
        models.add(record["model"])
        tasks.add(task)
        for row in record["rows"]:
            name = row_name(record, row)
            if name in rows:
                raise TorqError(f"{name} is in more than one record")
            if task == "gsm8k":
                protocols.add(gsm8k_protocol(record, row))
            scores[name] = problem_scores(row, task, args.filter)
            rows[name] = {
                "method": row["method"],
                "score": sum(scores[name].values()) / len(scores[name]),
                "problems": len(scores[name]),
                "record": str(path),
                "seedless": row_name(record, row, seed=False),
                "calib_seed": record.get("calib_seed", 0),
            }
    if len(models) > 1:
        raise TorqError(f"records of different models: {', '.join(sorted(models))}")
    if len(tasks) > 1:
        raise TorqError("records of different tasks: HumanEval and GSM8K rows do not compare")
    if len(protocols) > 1:
        seen = "; ".join(f"n {n}, seed {s}, batch {b}" for n, s, b in sorted(protocols))
        raise TorqError(
            f"GSM8K rows of different subsets or batch sizes ({seen}): a problem's 5-shot "
            "prompt depends on the subset, and its W4A4 answer on the batch"
        )
    task = tasks.pop()
    if args.seed_means:
        rows, scores = seed_means(rows, scores)
    if args.reference not in rows:
        raise TorqError(f"no row named {args.reference} in the records")
    pairs = []
    names = list(rows)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            first, second = (b, a) if a == args.reference else (a, b)
            diff = paired_difference(scores[first], scores[second])
            pair = {"a": first, "b": second, **asdict(diff)}
            if args.seed_means:
                seeds_a = rows[first].get("seed_stderr", 0.0)
                seeds_b = rows[second].get("seed_stderr", 0.0)
                pair["stderr_with_seeds"] = math.sqrt(diff.stderr**2 + seeds_a**2 + seeds_b**2)
            pairs.append(pair)
    subset = {}
    if protocols:
        n, seed, batch = protocols.pop()
        subset = {"subset": {"n": n, "seed": seed, "batch_size": batch}}
    record = {
        "model": models.pop(),
        "task": task,
        "metric": "pass@1" if task == "humaneval" else f"exact match, {args.filter}",
        **subset,
        "reference": args.reference,
        "seed_means": args.seed_means,
        "rows": {
            m: {
                "score": r["score"],
                "problems": r["problems"],
                "record": r["record"],
                **({k: r[k] for k in ("seeds", "seed_stderr") if k in r}),
            }
            for m, r in rows.items()
        },
        "pairs": pairs,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
    }
    save(args.out, record, _table(record))


def _table(record: dict) -> str:
    if record["task"] == "gsm8k":
        s = record["subset"]
        task = f"GSM8K ({s['n']} problems, seed {s['seed']}, batch {s['batch_size']})"
    else:
        task = "HumanEval"
    title = f"{record['model']}, {task} {record['metric']}, rows compared problem by problem"
    if record["seed_means"]:
        title += "; a method's calibration seeds averaged per problem"
    lines = [title, ""]
    seeded = {m: r["seeds"] for m, r in record["rows"].items() if "seeds" in r}
    for m, seeds in seeded.items():
        each = ", ".join(f"seed {s} {100 * v:.1f} %" for s, v in seeds.items())
        spread = 100 * record["rows"][m]["seed_stderr"]
        lines.append(
            f"- {m}: {100 * record['rows'][m]['score']:.1f} % ({each}; "
            f"the seeds' error ± {spread:.1f} points)"
        )
    if seeded:
        lines.append("")
    means = record["seed_means"]
    test = "McNemar or sign-test p" if means else "McNemar p"
    seeds_col = " ± with the seeds |" if means else ""
    lines += [
        f"| a | b | problems | a % | b % | a − b (points) |{seeds_col} only a / only b | {test} |",
        "| --- | --- | ---: | ---: | ---: | ---: |"
        + (" ---: |" if means else "")
        + " ---: | ---: |",
    ]
    for p in record["pairs"]:
        with_seeds = f" ± {100 * p['stderr_with_seeds']:.1f} |" if means else ""
        lines.append(
            f"| {p['a']} | {p['b']} | {p['n']} | {100 * p['mean_a']:.1f} | "
            f"{100 * p['mean_b']:.1f} | {100 * p['diff']:+.1f} ± {100 * p['stderr']:.1f} |"
            f"{with_seeds} {p['only_a']} / {p['only_b']} | {p['p_mcnemar']:.2g} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        main()
    except TorqError as exc:
        sys.exit(f"humaneval_paired.py: error: {exc}")
