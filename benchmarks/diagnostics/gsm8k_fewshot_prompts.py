"""Whether a GSM8K problem's 5-shot prompt depends on the subset it is asked in: builds
lm-eval's requests for the seeded subsets of ``--sizes`` (``torq.eval.generation``'s draw,
no model) and counts the problems of the smallest whose prompt is the same in each larger
one (docs/research/paper-tables.md §12.1; why ``benchmarks/humaneval_paired.py`` compares
GSM8K rows of one subset only):
``python -m benchmarks.diagnostics.gsm8k_fewshot_prompts --sizes 50,200 --seed 0``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from torq.experimental import (
    GSM8K_FILES,
    GSM8K_TASK,
    gsm8k_task_yaml,
    lm_eval_tasks_dir,
    resolve_data_dir,
)


def prompts(n: int, seed: int, task_dir: Path, total: int) -> dict[int, str]:
    """Each asked problem's prompt in the subset of ``n`` (evaluate_gsm8k's draw and seeds),
    keyed by its index in the test split."""
    from lm_eval.tasks import TaskManager

    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    task = TaskManager(include_path=str(task_dir)).load_task_or_group([GSM8K_TASK])[GSM8K_TASK]
    task.set_fewshot_seed(seed)
    asked = sorted(order[:n])
    task.build_all_requests(samples=asked, rank=0, world_size=1, cache_requests=False)
    # an instance's doc_id is its place in the subset; the record keys the test problem
    return {asked[inst.doc_id]: inst.args[0] for inst in task.instances}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50,200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    root = resolve_data_dir(args.data_dir)
    if root is None:
        raise SystemExit("no data directory: pass --data-dir or set TORQ_DATA_DIR")
    files = {split: (root / rel).resolve() for split, rel in GSM8K_FILES.items()}
    total = sum(1 for _ in files["test"].open(encoding="utf-8"))
    sizes = sorted(int(s) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = Path(tmp)
        builtin = lm_eval_tasks_dir() / "gsm8k" / "gsm8k.yaml"
        (task_dir / "gsm8k.yaml").write_text(gsm8k_task_yaml(builtin, files))
        by_size = {n: prompts(n, args.seed, task_dir, total) for n in sizes}
    small = by_size[sizes[0]]
    for n in sizes[1:]:
        assert set(small) <= set(by_size[n]), "the seeded subsets are nested"
        same = sum(small[q] == by_size[n][q] for q in small)
        print(
            f"seed {args.seed}: of the {len(small)} problems of n={sizes[0]}, {same} have the "
            f"same prompt at n={n}"
        )


if __name__ == "__main__":
    main()
