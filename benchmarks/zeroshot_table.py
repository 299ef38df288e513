"""The paper's full results table for one model: WikiText-2 perplexity and the six
zero-shot tasks (lm-eval, 0-shot) for every method, plus the Figure-1-style PNG.

python benchmarks/zeroshot_table.py --model smollm2-135m --methods fp,rtn,had32,gptq,torq \
    --out results/zeroshot/smollm2.json            # full tasks: hours on 2 CPU cores
python benchmarks/zeroshot_table.py --limit 50 ... # a subset (the table says so)

Writes the JSON record (per method: PPL, headline scores, lm-eval's full output, wall
times), a markdown table beside it, and the figure as ``<out>.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save
from torq.calibration.data import CalibrationConfig
from torq.eval.figure import accuracy_perplexity_figure
from torq.eval.zeroshot import parse_tasks
from torq.methods.torq_rotation import TorqSettings
from torq.pipeline import RunConfig, markdown_table, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="fp,rtn,had32,gptq,torq")
    p.add_argument("--format", default="mxfp4")
    p.add_argument("--tasks", default="all")
    p.add_argument("--limit", type=int, default=None, help="first N examples per task")
    p.add_argument("--max-windows", type=int, default=None, help="WikiText-2 windows")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--task-batch-size", type=int, default=8)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="results/zeroshot/table.json")
    args = p.parse_args()
    config = RunConfig(
        model=args.model,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        weight_format=args.format,
        act_format=args.format,
        max_windows=args.max_windows,
        data_dir=args.data_dir,
        torq=TorqSettings(calibration=CalibrationConfig(n_samples=args.calib_samples)),
        tasks=parse_tasks(args.tasks),
        task_limit=args.limit,
        task_batch_size=args.task_batch_size,
    )
    result = run(config)
    table = markdown_table(result)
    seconds = "\n".join(
        f"- {r['method']}: quantize {r['quantize_seconds']:.0f} s, perplexity "
        f"{r['eval_seconds']:.0f} s, zero-shot {r['zeroshot']['seconds']:.0f} s"
        for r in result["rows"]
    )
    path = save(args.out, result, f"`{result['command']}`\n\n{table}\n\nWall times:\n{seconds}")
    figure = accuracy_perplexity_figure(result, path.with_suffix(".png"))
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
