"""The paper's full results table for one model: WikiText-2 perplexity and the six
zero-shot tasks (lm-eval, 0-shot) for every method, plus the Figure-1-style PNG.

python -m benchmarks.zeroshot_table --model smollm2-135m --methods fp,rtn,had32,torq \
    --calib-samples 32 --ppl-from results/full/*.json --out results/zeroshot/smollm2.json
python -m benchmarks.zeroshot_table --limit 50 ...   # the first 50 of each task (the table says so)
python -m benchmarks.zeroshot_table --subset 300 --subset-seed 0 ...   # 300 drawn at random

Methods run one at a time and the record is rewritten after each; with ``--resume-dir``
(default ``<out>-requests/``) every answer is kept as it is scored, so a stopped run loses
nothing. Run the same command again and the methods already in ``--out`` (same tasks,
limit or subset, formats and settings) are kept, not re-run; ``--merge-from`` takes rows from the
records of other runs the same way (one process per method on a machine with more cores,
then one table).

``--ppl-from`` takes earlier ``torq run`` records: a method whose perplexity was measured
there on the same windows (the full test, or the same ``--max-windows``) with the same
formats and settings reuses it (the row names its source) instead of spending another pass
over the test set; the rest are measured here.

Writes the JSON record (per method: PPL, headline scores, lm-eval's full output, wall
times), a markdown table beside it, and the figure as ``<out>.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.common import save
from torq.experimental import (
    CalibrationConfig,
    CaptureSettings,
    RunConfig,
    TorqError,
    accuracy_perplexity_figure,
    check_destination,
    command_line,
    markdown_table,
    parse_tasks,
    read_record,
    run,
    setting_key,
)


def earlier_perplexities(
    paths: list[str], max_windows: int | None = None
) -> dict[str, tuple[float, str, int]]:
    """``setting_key → (ppl, source file, windows)`` from the rows of earlier runs measured
    on the same windows: the full test (``max_windows`` ``None``) or its first
    ``max_windows``."""
    found: dict[str, tuple[float, str, int]] = {}
    for p in paths:
        rec = read_record(Path(p))
        if rec.get("kind") != "torq.run" or rec["config"].get("max_windows") != max_windows:
            continue  # another set of windows: another number
        for row in rec["rows"]:
            if row.get("ppl") is not None:
                key = setting_key(rec["config"], row["method"])
                found[key] = (row["ppl"], p, rec["eval"]["n_windows"])
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="fp,rtn,had32,gptq,torq")
    p.add_argument("--format", default="mxfp4")
    p.add_argument("--tasks", default="all")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--limit", type=int, default=None, help="first N examples per task")
    which.add_argument(
        "--subset", type=int, default=None, help="N questions per task drawn with --subset-seed"
    )
    p.add_argument("--subset-seed", type=int, default=0)
    p.add_argument("--max-windows", type=int, default=None, help="WikiText-2 windows")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--task-batch-size", type=int, default=8)
    p.add_argument("--no-shared-context", action="store_true", help="lm-eval's HFLM as it is")
    p.add_argument("--ppl-from", nargs="*", default=[], help="earlier torq run records")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="results/zeroshot/table.json")
    p.add_argument(
        "--merge-from",
        nargs="*",
        default=[],
        help="records of earlier runs of this script (one method each, say): their rows with "
        "the same tasks and settings are taken as they are",
    )
    p.add_argument(
        "--resume-dir",
        default=None,
        help="where each method's answers and perplexity windows are kept as they are "
        "measured (default: <out>-requests/); a stopped run resumes from it",
    )
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    base = RunConfig.of(
        model=args.model,
        methods=methods,
        weight_format=args.format,
        act_format=args.format,
        max_windows=args.max_windows,
        data_dir=args.data_dir,
        capture=CaptureSettings(CalibrationConfig(n_samples=args.calib_samples)),
        tasks=parse_tasks(args.tasks),
        task_limit=args.limit,
        task_subset=args.subset,
        task_subset_seed=args.subset_seed,
        task_batch_size=args.task_batch_size,
        shared_context=not args.no_shared_context,
        device=args.device,
        resume_dir=args.resume_dir or str(Path(args.out).with_suffix("")) + "-requests",
    )
    base_dict = base.record()
    subset = None if args.subset is None else {"n": args.subset, "seed": args.subset_seed}
    earlier = earlier_perplexities(args.ppl_from, args.max_windows)
    out = Path(args.out)
    check_destination(out, folder=False, what="--out")
    done: dict[str, dict[str, Any]] = {}
    record: dict[str, Any] | None = None
    template: dict[str, Any] | None = None  # the first record read: the frame of a table
    merged_commands: list[str] = []
    if out.exists():
        record = read_record(out)
    for source in [out] * out.exists() + [Path(m) for m in args.merge_from]:
        other = read_record(source)
        template = template or other
        same = (
            other["eval"]["zeroshot_tasks"] == list(base.zeroshot.tasks)
            and other["eval"]["zeroshot_limit"] == base.zeroshot.task_limit
            and other["eval"].get("zeroshot_subset") == subset
            and other["config"]["max_windows"] == base.evaluation.max_windows
        )
        kept = []
        for row in other["rows"] if same else []:
            if row["method"] not in done and row.get("key") == setting_key(
                base_dict, row["method"]
            ):
                done[row["method"]] = {**row, "row_source": str(source)}
                kept.append(row["method"])
        print(f"from {source}: kept {', '.join(kept) or 'nothing'}")
        if kept and source != out:
            merged_commands.extend(other.get("commands") or [other.get("command", "")])
    rows: list[dict[str, Any]] = []
    commands = list(record.get("commands", [])) if record else []
    for c in merged_commands:
        if c not in commands:
            commands.append(c)
    # a resumed run repeats its command: listed once, last, as the one that wrote the record
    current = command_line()
    commands = [c for c in commands if c != current] + [current]
    for method in methods:
        if method in done:
            rows.append(done[method])
            continue
        prior = earlier.get(setting_key(base_dict, method))
        config = base.replace(methods=[method], skip_ppl=prior is not None)
        result = run(config)  # the checkpoint streamed again for each method
        row = result["rows"][0]
        row["key"] = setting_key(base_dict, method)
        if prior is not None:
            row["ppl"], row["ppl_source"], row["ppl_windows"] = prior[0], prior[1], prior[2]
        rows.append(row)
        record = {**result, "rows": rows, "commands": commands, "complete": False}
        record["eval"]["n_windows"] = _windows(rows, result)
        _write(out, record)
    record = record or template
    if record is None:
        raise SystemExit("no methods to run")
    # the top-level command is the one that wrote this record (a merge-only run included);
    # the commands behind its rows are in ``commands``
    record = {
        **record,
        "command": command_line(),
        "rows": rows,
        "commands": commands,
        "complete": True,
    }
    record["eval"]["n_windows"] = _windows(rows, record)
    path = _write(out, record)
    figure = accuracy_perplexity_figure(record, path.with_suffix(".png"))
    print(f"wrote {figure}")


def _windows(rows: list[dict[str, Any]], result: dict[str, Any]) -> int:
    """Windows behind the Wiki2 column: measured here, or in the run a row reused."""
    counts = [r.get("ppl_windows") or 0 for r in rows]
    counts += [(r["details"].get("perplexity") or {}).get("n_windows", 0) for r in rows]
    return max(counts, default=result["eval"]["n_windows"])


def _zeroshot_time(zs: dict[str, Any]) -> str:
    """The tasks' wall time: of this process, or summed over the sessions that scored the
    answers kept in the resume directory (a stopped session's time is not known)."""
    cache = zs.get("request_cache")
    if not cache:
        return f"{zs['seconds']:.0f} s"
    sessions = cache["sessions"]
    spent = [s for s in sessions if "seconds" in s and s["entries_after"] > s["entries_before"]]
    total = sum(s["seconds"] for s in spent)
    text = f"{total:.0f} s over {len(spent)} scoring session(s)"
    stopped = [s for s in sessions if "seconds" not in s]
    if stopped:
        # a stopped session's last heartbeat (at most a minute short); older records lack it
        known = [s["seconds_so_far"] for s in stopped if "seconds_so_far" in s]
        text = f"{total + sum(known):.0f} s over {len(spent) + len(known)} session(s)"
        if len(known) < len(stopped):
            text += f" + {len(stopped) - len(known)} stopped session(s) of unknown length"
    return text


def _write(out: Path, record: dict[str, Any]) -> Path:
    table = markdown_table(record)
    lines = []
    for r in record["rows"]:
        zs = r["zeroshot"]
        ppl = (
            f"perplexity {r['eval_seconds']:.0f} s"
            if not r.get("ppl_source")
            else (f"perplexity from {r['ppl_source']}")
        )
        lines.append(
            f"- {r['method']}: quantize {r['quantize_seconds']:.0f} s, {ppl}, zero-shot "
            f"{_zeroshot_time(zs)}"
        )
    commands = "\n".join(f"`{c}`" for c in record["commands"])
    status = "" if record["complete"] else "\n\n(partial: not every method has run yet)"
    return save(out, record, f"{commands}\n\n{table}\n\nWall times:\n" + "\n".join(lines) + status)


if __name__ == "__main__":
    try:
        main()
    except TorqError as exc:
        raise SystemExit(f"zeroshot_table.py: error: {exc}") from None
