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
