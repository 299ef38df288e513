"""Timing helper shared by the benchmarks (run them as ``python -m benchmarks.NAME`` from
the repository's root).

Importing it also quiets the libraries' notes as the ``torq`` command does
(:func:`torq.logs.quiet_libraries`), so that a benchmark's log holds its own lines."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torq.experimental import quiet_libraries, write_record

quiet_libraries()  # before the scripts import torchao (its notes come at import time)


def time_runs(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn``, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def save(out: str | Path, record: dict[str, Any], markdown: str) -> Path:
    """Print the markdown table and write ``out`` (JSON) with the table beside it (``.md``)."""
    print(markdown)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_record(path, {**record, "markdown": markdown})
    path.with_suffix(".md").write_text(markdown + "\n")
    print(f"wrote {path}")
    return path
