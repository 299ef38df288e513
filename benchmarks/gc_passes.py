"""What the garbage collections after each layer cost a run, with and without
``torq.models.streaming.collecting_new_objects_only`` (the objects alive when a
layer-by-layer pass starts frozen out of the collector's sight).

The same ``torq run`` settings in one process, alternately in the two modes, ``--repeats``
times each; per run the wall time, the number of ``gc.collect`` calls and the seconds spent
in them, the peak resident set (the largest of the runs) and the perplexity (which must
not change). Run it as
``python -m benchmarks.gc_passes --model smollm2-135m --methods rtn,torq-had32 --out F``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from typing import Any

from benchmarks.common import save
from torq.experimental import (
    CalibrationConfig,
    CaptureSettings,
    ResidentPeak,
    RunConfig,
    run,
    streaming,
)


class _TimedCollections:
    """Wraps ``gc.collect`` to count its calls and the seconds they take."""

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0
        self._collect = gc.collect

    def __enter__(self) -> _TimedCollections:
        def timed(*args: Any) -> int:
            t0 = time.perf_counter()
            try:
                return self._collect(*args)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t0

        gc.collect = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        gc.collect = self._collect  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="rtn,torq-had32")
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--data-dir", default=os.environ.get("TORQ_DATA_DIR"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    config = RunConfig.of(
        model=args.model,
        methods=args.methods.split(","),
        max_windows=args.max_windows,
        data_dir=args.data_dir,
        capture=CaptureSettings(CalibrationConfig(n_samples=args.calib_samples)),
    )
    tracked = len(gc.get_objects())
    rss = ResidentPeak()
    runs: list[dict[str, Any]] = []
    for i in range(args.repeats * 2):
        frozen = i % 2 == 1
        # a depth above zero makes every pass see itself as nested: nothing is frozen
        streaming._FROZEN_DEPTH = 0 if frozen else 1
        gc.collect()
        rss.restart()
        with _TimedCollections() as timed:
            t0 = time.perf_counter()
            rows = run(config, progress=False)["rows"]
            wall = time.perf_counter() - t0
        peak = rss.peak()
        runs.append(
            {
                "frozen": frozen,
                "wall_s": wall,
                "collections": timed.calls,
                "collect_s": timed.seconds,
                "peak_rss_gib": None if peak is None else peak / 2**30,
                "ppl": {r["method"]: r["ppl"] for r in rows},
            }
        )
        print(runs[-1], flush=True)
    streaming._FROZEN_DEPTH = 0
    lines = [
        f"{args.model}, methods {args.methods}, {args.max_windows} windows, "
        f"{args.calib_samples} calibration windows, {torch.get_num_threads()} threads, "
        f"{tracked} objects tracked by the collector at the start; median of {args.repeats}",
        "",
        "| objects alive at a pass's start | wall s | collections | s in collections "
        "| peak RSS GiB | PPL |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for frozen in (False, True):
        mine = [r for r in runs if r["frozen"] == frozen]
        ppl = ", ".join(f"{m} {v:.4f}" for m, v in mine[0]["ppl"].items())
        lines.append(
            f"| {'frozen (torq)' if frozen else 'walked by every collection'} "
            f"| {statistics.median(r['wall_s'] for r in mine):.1f} "
            f"| {mine[0]['collections']} "
            f"| {statistics.median(r['collect_s'] for r in mine):.1f} "
            f"| {max(r['peak_rss_gib'] or 0 for r in mine):.2f} | {ppl} |"
        )
    same = all(r["ppl"] == runs[0]["ppl"] for r in runs)
    lines.append("")
    lines.append(f"Perplexities identical in every run: {same}")
    record = {
        "command": " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
        "identical_ppl": same,
    }
    save(args.out, record, "\n".join(lines))


if __name__ == "__main__":
    main()
