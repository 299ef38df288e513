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
