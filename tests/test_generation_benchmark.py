"""``benchmarks/humaneval.py --resume-dir``: a method's quantized model and its answers are
kept, so the same command again neither calibrates nor generates what it already has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[1]


def test_the_same_command_again_reuses_the_kept_model_and_answers(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    out, resume = tmp_path / "gsm8k.json", tmp_path / "resume"
    args = [
        str(ROOT / "benchmarks" / "humaneval.py"),
        "--task", "gsm8k", "--n", "2",
        "--model", str(tiny_checkpoint),
        "--methods", "rtn",
        "--data-dir", str(SHARED_DATA),
        "--resume-dir", str(resume),
        "--out", str(out),
    ]  # fmt: skip
    rows = []
    for _ in range(2):
        out.unlink(missing_ok=True)  # the record would skip the method: run it again
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        rows.append(json.loads(out.read_text())["rows"][0])
    first, again = rows
    (kept,) = resume.glob("gsm8k-rtn-*")
    assert (kept / "quantized-model.pt").is_file()
    # reloaded, not quantized again: the row reports the first session's calibration time
    assert again["quantize_seconds"] == first["quantize_seconds"]
    assert first["request_cache"]["entries_before"] == 0
    assert first["request_cache"]["entries_after"] == 2
    assert again["request_cache"]["entries_before"] == 2  # nothing generated again
    assert again["answers"] == first["answers"]


def _record(path: Path, method: str, passed: list[int]) -> Path:
    tasks = {f"HumanEval/{i}": {"pass@1": float(p)} for i, p in enumerate(passed)}
    row = {"method": method, "pass@1": sum(passed) / len(passed), "problems": len(passed)}
    record = {"task": "humaneval", "model": "m", "rows": [{**row, "tasks": tasks}]}
    path.write_text(json.dumps(record))
    return path


def test_humaneval_rows_are_compared_problem_by_problem(tmp_path: Path) -> None:
    """Each row against the reference (FP) on the same problems: the paired difference,
    the problems only one of the two solves and McNemar's p; a method in two records is
    refused."""
    fp = _record(tmp_path / "fp.json", "fp", [1, 1, 1, 0, 1, 0])
    q = _record(tmp_path / "q.json", "q", [1, 0, 0, 0, 1, 1])
    out = tmp_path / "paired.json"
    script = str(ROOT / "benchmarks" / "humaneval_paired.py")
    done = subprocess.run(
        [sys.executable, script, str(fp), str(q), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (pair,) = json.loads(out.read_text())["pairs"]
    assert (pair["a"], pair["b"], pair["n"]) == ("q", "fp", 6)
    assert (pair["only_a"], pair["only_b"]) == (1, 2)
    assert abs(pair["diff"] - (3 / 6 - 4 / 6)) < 1e-12
    assert abs(pair["p_mcnemar"] - 1.0) < 1e-12  # 1 against 2: binomial, two-sided
    twice = subprocess.run(
        [sys.executable, script, str(fp), str(fp), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert twice.returncode != 0 and "more than one record" in twice.stderr
