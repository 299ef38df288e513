"""Paired, question-by-question comparison of zero-shot rows from their carried answers.

python benchmarks/zeroshot_paired.py --model smollm2-135m \
    --methods torq-had32,torq-inter,torq-intra --carry docs/zeroshot/carry \
    --out results/zeroshot/smollm2-paired.json

A method with several carried copies (another setting) is named with its file's hash:
``--methods quarot@3fa46f9946,quarot@8c46196c62``; copies in several formats that record
their setting (written since 2026-11-27) are picked with ``--format nvfp4``.

Each method's answers come from its portable copy in ``--carry`` (``<model>-<method>-*.npz``,
written by ``zeroshot_table.py --portable-dir``); every question is scored again with
lm-eval's own rule (``torq.eval.paired``), so each row's task means are its table numbers.
For every pair of methods (or the ``--pairs a:b,...`` given) the table gives, per task, the
difference of accuracies, its paired standard error, the questions only one of the two gets
right and the exact McNemar p-value; and the difference of the averages with its error.
A row still being scored is compared on the questions it has (the table says how many).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save
from torq.errors import TorqError
from torq.eval.paired import build_questions, compare_rows, question_scores
from torq.eval.portable import load_portable
from torq.eval.zeroshot import TASKS, parse_tasks
from torq.formats import FORMAT_NAMES
from torq.methods import get_method
from torq.results import command_line, machine_info, now_iso

ANY_FORMAT = "any format"  # an unquantized row (FP): its answers hold in every format's table


def carry_file(carry: Path, model: str, method: str, fmt: str | None = None) -> Path:
    """The one portable copy of ``method``'s answers in ``carry``; ``method@<hash>`` names
    one of several (``quarot@8c46196c62``: QuaRot's row before its signs were fixed).
    With ``fmt``, the copies whose recorded setting is in another format are set aside (a
    copy made before the setting was recorded in it can only be named by its hash)."""
    if "@" in method:
        name, digest = method.split("@", 1)
        exact = carry / f"{model}-{name}-{digest}.npz"
        if not exact.is_file():
            raise TorqError(f"no carried answers {exact.name} in {carry}")
        return exact
    found = sorted(carry.glob(f"{model}-{method}-*.npz"))
    # "torq-inter-<hash>" must not match "torq-inter+gptq-<hash>": the hash has no dash
    found = [f for f in found if "-" not in f.stem[len(f"{model}-{method}-") :]]
    if not found:
        raise TorqError(f"no carried answers for {method!r} in {carry} ({model}-{method}-*.npz)")
    formats = {f: carried_format(f) for f in found} if fmt is not None or len(found) > 1 else {}
    if fmt is not None:
        # a lone copy that records no setting is taken as it is; otherwise the format decides
        unknown_lone = len(found) == 1 and formats[found[0]] is None
        found = found if unknown_lone else [f for f in found if formats[f] in (fmt, ANY_FORMAT)]
        if not found:
            raise TorqError(f"no carried answers for {method!r} in {fmt} in {carry}")
    if len(found) > 1:
        names = ", ".join(f"{f.name} ({formats[f] or 'format not recorded'})" for f in found)
        raise TorqError(
            f"several carried copies for {method!r} ({names}); name one as {method}@<hash>"
            + ("" if fmt is not None else " or give --format")
        )
    return found[0]


def carried_format(path: Path) -> str | None:
    """The activation format of the setting a portable copy records (its ``setting``: a
    method's settings key, ``[name, {...}]``), :data:`ANY_FORMAT` for a method that does not
    quantize, or ``None`` where it records none."""
    setting = load_portable(path)["meta"].get("setting")
    if not setting:
        return None
    key = json.loads(setting)
    fields = key[1] if isinstance(key, list) and len(key) == 2 else key
    if not isinstance(fields, dict):
        return None
    name = key[0] if isinstance(key, list) else fields.get("method")
    try:
        quantizes = get_method(str(name)).quantizes
    except TorqError:  # a method this checkout does not know: its format is what it says
        quantizes = True
    return fields.get("act_format", fields.get("format")) if quantizes else ANY_FORMAT


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
    p.add_argument("--methods", required=True, help="comma-separated methods with carried answers")
    p.add_argument("--pairs", default=None, help="a:b,... (default: every pair of --methods)")
    p.add_argument("--carry", default="docs/zeroshot/carry")
    p.add_argument(
        "--format",
        default=None,
        choices=FORMAT_NAMES,
        help="pick, among a method's several carried copies, the one in this format",
    )
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
        files = {m: carry_file(Path(args.carry), args.model, m, args.format) for m in methods}
        questions = build_questions(tasks, args.data_dir)
        scores = {}
        info: dict[str, Any] = {}
        for m, path in files.items():
            carried = load_portable(path)
            answers = carried["answers"]
            scores[m], missing = question_scores(answers, questions)
            info[m] = {
                "file": str(path),
                "setting": carried["meta"].get("setting"),
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
