"""Question-by-question comparison of zero-shot rows (``torq.eval.paired``)."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from torq.errors import TorqError
from torq.eval import zeroshot as zs
from torq.eval.paired import (
    build_questions,
    compare_rows,
    mcnemar_exact,
    paired_difference,
    question_scores,
)
from torq.runs.store import FolderStore

pytest.importorskip("lm_eval")

from tests.eval.test_zeroshot import _zeroshot_dir
from torq.results import read_record

REPO = Path(__file__).resolve().parents[2]


def _paired_benchmark(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from benchmarks import zeroshot_paired

    return zeroshot_paired


def test_mcnemar_exact_is_the_two_sided_binomial_test() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 2**5)
    assert mcnemar_exact(0, 5) == mcnemar_exact(5, 0)
    assert mcnemar_exact(3, 3) == 1.0
    # 10 discordant, 2 against 8: 2 · P(X ≤ 2), X ~ Bin(10, ½) = 2 · 56 / 1024
    assert mcnemar_exact(2, 8) == pytest.approx(112 / 1024)
    # large counts stay finite and small
    assert 0.0 <= mcnemar_exact(100, 300) < 1e-20
    with pytest.raises(TorqError):
        mcnemar_exact(-1, 2)


def test_paired_difference_on_shared_questions() -> None:
    a = {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}
    b = {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0, 9: 1.0}  # question 9 only in b: left out
    p = paired_difference(a, b)
    assert p.n == 4 and p.only_a == 1 and p.only_b == 2
    assert p.mean_a == 0.5 and p.mean_b == 0.75 and p.diff == -0.25
    # d = [0, 1, −1, −1]: sample variance 2.75 / 3, error √(var / 4)
    assert p.stderr == pytest.approx(math.sqrt(2.75 / 3 / 4))
    assert p.p_mcnemar == 1.0
    with pytest.raises(TorqError, match="no question in common"):
        paired_difference({0: 1.0}, {1: 1.0})
    same = compare_rows({"piqa": a}, {"piqa": dict(a)})
    assert same["average"]["diff"] == 0 and same["tasks"]["piqa"]["p_mcnemar"] == 1.0


def _lambada(root: Path) -> None:
    lines = [
        json.dumps({"text": f"The cat number {i} sat on the warm mat and then it went to sleep"})
        for i in range(5)
    ]
    (root / "zeroshot" / "lambada_openai_test.jsonl").write_text("\n".join(lines) + "\n")


def test_kept_answers_are_scored_as_lm_eval_scores_them(
    tiny_checkpoint, tiny_data_dir, tmp_path, monkeypatch
) -> None:
    """One evaluation of a tiny model (its answers kept in a resume folder): every question
    scored again from the kept answers gives lm-eval's numbers; a row with a missing answer
    leaves that question out; the benchmark script compares two kept rows end to end."""
    from torq.models import load

    bench = _paired_benchmark(monkeypatch)
    data = _zeroshot_dir(tiny_data_dir)
    _lambada(data)
    lm = load(str(tiny_checkpoint))
    resume = tmp_path / "resume" / "tiny"
    fp_dir = resume / "fp-0123abcd"
    tasks = ["arc_easy", "piqa", "lambada_openai"]
    out = zs.evaluate_zeroshot(
        lm.model, lm.tokenizer, tasks, data_dir=str(data), progress=False, store=FolderStore(fp_dir)
    )
    answers = bench.kept_answers(fp_dir)
    questions = build_questions(tasks, str(data))
    scores, missing = question_scores(answers, questions)
    assert missing == {t: 0 for t in tasks}
    assert {t: len(s) for t, s in scores.items()} == {"arc_easy": 6, "piqa": 6, "lambada_openai": 5}
    for t in tasks:
        values = list(scores[t].values())
        assert set(values) <= {0.0, 1.0}
        # each question scored with lm-eval's own rule: the task means are its numbers
        assert sum(values) / len(values) == pytest.approx(out["scores"]["tasks"][t]["value"])

    # a row still being scored: a question with a missing answer is left out, not guessed
    dropped = dict(answers)
    dropped.pop(next(iter(dropped)))
    partial, missing = question_scores(dropped, questions)
    assert sum(missing.values()) == 1
    assert sum(len(s) for s in partial.values()) == 16
    cmp = compare_rows(scores, partial)
    assert all(p["diff"] == 0 and p["only_a"] == p["only_b"] == 0 for p in cmp["tasks"].values())
    assert sum(p["n"] for p in cmp["tasks"].values()) == 16

    # a second row whose every log-likelihood is negated picks the other PIQA solution on
    # every question (both rules: acc compares ll, acc_norm ll / length)
    flip = resume / "flip-4567ef01"
    shutil.copytree(fp_dir, flip)
    con = sqlite3.connect(flip / bench.ANSWERS_DB)
    with con:
        for key, value in con.execute("SELECT key, value FROM unnamed").fetchall():
            answer = pickle.loads(value)
            if isinstance(answer, tuple) and len(answer) == 2:
                negated = pickle.dumps((-answer[0], answer[1]))
                con.execute("UPDATE unnamed SET value = ? WHERE key = ?", (negated, key))
    con.close()
    shutil.copytree(fp_dir, resume / "fp+x-0123abcd")  # another method: must not match
    record_path = tmp_path / "paired.json"
    cmd = [
        sys.executable, "-m", "benchmarks.zeroshot_paired", "--model", "tiny",
        "--methods", "fp,flip", "--tasks", "piqa", "--resume-dir", str(tmp_path / "resume"),
        "--data-dir", str(data), "--out", str(record_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # python -m benchmarks.NAME from anywhere
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    record = read_record(record_path)
    assert record["command"].startswith("zeroshot_paired.py --model tiny")
    right = int(sum(scores["piqa"].values()))
    assert record["methods"]["fp"]["means"]["piqa"] == pytest.approx(right / 6)
    assert record["methods"]["flip"]["means"]["piqa"] == pytest.approx(1 - right / 6)
    pair = record["pairs"][0]
    assert (pair["a"], pair["b"]) == ("fp", "flip")
    p = pair["tasks"]["piqa"]
    assert (p["n"], p["only_a"], p["only_b"]) == (6, right, 6 - right)
    assert p["diff"] == pytest.approx((2 * right - 6) / 6)
    assert p["p_mcnemar"] == pytest.approx(mcnemar_exact(right, 6 - right))
    assert record_path.with_suffix(".md").read_text().startswith("`zeroshot_paired.py")

    bad = subprocess.run(
        [*cmd[:6], "fp,absent", *cmd[7:]], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert bad.returncode != 0 and "no kept answers for 'absent'" in bad.stderr
    # two settings of one method: named by the folder's hash
    shutil.copytree(fp_dir, resume / "fp-89abcdef")
    with pytest.raises(TorqError, match="several kept settings"):
        bench.method_folder(tmp_path / "resume", "tiny", "fp")
    assert bench.method_folder(tmp_path / "resume", "tiny", "fp@89abcdef").name == "fp-89abcdef"


def test_a_seeded_subset_scores_the_drawn_questions_and_pairs_with_a_full_row(
    tiny_checkpoint, tiny_data_dir, tmp_path, monkeypatch
) -> None:
    """``subset=`` scores exactly the questions :func:`seeded_subset` draws (found again from
    the kept answers), its task means are the mean over those questions, and a full row
    of the same model pairs with it on them alone, with no difference."""
    from torq.models import load

    bench = _paired_benchmark(monkeypatch)
    data = _zeroshot_dir(tiny_data_dir)
    lm = load(str(tiny_checkpoint))
    tasks = ["arc_easy", "piqa"]
    drawn = zs.seeded_subset(tasks, 3, 5, str(data))
    part = zs.evaluate_zeroshot(
        lm.model, lm.tokenizer, tasks, data_dir=str(data), progress=False, subset=3,
        subset_seed=5, store=FolderStore(tmp_path / "part"),
    )  # fmt: skip
    assert part["subset"] == {"n": 3, "seed": 5, "questions": {"arc_easy": 3, "piqa": 3}}
    assert part["request_cache"]["entries_after"] == 3 * 4 + 3 * 2
    questions = build_questions(tasks, str(data))
    scores, missing = question_scores(bench.kept_answers(tmp_path / "part"), questions)
    assert {t: sorted(s) for t, s in scores.items()} == drawn
    assert missing == {"arc_easy": 3, "piqa": 3}
    for t in tasks:
        mean = sum(scores[t].values()) / 3
        assert mean == pytest.approx(part["scores"]["tasks"][t]["value"])

    zs.evaluate_zeroshot(
        lm.model, lm.tokenizer, tasks, data_dir=str(data), progress=False,
        store=FolderStore(tmp_path / "full"),
    )  # fmt: skip
    full, _ = question_scores(bench.kept_answers(tmp_path / "full"), questions)
    cmp = compare_rows(full, scores)
    assert {t: p["n"] for t, p in cmp["tasks"].items()} == {"arc_easy": 3, "piqa": 3}
    assert all(p["diff"] == 0 for p in cmp["tasks"].values())
