"""``benchmarks.scale``: each method runs in its own ``torq run``, with its own flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import scale


def test_a_method_carries_its_own_flags_into_its_run(tmp_path, monkeypatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(scale.subprocess, "run", lambda cmd, check: commands.append(cmd))
    layer = {"load_seconds": 1.0, "forward_seconds": 2.0, "solve_seconds": 3.0, "eval_seconds": 4.0}
    record = {
        "rows": [
            {
                "ppl": 30.0,
                "quantize_seconds": 9.0,
                "eval_seconds": 4.0,
                "details": {
                    "streamed": {"per_layer": [layer, layer]},
                    "calibration_seconds": {"capture_forward": 4.0, "solve": 6.0},
                },
            }
        ],
        "peak_memory": {"host_rss_bytes": 2**30},
    }
    monkeypatch.setattr(scale, "read_record", lambda _out: record)
    args = argparse.Namespace(
        reload="", resume_dir=None, eval_windows=1, calib_samples=8, threads=1, dir=str(tmp_path)
    )
    spec = "torq-had32+gptq --fold-balance --act-order"
    row = scale.run_method(Path("/m"), spec, args, tmp_path / "r.json")
    (cmd,) = commands
    assert cmd[cmd.index("--methods") + 1] == "torq-had32+gptq"
    assert cmd[-2:] == ["--fold-balance", "--act-order"]
    assert row["method"] == spec and row["calibration_seconds"]["solve"] == 6.0
    assert row["seconds_per_layer"]["forward_seconds"] == 2.0
