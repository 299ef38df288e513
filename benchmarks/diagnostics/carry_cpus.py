"""Name the CPU of the carried sessions that ran before torq recorded it (2026-11-28).

A quantized row goes on only on the kind of CPU it was started on (docs/RESULTS.md §12.5;
``torq.eval.portable.check_sessions_cpu``), so each session of a portable copy now records
its CPU. The sessions before that name none. Each record (``docs/**/*.json``) names the
machine it was made on, and those records give these periods:

* up to 2026-11-24T08:55 every record names an ``AMD EPYC``;
* from 2026-11-25T04:35 to 2026-11-27T23:22 every record names an
  ``Intel(R) Xeon(R) Processor``;
* from 2026-11-28 this session's machine, an ``AMD EPYC`` (read here, not assumed).

A session started inside one of these periods gets that period's CPU; one started between
them (none is) keeps none. ``--check`` only lists what would change.

    python benchmarks/diagnostics/carry_cpus.py docs/*/carry [--resume results/x/resume/...]

``--resume DIR``: also the ``meta.json`` of running rows' resume directories (their
heartbeat reads the file again, so the CPU stays and reaches their next copy).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from torq.eval.portable import load_portable
from torq.eval.resume import write_json_atomic
from torq.results import cpu_model

AMD, INTEL = "AMD EPYC", "Intel(R) Xeon(R) Processor"
# (first start, last start, CPU): ISO times compare as text
PERIODS = (
    ("2026-11-22T00:00:00", "2026-11-24T12:00:00", AMD),
    ("2026-11-25T00:00:00", "2026-11-28T00:00:00", INTEL),
)
THIS_SESSION = "2026-11-28T00:00:00"


def cpu_of(started: str | None) -> str | None:
    """The CPU a session started at ``started`` ran on, from the periods above."""
    if not started:
        return None
    if started >= THIS_SESSION:
        here = cpu_model()
        if here != AMD:  # the script describes this session's machine only
            raise SystemExit(f"carry_cpus: this machine is a {here}, not the session's {AMD}")
        return here
    for first, last, cpu in PERIODS:
        if first <= started < last:
            return cpu
    return None


def named(sessions: list[dict]) -> int:
    """Give each session without a CPU its period's; how many were named."""
    count = 0
    for session in sessions:
        if "cpu" not in session:
            cpu = cpu_of(session.get("started"))
            if cpu is not None:
                session["cpu"] = cpu
                count += 1
    return count


def rewrite_copy(path: Path, check: bool) -> int:
    """Name the CPUs in the portable copy ``path``; its answers are written back as read."""
    meta = load_portable(path)["meta"]
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in ("keys", "loglik", "greedy")}
        raw = json.loads(str(z["meta"]))
    count = named(raw.get("sessions", []))
    assert len(raw.get("sessions", [])) == len(meta.get("sessions", []))
    if count and not check:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays, meta=np.asarray(json.dumps(raw)))
        os.replace(tmp, path)
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--resume", nargs="*", type=Path, default=[])
    ap.add_argument("--check", action="store_true", help="list, change nothing")
    args = ap.parse_args()
    for folder in args.folders:
        for path in sorted(folder.glob("*.npz")):
            count = rewrite_copy(path, args.check)
            if count:
                print(f"{path}: {count} session(s) named")
    for root in args.resume:
        meta_path = root / "meta.json"
        meta = json.loads(meta_path.read_text())
        count = named(meta.get("sessions", []))
        if count and not args.check:
            write_json_atomic(meta_path, meta)
        print(f"{meta_path}: {count} session(s) named")


if __name__ == "__main__":
    main()
