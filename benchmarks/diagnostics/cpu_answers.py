"""Does this machine give a carried row's answers? (docs/RESULTS.md §12.5)

Generates a row's first answers here into a request cache, as ``benchmarks/humaneval.py``
makes them (the same prompts, order, batch and one thread), and compares them, by lm-eval's
request hash, with the answers a portable copy carries from another machine: how many are
the same character for character, and where the others part.

    python benchmarks/diagnostics/cpu_answers.py --task gsm8k --method had32 \\
        --carry docs/gsm8k/carry/gsm8k-had32-188810ee9b.npz --cache results/cpu/gsm8k-had32 \\
        --answers 8 --out results/cpu/gsm8k-had32.json

``--answers N`` stops the generation once the cache holds N answers (lm-eval writes them a
batch at a time); ``--compare-only`` compares what ``--cache`` already holds. A HumanEval row
(``--task humaneval``) is generated one problem at a time; ``--kept DIR`` takes the model
kept there (``torq.eval.resume``) instead of quantizing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from torq.eval.portable import ANSWERS_DB, _db_answers, load_portable, sessions_cpus
from torq.results import cpu_model, now_iso


def _generate(args: argparse.Namespace) -> None:
    import importlib.util

    import torch

    from torq.eval.generation import evaluate_gsm8k, generate_humaneval
    from torq.eval.resume import fingerprint_ids, load_kept_model
    from torq.models import load

    torch.set_num_threads(1)
    loaded = load(args.model)
    model = loaded.model
    if args.kept is not None:
        kept = load_kept_model(Path(args.kept), fingerprint_ids(loaded.tokenizer))
        if kept is None:
            raise SystemExit(f"cpu_answers: no kept model in {args.kept}")
        model = kept[0]
    elif args.method != "fp":
        bench = Path(__file__).resolve().parents[1] / "humaneval.py"
        spec = importlib.util.spec_from_file_location("bench_humaneval", bench)
        assert spec is not None and spec.loader is not None
        he = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(he)
        argv = ["--task", args.task, "--model", args.model, "--methods", args.method]
        argv += ["--calib-samples", "16", "--out", "unused.json"]
        he.quantize(he.parser().parse_args(argv), model, loaded.tokenizer, args.method)
    if args.task == "gsm8k":
        evaluate_gsm8k(model, loaded.tokenizer, args.data_dir, 200, 0, batch_size=8,
                       request_cache=Path(args.cache))  # fmt: skip
    else:
        generate_humaneval(model, loaded.tokenizer, args.data_dir, None, 1024,
                           request_cache=Path(args.cache))  # fmt: skip


def compare(cache: Path, carry: Path) -> dict[str, Any]:
    """The answers in ``cache`` against those ``carry`` holds for the same requests."""
    here = _db_answers(cache / ANSWERS_DB)[3]
    copy = load_portable(carry)
    there = copy["generations"]
    rows = []
    for key, text in here.items():
        if key not in there:
            continue
        other = there[key]
        n = min(len(text), len(other))
        part = next((i for i in range(n) if text[i] != other[i]), n)
        rows.append({"key": f"{key:016x}", "same": text == other, "parts_at": part,
                     "length_here": len(text), "length_there": len(other)})  # fmt: skip
    return {
        "carry": str(carry),
        "carry_cpus": sessions_cpus(copy["meta"].get("sessions", [])),
        "answers_compared": len(rows),
        "the_same": sum(r["same"] for r in rows),
        "answers": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("gsm8k", "humaneval"), default="gsm8k")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--method", default="fp")
    ap.add_argument("--kept", help="a resume directory holding the quantized model")
    ap.add_argument("--carry", required=True, type=Path, help="the other machine's copy")
    ap.add_argument("--cache", required=True, type=Path, help="this machine's answers")
    ap.add_argument("--answers", type=int, default=8)
    ap.add_argument("--compare-only", action="store_true")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    load_portable(args.carry)  # a bad copy fails before any generation
    t0 = time.perf_counter()
    if not args.compare_only:
        worker = mp.get_context("spawn").Process(target=_generate, args=(args,))
        worker.start()
        db = args.cache / ANSWERS_DB
        while worker.is_alive():
            worker.join(20)
            if db.is_file() and len(_db_answers(db)[3]) >= args.answers:
                worker.terminate()
                worker.join()
    record = {
        "task": args.task,
        "method": args.method,
        "kept": args.kept,
        "cpu_here": cpu_model(),
        **compare(args.cache, args.carry),
        "seconds": time.perf_counter() - t0,
        "date": now_iso(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.method}: {record['the_same']} of {record['answers_compared']} answers the same "
          f"as on {', '.join(record['carry_cpus']) or 'the other machine'}")  # fmt: skip


if __name__ == "__main__":
    main()
