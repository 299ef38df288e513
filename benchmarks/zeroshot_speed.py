"""Log-likelihood scoring speed: lm-eval's ``HFLM`` against torq's ``SharedContextHFLM``.

python -m benchmarks.zeroshot_speed --model smollm2-135m --docs 100 --threads 1 \
    --out results/zeroshot/speed.json

For each task, the requests of its first ``--docs`` documents (built by lm-eval from the
offline configs) are scored by both wrappers on the same model in the same process; the
record holds each one's wall time, forward tokens, their ratio, and the largest difference
between the two log-likelihoods of a request (they must agree to float rounding).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import save
from torq.experimental import (
    command_line,
    load,
    machine_info,
    now_iso,
    parse_tasks,
    prepare_tasks,
    versions,
)


def task_requests(task_name: str, data_dir: str | None, docs: int) -> list[Any]:
    """lm-eval's loglikelihood instances for the first ``docs`` documents of a paper task."""
    from lm_eval.tasks import TaskManager, get_task_dict

    with tempfile.TemporaryDirectory(prefix="torq-speed-") as tmp:
        run_name = prepare_tasks([task_name], data_dir, Path(tmp))[task_name]
        task = get_task_dict([run_name], TaskManager(include_path=tmp))[run_name]
        task.build_all_requests(limit=docs, rank=0, world_size=1)
        return [inst for inst in task.instances if inst.request_type == "loglikelihood"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", default="all")
    p.add_argument("--docs", type=int, default=100, help="documents per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="results/zeroshot/speed.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from lm_eval.models.huggingface import HFLM

    from torq.experimental import SharedContextHFLM

    loaded = load(args.model)
    model = loaded.model.eval()
    kw = dict(
        pretrained=model, tokenizer=loaded.tokenizer, batch_size=args.batch_size, device="cpu"
    )
    wrappers = {"HFLM": HFLM(**kw), "SharedContextHFLM": SharedContextHFLM(**kw)}
    tokens = [0]
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, a, _o: tokens.__setitem__(0, tokens[0] + a[0].numel())
    )
    rows = []
    for task in parse_tasks(args.tasks):
        reqs = task_requests(task, args.data_dir, args.docs)
        row: dict[str, Any] = {"task": task, "docs": args.docs, "requests": len(reqs)}
        scores = {}
        for name, lm in wrappers.items():
            tokens[0] = 0
            t0 = time.perf_counter()
            scores[name] = lm.loglikelihood(reqs, disable_tqdm=True)
            row[f"{name}_s"] = time.perf_counter() - t0
            row[f"{name}_tokens"] = tokens[0]
        row["speedup"] = row["HFLM_s"] / row["SharedContextHFLM_s"]
        pairs = list(zip(scores["HFLM"], scores["SharedContextHFLM"], strict=True))
        row["max_abs_ll_diff"] = max(abs(a[0] - b[0]) for a, b in pairs)
        row["greedy_mismatches"] = sum(a[1] != b[1] for a, b in pairs)
        rows.append(row)
        print(row, flush=True)
    hook.remove()
    lines = [
        "| task | requests | HFLM s | shared s | speed-up | forward tokens (HFLM → shared) "
        "| largest Δ log-lik |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['requests']} | {r['HFLM_s']:.1f} | {r['SharedContextHFLM_s']:.1f} "
            f"| {r['speedup']:.2f}× | {r['HFLM_tokens']} → {r['SharedContextHFLM_tokens']} "
            f"| {r['max_abs_ll_diff']:.1e} |"
        )
    total_h = sum(r["HFLM_s"] for r in rows)
    total_s = sum(r["SharedContextHFLM_s"] for r in rows)
    lines.append(f"\nAll tasks: {total_h:.1f} s → {total_s:.1f} s ({total_h / total_s:.2f}×).")
    record = {
        "kind": "torq.bench.zeroshot_speed",
        "date": now_iso(),
        "command": command_line(),
        "model": loaded.describe(),
        "rows": rows,
        "versions": versions(),
        "machine": machine_info(),
    }
    save(args.out, record, f"`{record['command']}`\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
