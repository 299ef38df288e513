"""``benchmarks/diagnostics/carry_scores.py``: a carried row scored again without its model."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from tests.eval.test_sandbox import needs_isolation

ROOT = Path(__file__).resolve().parents[1]


def _script():  # type: ignore[no-untyped-def]
    path = ROOT / "benchmarks" / "diagnostics" / "carry_scores.py"
    spec = importlib.util.spec_from_file_location("carry_scores", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_isolation
def test_a_carried_row_scores_as_it_did_and_a_foreign_subset_is_refused(
    tiny_tokenizer, tmp_path: Path
) -> None:
    """A HumanEval copy's problems score, replayed, as the run that made them scored them
    (pass@1 per problem); a GSM8K copy made with other generation settings finds none of
    its requests and is refused rather than scored as if it had none."""
    from tests.conftest import SHARED_DATA, tiny_model
    from torq.eval.generation import evaluate_gsm8k, evaluate_humaneval
    from torq.eval.portable import load_portable
    from torq.eval.resume import record_setting

    model = tiny_model("llama")
    data = str(SHARED_DATA)
    cache = tmp_path / "he"
    record_setting(cache, json.dumps({"method": "fp", "task": "humaneval", "max_gen_toks": 6}))
    made = evaluate_humaneval(
        model, tiny_tokenizer, data, 2, 6, request_cache=cache, portable=tmp_path / "he.npz"
    )
    args = argparse.Namespace(data_dir=data, n=2, seed=0)
    script = _script()
    he = tmp_path / "he.npz"
    row = script.carried_scores("humaneval", he, load_portable(he), model, tiny_tokenizer, args)
    assert row["answers"] == 2
    assert row["scores"]["pass@1"] == {t: r["pass@1"] for t, r in made["tasks"].items()}

    evaluate_gsm8k(model, tiny_tokenizer, data, n=2, gen_kwargs="max_gen_toks=4",
                   request_cache=tmp_path / "g", portable=tmp_path / "g.npz")  # fmt: skip
    with pytest.raises(SystemExit, match="holds 2 answers but 0 were asked for"):
        g = tmp_path / "g.npz"
        script.carried_scores("gsm8k", g, load_portable(g), model, tiny_tokenizer, args)


def test_two_copies_of_a_row_are_compared_problem_by_problem() -> None:
    """Two copies of one row: the answers both hold and how many are the same text, and
    the paired difference on the problems both answered (one only the first solved, one
    only the second, one both; the problem only the first answered is left out)."""
    script = _script()
    first = {"t0": 1.0, "t1": 0.0, "t2": 1.0, "t3": 1.0}
    second = {"t0": 0.0, "t1": 1.0, "t2": 1.0}
    rows = [
        {"carry": "a.npz", "cpus": ["Intel"], "scores": {"pass@1": first}},
        {"carry": "b.npz", "cpus": ["AMD"], "scores": {"pass@1": second}},
    ]
    copies = [{1: "x", 2: "y", 3: "z", 4: "w"}, {1: "x", 2: "Y", 3: "z"}]
    record: dict = {}
    lines = script.compare_copies(rows, copies, record)
    assert record["answers_shared"] == 3 and record["answers_identical"] == 2
    paired = record["paired"]["pass@1"]
    assert paired["n"] == 3 and paired["only_a"] == 1 and paired["only_b"] == 1
    assert paired["diff"] == 0.0 and paired["p_mcnemar"] == 1.0
    assert lines[0] == "a.npz (Intel): pass@1 75.0 % of 4"
    one: dict = {}
    assert len(script.compare_copies(rows[:1], copies[:1], one)) == 1 and one == {}
