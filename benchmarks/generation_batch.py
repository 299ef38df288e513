"""Greedy generation in batches against one problem at a time: speed, and whether the
answers stay the same (HumanEval or GSM8K through lm-eval, as ``benchmarks/humaneval.py``).

    python -m benchmarks.generation_batch --model qwen2.5-coder-0.5b --task humaneval \\
        --limit 16 --batch-sizes 1,8 --out results/generation/qwen-batch.json

On a CPU one decoding step of a 0.5B model reads every weight once (about 2 GB in float32)
whichever the number of sequences it extends, so a batch of B problems should take far less
than B steps' time. Batching changes the arithmetic (other matrix shapes, left padding), so
greedy answers may part where two tokens are nearly tied: the table counts the problems
whose answer is identical to the one-at-a-time answer, and for HumanEval the pass@1 of each.
The first batch size is the reference; each time is of this process, measured in one run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import save
from benchmarks.humaneval import quantize
from torq.experimental import (
    command_line,
    evaluate_gsm8k,
    generate_humaneval,
    load,
    load_humaneval,
    machine_info,
    now_iso,
    read_record,
    score,
)


def parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--method", default="fp", help="fp, or a method quantized as humaneval.py")
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-corpus", default="wikitext2-valid")
    ap.add_argument("--calib-seed", type=int, default=0)
    ap.add_argument("--task", choices=("humaneval", "gsm8k"), default="humaneval")
    ap.add_argument("--limit", type=int, default=16, help="HumanEval: the first N problems")
    ap.add_argument("--n", type=int, default=16, help="GSM8K: N problems drawn with --seed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-gen-toks", type=int, default=1024)
    ap.add_argument("--batch-sizes", default="1,8", help="the first is the reference")
    ap.add_argument(
        "--reference-record",
        default=None,
        help="a benchmarks/humaneval.py record with this method's row: each run's answers are "
        "also compared with the completions kept there (generated one at a time, earlier)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True)
    return ap


def answers(args: argparse.Namespace, model: torch.nn.Module, tokenizer: Any, batch: int):
    """Each problem's answer text, generated with ``batch`` problems at a time."""
    if args.task == "gsm8k":
        out = evaluate_gsm8k(model, tokenizer, args.data_dir, args.n, args.seed, batch_size=batch)
        return {str(k): v["response"] for k, v in out["answers"].items()}
    texts, _ = generate_humaneval(
        model, tokenizer, args.data_dir, args.limit, args.max_gen_toks, batch_size=batch
    )
    return texts


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--batch-sizes: positive numbers, not {args.batch_sizes!r}")
    kept = None  # read first: a bad record fails before the generation
    if args.reference_record is not None:
        rows = read_record(Path(args.reference_record))["rows"]
        row = next((r for r in rows if r["method"] == args.method), None)
        if row is None:
            raise SystemExit(f"--reference-record has no '{args.method}' row")
        kept = {t: rec["completion"] for t, rec in row["tasks"].items()}
    loaded = load(args.model)
    model = loaded.model
    if args.method != "fp":
        quantize(args, model, loaded.tokenizer, args.method)
    runs = []
    for batch in sizes:
        t0 = time.perf_counter()
        texts = answers(args, model, loaded.tokenizer, batch)
        runs.append({"batch_size": batch, "seconds": time.perf_counter() - t0, "texts": texts})
    reference = runs[0]
    if args.task == "humaneval":
        problems = [p for p in load_humaneval(args.data_dir) if p.task_id in reference["texts"]]
    for run in runs:
        run["identical"] = sum(run["texts"][k] == v for k, v in reference["texts"].items())
        run["speedup"] = reference["seconds"] / run["seconds"]
        if kept is not None:
            run["identical_to_record"] = sum(kept.get(k) == v for k, v in run["texts"].items())
        if args.task == "humaneval":
            scored = score(problems, {t: [c] for t, c in run["texts"].items()}, k=1)
            run["pass@1"] = scored["pass@1"]
    record = {
        "model": args.model,
        "method": args.method,
        "format": args.format,
        "task": args.task,
        "problems": len(reference["texts"]),
        "max_gen_toks": args.max_gen_toks,
        "runs": runs,
        "reference_record": args.reference_record,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
        "threads": args.threads,
    }
    save(args.out, record, markdown(record))


def markdown(record: dict[str, Any]) -> str:
    """Per batch size: time, speed against the first, identical answers (and pass@1)."""
    head = "| batch | seconds | speed-up | identical answers |"
    rule = "| ---: | ---: | ---: | ---: |"
    humaneval = record["task"] == "humaneval"
    if humaneval:
        head, rule = head + " pass@1 |", rule + " ---: |"
    lines = [
        f"`{record['command']}`",
        "",
        f"{record['model']}, {record['method']}, {record['task']}, {record['problems']} problems, "
        f"{record['threads']} thread(s), {record['machine'].get('cpu', '')}",
        "",
        head,
        rule,
    ]
    for r in record["runs"]:
        row = (
            f"| {r['batch_size']} | {r['seconds']:.0f} | {r['speedup']:.2f}× | "
            f"{r['identical']}/{record['problems']} |"
        )
        lines.append(row + (f" {100 * r['pass@1']:.1f} % |" if humaneval else ""))
    if record.get("reference_record"):
        same = ", ".join(
            f"batch {r['batch_size']}: {r['identical_to_record']}" for r in record["runs"]
        )
        lines += ["", f"identical to the answers kept in `{record['reference_record']}`: {same}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
