"""Paired, question-by-question comparison of two rows of the zero-shot table.

Two methods are scored on the same questions, so the difference of their accuracies is
best judged question by question: most questions are answered alike by both, and only the
ones they disagree on make the difference. lm-eval reports each row's own standard error;
treating two rows as independent (``√(s₁² + s₂²)``) overstates the error of their
difference when their answers are correlated, as the rows of one model's quantizations are.

:func:`build_questions` rebuilds lm-eval's requests for the paper's tasks (the same
offline configs as :func:`torq.eval.zeroshot.evaluate_zeroshot`); :func:`question_scores`
looks up each request's kept answer (keyed by lm-eval's request hash, :func:`answer_key`)
and scores every question with the task's own ``process_results``: the headline metric
per question (``acc_norm`` where the task has it, else ``acc``), so the mean over a
task's questions is exactly lm-eval's number.
:func:`paired_difference` compares two such rows on the questions both have: the mean
difference, its paired standard error and the exact McNemar test on the questions only one
of the two gets right.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torq.errors import TorqError
from torq.eval.zeroshot import PAPER_TASKS, from_hub, parse_tasks, prepare_tasks

QuestionScores = dict[str, dict[int, float]]  # task → doc id → 0/1 (the headline metric)
Answer = tuple[float, bool]  # a log-likelihood request's answer: (log-likelihood, greedy)


def answer_key(args: Iterable[Any], attr: str = "loglikelihood") -> int:
    """The first 64 bits of lm-eval's cache key for a request (``hash_args``: SHA-256 of the
    JSON of ``[attr, *args]``). 64 bits keep the chance of any collision among a table's
    ~66 000 answers below 10⁻¹⁰."""
    from lm_eval.api.model import hash_args

    return int(hash_args(attr, args)[:16], 16)


@dataclass
class TaskQuestions:
    """One task's questions as lm-eval asks them: per question (doc id) the document and
    the keys (:func:`answer_key`) of its requests, in lm-eval's order."""

    task: Any  # lm-eval's Task: its ``process_results`` scores a question
    questions: dict[int, tuple[Any, list[int]]]


def build_questions(
    tasks: list[str] | None = None, data_dir: str | None = None, limit: int | None = None
) -> dict[str, TaskQuestions]:
    """Rebuild lm-eval's requests for the paper's ``tasks`` (all six by default), with the
    same offline configs as :func:`torq.eval.zeroshot.evaluate_zeroshot`, so their keys are
    those of the kept answers."""
    from lm_eval.tasks import TaskManager

    names = [parse_tasks(t)[0] for t in tasks] if tasks else list(PAPER_TASKS)
    built: dict[str, TaskQuestions] = {}
    with tempfile.TemporaryDirectory(prefix="torq-paired-") as tmp:
        run_names = prepare_tasks(names, data_dir, Path(tmp))
        manager = TaskManager(include_path=tmp, include_defaults=from_hub(run_names))
        if hasattr(manager, "load"):  # newer lm-eval; get_task_dict is deprecated there
            task_objs = manager.load(list(run_names.values()))["tasks"]
        else:
            from lm_eval.tasks import get_task_dict

            task_objs = get_task_dict(list(run_names.values()), manager)
        for name, run_name in run_names.items():
            task = task_objs[run_name]
            task.build_all_requests(limit=limit, rank=0, world_size=1)
            by_doc: dict[int, list[Any]] = {}
            for inst in task.instances:
                by_doc.setdefault(inst.doc_id, []).append(inst)
            questions = {}
            for doc_id, insts in by_doc.items():
                insts.sort(key=lambda i: i.idx)
                questions[doc_id] = (insts[0].doc, [answer_key(i.args) for i in insts])
            built[name] = TaskQuestions(task, questions)
    return built


def question_scores(
    answers: Mapping[int, Answer], questions: Mapping[str, TaskQuestions]
) -> tuple[QuestionScores, dict[str, int]]:
    """Score every question from kept answers with lm-eval's own per-question rule
    (``task.process_results``), keeping the headline metric: ``acc_norm`` where defined,
    else ``acc``, as :func:`torq.eval.zeroshot.headline_scores` does.

    ``answers`` maps :func:`answer_key` of a request to its
    ``(log-likelihood, greedy)``; ``questions`` comes from :func:`build_questions`. A
    question with any request unanswered is left out (a row still being scored); the
    second value returned counts them per task.
    """
    scores: QuestionScores = {}
    missing: dict[str, int] = {}
    for name, tq in questions.items():
        scores[name] = {}
        missing[name] = 0
        for doc_id, (doc, keys) in tq.questions.items():
            if any(k not in answers for k in keys):
                missing[name] += 1
                continue
            result = tq.task.process_results(doc, [answers[k] for k in keys])
            metric = "acc_norm" if "acc_norm" in result else "acc"
            scores[name][doc_id] = float(result[metric])
    return scores, missing


@dataclass(frozen=True)
class PairedTask:
    """Two rows on one task's shared questions (accuracies as fractions)."""

    n: int  # questions both rows have
    mean_a: float
    mean_b: float
    diff: float  # mean_a − mean_b
    stderr: float  # paired: std(a_i − b_i) / √n
    only_a: int  # questions a gets right and b does not
    only_b: int
    p_mcnemar: float  # exact two-sided McNemar (binomial on only_a vs only_b)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of ``only_a`` successes in
    ``only_a + only_b`` discordant questions at p = ½."""
    if only_a < 0 or only_b < 0:
        raise TorqError("McNemar counts must be non-negative")
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> PairedTask:
    """Compare two rows' per-question scores on the questions both have."""
    shared = sorted(set(a) & set(b))
    n = len(shared)
    if n == 0:
        raise TorqError("the two rows have no question in common")
    da = [a[q] for q in shared]
    db = [b[q] for q in shared]
    d = [x - y for x, y in zip(da, db, strict=True)]
    mean_d = sum(d) / n
    var = sum((x - mean_d) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    only_a = sum(1 for x, y in zip(da, db, strict=True) if x > y)
    only_b = sum(1 for x, y in zip(da, db, strict=True) if y > x)
    return PairedTask(
        n=n,
        mean_a=sum(da) / n,
        mean_b=sum(db) / n,
        diff=mean_d,
        stderr=math.sqrt(var / n),
        only_a=only_a,
        only_b=only_b,
        p_mcnemar=mcnemar_exact(only_a, only_b),
    )


def compare_rows(a: QuestionScores, b: QuestionScores) -> dict[str, Any]:
    """Per-task :func:`paired_difference` of two rows and the difference of their averages
    (the unweighted mean over tasks, as the table's "Avg"), whose standard error combines
    the tasks' paired errors (the tasks' questions are independent of each other)."""
    tasks = [t for t in a if t in b]
    if not tasks:
        raise TorqError("the two rows have no task in common")
    per_task = {t: paired_difference(a[t], b[t]) for t in tasks}
    diff = sum(p.diff for p in per_task.values()) / len(tasks)
    stderr = math.sqrt(sum(p.stderr**2 for p in per_task.values())) / len(tasks)
    return {
        "tasks": {t: asdict(p) for t, p in per_task.items()},
        "average": {"diff": diff, "stderr": stderr, "z": diff / stderr if stderr else None},
    }
