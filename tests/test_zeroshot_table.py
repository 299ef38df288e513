"""``benchmarks/zeroshot_table.py --merge-from``: one table from the records of separate runs,
without scoring anything again (the kept SmolLM2 records in ``docs/records/zeroshot/``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from torq.results import read_record

ROOT = Path(__file__).resolve().parents[1]
# `python -m benchmarks.NAME` finds the package from anywhere
RUN_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_merge_only_record_names_its_own_command(tmp_path: Path) -> None:
    sources = []
    for name in ("smollm2-fp.json", "smollm2-rtn.json"):
        shutil.copy(ROOT / "docs" / "records" / "zeroshot" / name, tmp_path / name)
        sources.append(tmp_path / name)
    out = tmp_path / "merged.json"
    args = [
        "-m", "benchmarks.zeroshot_table",
        "--model", "smollm2-135m",
        "--methods", "fp,rtn",
        "--calib-samples", "32",
        "--merge-from", *map(str, sources),
        "--resume-dir", str(tmp_path / "requests"),
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, *args], env=RUN_ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    merged = read_record(out)
    # the record says which command wrote it, not the first merged run's
    assert merged["command"].startswith("zeroshot_table.py ")
    assert "--merge-from" in merged["command"]
    originals = [read_record(s) for s in sources]
    for original in originals:
        assert original["command"] in merged["commands"]
    assert merged["commands"][-1] == merged["command"]
    assert [r["method"] for r in merged["rows"]] == ["fp", "rtn"]
    for row, original in zip(merged["rows"], originals, strict=True):
        assert row["zeroshot"]["average"] == original["rows"][0]["zeroshot"]["average"]
    assert merged["complete"] is True
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert not (tmp_path / "requests").exists() or not any((tmp_path / "requests").iterdir())
    # the same command again (as a resumed run does) lists it once, still last
    again = subprocess.run(
        [sys.executable, *args], env=RUN_ENV, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-2000:]
    rerun = read_record(out)
    assert len(rerun["commands"]) == len(set(rerun["commands"])) == len(merged["commands"])
    assert rerun["commands"][-1] == rerun["command"]


def test_perplexities_are_reused_only_from_the_same_windows(tmp_path: Path) -> None:
    """``--ppl-from``: a row's perplexity is taken from an earlier record measured on the
    same windows (the full test, or the same first N), never from another set."""
    from benchmarks import zeroshot_table as table

    config = read_record(ROOT / "docs" / "records" / "formats" / "smollm2-nvfp4-16w.json")
    paths = {}
    for windows, ppl, n in ((16, 26.75, 16), (None, 19.5, 140), (8, 30.0, 8)):
        rec = {
            "kind": "torq.run",
            "config": {**config["config"], "max_windows": windows},
            "eval": {"n_windows": n},
            "rows": [{"method": "torq", "ppl": ppl}],
        }
        paths[windows] = tmp_path / f"{windows}.json"
        paths[windows].write_text(json.dumps(rec))
    files = [str(p) for p in paths.values()]
    for windows, ppl, n in ((16, 26.75, 16), (None, 19.5, 140)):
        found = table.earlier_perplexities(files, windows)
        assert list(found.values()) == [(ppl, str(paths[windows]), n)]
    assert table.earlier_perplexities(files, 4) == {}
