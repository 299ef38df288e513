"""How far does a row's score move between kinds of CPU? (docs/RESULTS.md §12.5)

Scores the answers that portable copies (``--portable-dir``) carry, without running the
model: lm-eval asks the same requests as ``benchmarks/humaneval.py`` and a replaying class
(:func:`torq.eval.portable.replaying_class`) hands out each copy's kept answer, or none;
the problems a copy answered are then scored as the row scores them (HumanEval in the
sandbox, GSM8K by lm-eval's filters). With two copies of one row made on different CPUs,
the two are compared problem by problem on the problems both answered (paired difference,
exact McNemar): the move that the CPU's float rounding alone makes in the row's score; and
how many of the answers both hold are the same text.

    python benchmarks/diagnostics/carry_scores.py --task humaneval \\
        --carry docs/humaneval/carry/intel-xeon/humaneval-torq-had32-158a663b47.npz \\
        --carry docs/humaneval/carry/humaneval-torq-had32-158a663b47.npz \\
        --out docs/cpu/humaneval-torq-had32-wikipedia-scores.json

The model named in the copies' settings gives only the tokenizer and chat template (it is
loaded in float and never run). GSM8K takes ``--n`` and ``--seed`` (the subset the copies
were made on, 200 and 0 by default); every carried answer must find its request, or the
subset or settings differ and the script stops.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torq.errors import TorqError
from torq.eval.paired import paired_difference
from torq.eval.portable import UNANSWERED, load_portable, replaying_class, sessions_cpus
from torq.results import now_iso


def carried_scores(
    task: str, carry: Path, copy: dict[str, Any], model: Any, tokenizer: Any, args: Any
) -> dict[str, Any]:
    """The score of each problem that the copy ``carry`` (read by :func:`load_portable`
    into ``copy``) answered (problem → 0 or 1; for GSM8K the flexible and the strict
    filter), the CPUs it was made on and how many answers it holds; every carried answer
    must be asked for."""
    from torq.eval.generation import evaluate_gsm8k, generate_humaneval
    from torq.eval.humaneval import load_humaneval, score
    from torq.eval.stopping import StopEachSequenceHFLM

    generations = copy["generations"]
    setting = json.loads(copy["meta"].get("setting") or "{}")
    cls = replaying_class(StopEachSequenceHFLM, generations)
    scores: dict[str, dict[Any, float]] = {}
    if task == "gsm8k":
        run = evaluate_gsm8k(model, tokenizer, args.data_dir, args.n, args.seed, lm_class=cls)
        kept = {d: a for d, a in run["answers"].items() if a["response"] != UNANSWERED}
        for name in ("flexible-extract", "strict-match"):
            scores[name] = {d: float(a[name]["exact_match"]) for d, a in kept.items()}
    else:
        completions, _ = generate_humaneval(
            model,
            tokenizer,
            args.data_dir,
            None,
            int(setting.get("max_gen_toks", 1024)),
            prompt=setting.get("prompt", "completion"),
            lm_class=cls,
        )
        kept_c = {t: c for t, c in completions.items() if c != UNANSWERED}
        problems = [p for p in load_humaneval(args.data_dir) if p.task_id in kept_c]
        result = score(problems, {t: [c] for t, c in kept_c.items()}, k=1)
        scores["pass@1"] = {t: float(r["pass@1"]) for t, r in result["tasks"].items()}
    answered = len(next(iter(scores.values())))
    if answered != len(generations):
        raise SystemExit(
            f"carry_scores: {carry} holds {len(generations)} answers but {answered} were "
            "asked for: another subset or other settings than the copy's"
        )
    return {
        "carry": str(carry),
        "cpus": sessions_cpus(copy["meta"].get("sessions", [])),
        "answers": len(generations),
        "scores": scores,
    }


def compare_copies(
    rows: list[dict[str, Any]], copies: list[dict[int, str]], record: dict[str, Any]
) -> list[str]:
    """Each row's mean per metric; with two rows (one row's copies from two CPUs), how many
    of the answers both copies hold are the same text and, per metric, their paired
    difference on the problems both answered (:func:`torq.eval.paired.paired_difference`),
    added to ``record``. Returns the lines to print."""
    lines = []
    for row in rows:
        for metric, per in row["scores"].items():
            mean = 100 * sum(per.values()) / len(per)
            lines.append(f"{row['carry']} ({', '.join(row['cpus'])}): {metric} {mean:.1f} % "
                         f"of {len(per)}")  # fmt: skip
    if len(rows) != 2:
        return lines
    first, second = copies
    shared = [k for k in first if k in second]
    same = sum(first[k] == second[k] for k in shared)
    record["answers_shared"], record["answers_identical"] = len(shared), same
    lines.append(f"{same} of the {len(shared)} answers both hold are the same text")
    record["paired"] = {}
    for metric in rows[0]["scores"]:
        p = paired_difference(rows[0]["scores"][metric], rows[1]["scores"][metric])
        record["paired"][metric] = asdict(p)
        lines.append(
            f"{metric} on the {p.n} problems both answered: {100 * p.mean_a:.1f} vs "
            f"{100 * p.mean_b:.1f} %, difference {100 * p.diff:+.1f} ± {100 * p.stderr:.1f} "
            f"(only first {p.only_a}, only second {p.only_b}, McNemar p = {p.p_mcnemar:.2g})"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("gsm8k", "humaneval"), required=True)
    ap.add_argument("--carry", type=Path, action="append", required=True,
                    help="a portable copy (give two to compare them)")  # fmt: skip
    ap.add_argument("--model", default=None,
                    help="for copies older than their settings key, which name none")  # fmt: skip
    ap.add_argument("--n", type=int, default=200, help="GSM8K: the subset's size")
    ap.add_argument("--seed", type=int, default=0, help="GSM8K: the subset's seed")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if len(args.carry) > 2:
        ap.error("give one copy, or two to compare")
    try:  # a bad copy fails, in one line, before the model is loaded
        copies = [load_portable(path) for path in args.carry]
    except TorqError as exc:
        ap.error(str(exc))
    models = set()
    for path, copy in zip(args.carry, copies, strict=True):
        if not copy["generations"]:
            ap.error(f"{path} holds no generated answers")
        setting = json.loads(copy["meta"].get("setting") or "{}")
        models.add(setting.get("model") or args.model)
    if args.model is not None:
        models.add(args.model)
    if len(models) != 1 or None in models:
        ap.error(f"the copies and --model must name one model, not {sorted(map(str, models))}")

    from torq.models import load

    t0 = time.perf_counter()
    loaded = load(models.pop())
    rows = [
        carried_scores(args.task, path, copy, loaded.model, loaded.tokenizer, args)
        for path, copy in zip(args.carry, copies, strict=True)
    ]
    record: dict[str, Any] = {"task": args.task, "n": args.n, "seed": args.seed, "rows": rows}
    lines = compare_copies(rows, [c["generations"] for c in copies], record)
    record["seconds"] = time.perf_counter() - t0
    record["date"] = now_iso()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # problem ids become strings in JSON; GSM8K's are ints
    args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
