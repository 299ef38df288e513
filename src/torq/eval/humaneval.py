"""HumanEval (the paper's Table 4) scored in torq: each completion's program run isolated
(:mod:`torq.eval.sandbox`), pass@k by the unbiased estimator.

lm-eval's ``humaneval`` task scores through a metric it loads from the hub at run time,
which this project cannot reach; the program it runs is the same: the problem's prompt, the
completion, the problem's tests and ``check(<entry point>)`` (Chen et al., 2021).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import Any

from torq.data import resolve_data_dir
from torq.errors import TorqError
from torq.eval.sandbox import SandboxLimits, run_untrusted

HUMANEVAL = Path("humaneval") / "HumanEval.jsonl.gz"
FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem as its ``.jsonl.gz`` holds it."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str


def load_humaneval(data_dir: str | os.PathLike[str] | None = None) -> list[Problem]:
    """The 164 problems of ``<data-dir>/humaneval/HumanEval.jsonl.gz``."""
    root = resolve_data_dir(data_dir)
    if root is None:
        raise TorqError("HumanEval needs a data directory (--data-dir or $TORQ_DATA_DIR)")
    path = root / HUMANEVAL
    if not path.is_file():
        raise TorqError(f"HumanEval file not found: expected {path}")
    problems = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            missing = [k for k in FIELDS if k not in row]
            if missing:
                raise TorqError(f"{path}: a problem lacks {', '.join(missing)}")
            problems.append(Problem(**{k: row[k] for k in FIELDS}))
    return problems


def check_program(problem: Problem, completion: str) -> str:
    """The program that decides a completion: prompt, completion, tests, ``check(f)``."""
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` pass:
    ``1 − C(n−c, k) / C(n, k)`` (Chen et al., 2021, Eq. 1)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def score(
    problems: list[Problem],
    completions: dict[str, list[str]],
    k: int = 1,
    limits: SandboxLimits | None = None,
) -> dict[str, Any]:
    """pass@k over the problems that have completions, each run isolated; per problem the
    number of samples, how many passed and why the first failure failed."""
    per_task: dict[str, Any] = {}
    for problem in problems:
        samples = completions.get(problem.task_id)
        if not samples:
            continue
        results = [run_untrusted(check_program(problem, s), limits) for s in samples]
        passed = sum(r.passed for r in results)
        failure = next((r.reason for r in results if not r.passed), None)
        per_task[problem.task_id] = {
            "n": len(results),
            "passed": passed,
            f"pass@{k}": pass_at_k(len(results), passed, k),
            "first_failure": failure,
        }
    if not per_task:
        raise TorqError("no completions to score")
    mean = sum(t[f"pass@{k}"] for t in per_task.values()) / len(per_task)
    return {f"pass@{k}": mean, "problems": len(per_task), "tasks": per_task}
