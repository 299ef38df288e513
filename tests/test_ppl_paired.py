"""``benchmarks/ppl_paired.py``: rows of separate runs on one window sample, compared window
by window; records on other windows are refused."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from torq.results import read_record

ROOT = Path(__file__).resolve().parents[1]
# `python -m benchmarks.NAME` finds the package from anywhere
RUN_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _record(path: Path, ids: list[int], rows: dict[str, list[float]]) -> Path:
    seqlen = 11
    record = {
        "model": {"model_type": "llama", "num_hidden_layers": 2, "num_parameters": 99},
        "eval": {
            "dataset": "wikitext-2-raw test",
            "seqlen": seqlen,
            "n_windows": len(ids),
            "window_sample": {"n": len(ids), "seed": 0, "of": 20, "ids": ids},
        },
        "rows": [
            {
                "method": m,
                "ppl": math.exp(sum(nll) / (len(nll) * (seqlen - 1))),
                "details": {"perplexity": {"window_nll": nll}},
            }
            for m, nll in rows.items()
        ],
    }
    path.write_text(json.dumps(record))
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    script = "-m", "benchmarks.ppl_paired"
    return subprocess.run(
        [sys.executable, *script, *args], env=RUN_ENV, capture_output=True, text=True, timeout=300
    )


def test_rows_of_two_records_compare_with_the_reference(tmp_path: Path) -> None:
    ids = [1, 4, 7, 9]
    fp = [20.0, 30.0, 25.0, 22.0]
    a = _record(tmp_path / "a.json", ids, {"fp": fp, "rtn": [x + 5.0 for x in fp]})
    b = _record(tmp_path / "b.json", ids, {"default": [x + 1.0 for x in fp]})
    out = tmp_path / "paired.json"
    done = _run(str(a), str(b), "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = {r["row"]: r for r in read_record(out)["rows"]}
    # the same difference on every window: the ratio is exact, its interval a point
    assert rows["b:default"]["ratio"] == math.exp(1.0 / 10)
    assert rows["a:rtn"]["ratio"] == math.exp(5.0 / 10)
    assert rows["a:rtn"]["low"] == rows["a:rtn"]["high"]
    assert rows["a:rtn"]["population"] == 20
    assert "4 windows drawn of 20" in out.with_suffix(".md").read_text()


def test_records_on_other_windows_are_refused(tmp_path: Path) -> None:
    a = _record(tmp_path / "a.json", [1, 4, 7], {"fp": [1.0, 2.0, 3.0]})
    b = _record(tmp_path / "b.json", [1, 4, 8], {"rtn": [2.0, 3.0, 4.0]})
    done = _run(str(a), str(b), "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2
    assert "scored other windows" in done.stderr and "Traceback" not in done.stderr


def test_a_peer_scripts_record_pairs_with_a_torq_run(tmp_path: Path) -> None:
    ids = [2, 5, 6]
    fp = [20.0, 30.0, 25.0]
    torq_run = _record(tmp_path / "torq.json", ids, {"fp": fp})
    record = read_record(torq_run)
    peer = {
        "peer": "wush",
        "model": {"name": "tiny", **record["model"]},
        "eval": record["eval"],
        "quantized": {"ppl": 9.0, "window_nll": [x + 2.0 for x in fp]},
    }
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    out = tmp_path / "paired.json"
    done = _run(
        str(torq_run), str(tmp_path / "peer.json"), "--reference", "torq:fp", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    rows = {r["row"]: r for r in read_record(out)["rows"]}
    assert rows["peer:wush"]["ratio"] == math.exp(2.0 / 10)
    # another model's record on the same window ids is refused
    peer["model"]["num_parameters"] = 100
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    done = _run(str(torq_run), str(tmp_path / "peer.json"), "--out", str(out))
    assert done.returncode == 2 and "scored other windows" in done.stderr
