"""``benchmarks/zeroshot_table.py --merge-from``: one table from the records of separate runs,
without scoring anything again (the kept SmolLM2 records in ``docs/zeroshot/``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_merge_only_record_names_its_own_command(tmp_path: Path) -> None:
    sources = []
    for name in ("smollm2-fp.json", "smollm2-rtn.json"):
        shutil.copy(ROOT / "docs" / "zeroshot" / name, tmp_path / name)
        sources.append(tmp_path / name)
    out = tmp_path / "merged.json"
    args = [
        str(ROOT / "benchmarks" / "zeroshot_table.py"),
        "--model", "smollm2-135m",
        "--methods", "fp,rtn",
        "--calib-samples", "32",
        "--merge-from", *map(str, sources),
        "--resume-dir", str(tmp_path / "requests"),
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    merged = json.loads(out.read_text())
    # the record says which command wrote it, not the first merged run's
    assert merged["command"].startswith("zeroshot_table.py ")
    assert "--merge-from" in merged["command"]
    originals = [json.loads(s.read_text()) for s in sources]
    for original in originals:
        assert original["command"] in merged["commands"]
    assert merged["commands"][-1] == merged["command"]
    assert [r["method"] for r in merged["rows"]] == ["fp", "rtn"]
    for row, original in zip(merged["rows"], originals, strict=True):
        assert row["zeroshot"]["average"] == original["rows"][0]["zeroshot"]["average"]
    assert merged["complete"] is True
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert not (tmp_path / "requests").exists() or not any((tmp_path / "requests").iterdir())
