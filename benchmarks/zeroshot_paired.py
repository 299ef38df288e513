"""Paired, question-by-question comparison of zero-shot rows from their kept answers.

python -m benchmarks.zeroshot_paired --model smollm2-135m \
    --methods torq-had32,torq-inter,torq-intra --resume-dir results/zeroshot/resume \
    --out results/zeroshot/smollm2-paired.json

Each method's answers come from its folder in ``--resume-dir`` (``<model>/<method>-<hash>``,
written by ``zeroshot_table.py --resume-dir``: lm-eval's request cache). A method with
several folders (several settings) is named with the folder's hash:
``--methods quarot@3fa46f9946``. Every question is scored again with lm-eval's own rule
(``torq.eval.paired``), so each row's task means are its table numbers. For every pair of
methods (or the ``--pairs a:b,...`` given) the table gives, per task, the difference of
accuracies, its paired standard error, the questions only one of the two gets right and the
exact McNemar p-value; and the difference of the averages with its error. A row still being
scored is compared on the questions it has (the table says how many).
"""

from __future__ import annotations

import argparse
import itertools
import pickle
import sqlite3
from pathlib import Path
from typing import Any

from benchmarks.common import save
from torq.experimental import (
    TASKS,
    Answer,
    TorqError,
    build_questions,
    command_line,
    compare_rows,
    machine_info,
    now_iso,
    parse_tasks,
    question_scores,
)

ANSWERS_DB = "requests_rank0.db"  # lm-eval's CachingLM file for the stem "requests"


def method_folder(resume: Path, model: str, method: str) -> Path:
    """The one kept folder of ``method`` under ``resume/<model>``; ``method@<hash>`` names
    one of several settings."""
    root = resume / "".join(c if c.isalnum() or c in "-._" else "_" for c in model)
    if "@" in method:
        name, digest = method.split("@", 1)
        exact = root / f"{name}-{digest}"
        if not (exact / ANSWERS_DB).is_file():
            raise TorqError(f"no kept answers in {exact}")
        return exact
    # "torq-inter-<hash>" must not match "torq-inter+gptq-<hash>": the hash has no dash
    found = [
        f
        for f in sorted(root.glob(f"{method}-*"))
        if "-" not in f.name[len(f"{method}-") :] and (f / ANSWERS_DB).is_file()
    ]
    if not found:
        raise TorqError(f"no kept answers for {method!r} in {root} ({method}-*/{ANSWERS_DB})")
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise TorqError(f"several kept settings for {method!r} ({names}); name one as m@<hash>")
    return found[0]


def kept_answers(folder: Path) -> dict[int, Answer]:
    """The log-likelihood answers of lm-eval's request cache in ``folder``, by the first 64
    bits of their key (:func:`torq.eval.paired.answer_key`)."""
    con = sqlite3.connect(f"file:{folder / ANSWERS_DB}?mode=ro", uri=True, timeout=30.0)
    try:
        rows = con.execute("SELECT key, value FROM unnamed").fetchall()
    finally:
        con.close()
    answers: dict[int, Answer] = {}
    for key, value in rows:
        answer = pickle.loads(value)
        if isinstance(answer, tuple) and len(answer) == 2:  # a log-likelihood answer
            answers[int(key[:16], 16)] = (float(answer[0]), bool(answer[1]))
    return answers


def markdown(record: dict[str, Any]) -> str:
    tasks = record["tasks"]
    lines = [
        f"`{record['command']}`",
        "",
        "Each cell: difference of accuracy in points (a − b) ± paired standard error; "
        "[questions only a gets right / only b]; exact McNemar p.",
        "",
        "| a | b | " + " | ".join(TASKS[t].label for t in tasks) + " | Avg |",
        "| --- | --- | " + " | ".join("---:" for _ in tasks) + " | ---: |",
    ]
    for pair in record["pairs"]:
        cells = []
        for t in tasks:
            p = pair["tasks"][t]
            cells.append(
                f"{100 * p['diff']:+.1f} ± {100 * p['stderr']:.1f} "
                f"[{p['only_a']}/{p['only_b']}] p={p['p_mcnemar']:.2g}"
            )
        avg = pair["average"]
        cells.append(f"{100 * avg['diff']:+.2f} ± {100 * avg['stderr']:.2f}")
        lines.append(f"| {pair['a']} | {pair['b']} | " + " | ".join(cells) + " |")
    lines += ["", "Questions scored per method (left out: a request not yet answered):", ""]
    for m, info in record["methods"].items():
        counts = ", ".join(
            f"{TASKS[t].label} {info['questions'][t]}"
            + (f" (−{info['missing'][t]})" if info["missing"][t] else "")
            for t in tasks
        )
        lines.append(f"- {m} (`{info['file']}`): {counts}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", required=True, help="comma-separated methods with kept answers")
    p.add_argument("--pairs", default=None, help="a:b,... (default: every pair of --methods)")
    p.add_argument("--resume-dir", default="results/zeroshot/resume")
    p.add_argument("--tasks", default="all")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="results/zeroshot/paired.json")
    args = p.parse_args()
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if args.pairs:
            pairs = [tuple(x.split(":")) for x in args.pairs.split(",") if x.strip()]
            if any(len(pr) != 2 or set(pr) - set(methods) for pr in pairs):
                raise TorqError("--pairs takes a:b,... with a and b among --methods")
        else:
            pairs = list(itertools.combinations(methods, 2))
        tasks = parse_tasks(args.tasks)
        files = {m: method_folder(Path(args.resume_dir), args.model, m) for m in methods}
        questions = build_questions(tasks, args.data_dir)
        scores = {}
        info: dict[str, Any] = {}
        for m, path in files.items():
            answers = kept_answers(path)
            scores[m], missing = question_scores(answers, questions)
            info[m] = {
                "file": str(path),
                "answers": len(answers),
                "questions": {t: len(s) for t, s in scores[m].items()},
                "missing": missing,
                "means": {t: sum(s.values()) / len(s) if s else None for t, s in scores[m].items()},
            }
            print(f"{m}: {len(answers)} answers, {sum(info[m]['questions'].values())} questions")
        record = {
            "kind": "torq.zeroshot_paired",
            "command": command_line(),
            "date": now_iso(),
            "machine": machine_info(),
            "model": args.model,
            "tasks": tasks,
            "methods": info,
            "pairs": [{"a": a, "b": b, **compare_rows(scores[a], scores[b])} for a, b in pairs],
        }
    except TorqError as e:
        raise SystemExit(f"error: {e}") from None
    save(args.out, record, markdown(record))


if __name__ == "__main__":
    main()
