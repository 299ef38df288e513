"""``benchmarks/carry_status.py``: what each carried row holds, read without a model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_carry_status_lists_the_carried_rows(tmp_path: Path) -> None:
    """``benchmarks/carry_status.py`` reads the kept copies (no model) into one line each."""
    out = tmp_path / "status.json"
    args = [str(ROOT / "benchmarks" / "carry_status.py"), str(ROOT / "docs" / "gsm8k" / "carry")]
    done = subprocess.run(
        [sys.executable, *args, "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["file"] for r in rows} == {p.name for p in (ROOT / "docs/gsm8k/carry").glob("*.npz")}
    # the FP row of the 200-problem comparison is complete in its copy
    fp = next(r for r in rows if r["file"].startswith("gsm8k-fp-"))
    assert fp["generations"] == 200 and fp["answers"] == 0
    assert done.stdout.count("\n| gsm8k-") == len(rows)
    bad = subprocess.run(
        [sys.executable, args[0], str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "not a folder" in bad.stderr


def test_carry_merge_adds_a_second_process_answers_in_one_line(tmp_path: Path) -> None:
    """``benchmarks/carry_merge.py``: the second copy's answers added to the row's, said in
    one line; a refused merge, or the same file twice, is one line of error, no traceback."""
    from tests.eval.test_portable import _generation_copy

    row, helper, other = tmp_path / "row.npz", tmp_path / "helper.npz", tmp_path / "other.npz"
    _generation_copy(row, {"a": "1"}, "EPYC", "t1")
    _generation_copy(helper, {"a": "1", "b": "2"}, "EPYC", "t2")
    _generation_copy(other, {"a": "9"}, "EPYC", "t3")
    script = str(ROOT / "benchmarks" / "carry_merge.py")

    def run(*args: Path) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, script, *map(str, args)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    done = run(helper, row)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"{row}: 1 answers added, 1 held by both (the same), 2 in all"
    for args, needle in (((other, row), "1 answers of"), ((row, row), "one file")):
        bad = run(*args)
        assert bad.returncode != 0 and needle in bad.stderr
        assert "Traceback" not in bad.stderr
