"""HumanEval scored in torq: pass@k, the problems' own solutions through the sandbox."""

from __future__ import annotations

import pytest

from tests.eval.test_sandbox import QUICK, needs_isolation


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    from torq.eval.humaneval import pass_at_k

    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 − C(7,5)/C(10,5)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer failures than draws
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


@needs_isolation
def test_humaneval_canonical_solutions_pass_and_wrong_ones_do_not() -> None:
    """The problems' own solutions score 100 % through the sandbox (the first 12 here;
    ``benchmarks/humaneval_canonical.py`` runs all 164), a wrong or hostile completion 0."""
    from tests.conftest import SHARED_DATA
    from torq.eval.humaneval import load_humaneval, score

    if not (SHARED_DATA / "humaneval").is_dir():
        pytest.fail(f"HumanEval is expected in {SHARED_DATA}/humaneval (../shared/data)")
    problems = load_humaneval(SHARED_DATA)
    assert len(problems) == 164
    some = problems[:12]
    right = score(some, {p.task_id: [p.canonical_solution] for p in some})
    assert right["pass@1"] == 1.0 and right["problems"] == 12
    wrong = score(
        some[:3],
        {
            some[0].task_id: ["    return None\n"],
            some[1].task_id: ["    while True:\n        pass\n"],
            some[2].task_id: ["    import os\n    os.system('rm -rf /')\n"],
        },
        limits=QUICK,
    )
    assert wrong["pass@1"] == 0.0
    assert wrong["tasks"][some[1].task_id]["first_failure"] == "killed (a limit was reached)"
    assert wrong["tasks"][some[0].task_id]["first_failure"] == "AssertionError"
