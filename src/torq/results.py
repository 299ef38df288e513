"""Result records: every number is saved with the command, config, versions and machine.

A record is stored compactly (:func:`write_record`): a list of two or more objects with the
same keys (one per layer, per window, per group) is kept as columns, one list per key, a
key whose value every object shares stored once; :func:`read_record` gives the record back
exactly as it was written. Records of many methods and models stay small enough to keep
every one beside the numbers they back."""

from __future__ import annotations

import copy
import json
import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from torq.paths import write_json_atomic
from torq.version import __version__

COLUMNS = "__columns__"  # marks a list of objects kept as columns: {COLUMNS: n, "of": …}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``): recorded with every number, and with each
    session of a kept evaluation, since a W4A4 model's answers differ between CPU kinds
    (their float rounding; docs/research/paper-tables.md §12.5)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """The machine a number was measured on, recorded beside it: host, CPU, threads, GPU, memory."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return info


def lock_hash() -> str | None:
    """The sha256 of the lock file (``requirements.lock``) this environment was installed
    from: ``make setup`` writes it into the environment; ``None`` elsewhere."""
    try:
        return (Path(sys.prefix) / "torq-lock.sha256").read_text().strip() or None
    except OSError:
        return None


def versions() -> dict[str, str | None]:
    """The versions of torq, torch, transformers and Python behind a record, and the lock
    the environment was installed from (:func:`lock_hash`)."""
    import transformers

    return {
        "torq": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "lock_sha256": lock_hash(),
    }


def command_line(argv: list[str] | None = None) -> str:
    """The command that made a record, quoted so that it can be pasted into a shell."""
    argv = sys.argv if argv is None else argv
    prog = Path(argv[0]).name if argv else "torq"
    if prog in ("__main__.py", "cli.py"):
        prog = "torq"
    return shlex.join([prog, *argv[1:]])


def now_iso() -> str:
    """The current UTC time to the second, ISO 8601, for a record's date."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def compact(value: Any) -> Any:
    """``value`` with each list of two or more objects of the same keys kept as columns
    (:data:`COLUMNS`); nested lists and objects the same way."""
    if isinstance(value, dict):
        return {key: compact(item) for key, item in value.items()}
    if isinstance(value, list):
        if _same_keys(value):
            return {COLUMNS: len(value), "of": _columns(value)}
        return [compact(item) for item in value]
    return value


def expanded(value: Any) -> Any:
    """The value :func:`compact` was given: its columns turned back into objects."""
    if isinstance(value, dict):
        if COLUMNS in value:
            return _rows(value["of"], value[COLUMNS])
        return {key: expanded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [expanded(item) for item in value]
    return value


def _same_keys(items: list[Any]) -> bool:
    return (
        len(items) >= 2
        and all(isinstance(item, dict) for item in items)
        and all(item.keys() == items[0].keys() for item in items)
    )


def _columns(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry per key: ``{"same": v}`` where every row holds ``v``, ``{"nest": …}``
    where the rows hold objects of the same keys (their columns), else the list of the
    rows' values."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        column = [row[key] for row in rows]
        if all(item == column[0] for item in column):
            out[key] = {"same": compact(column[0])}
        elif _same_keys(column):
            out[key] = {"nest": _columns(column)}
        else:
            out[key] = [compact(item) for item in column]
    return out


def _rows(columns: dict[str, Any], n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, column in columns.items():
        if isinstance(column, list):
            values = [expanded(item) for item in column]
        elif "same" in column:
            same = expanded(column["same"])
            values = [copy.deepcopy(same) for _ in range(n)]
        else:
            values = _rows(column["nest"], n)
        for row, item in zip(rows, values, strict=True):
            row[key] = item
    return rows


def write_record(path: str | Path, record: dict[str, Any]) -> Path:
    """Write a result record whole (:func:`torq.paths.write_json_atomic`), compactly."""
    return write_json_atomic(path, compact(record), compact=True)


def read_record(path: str | Path) -> dict[str, Any]:
    """A result record as it was written (:func:`write_record`, or an older indented one)."""
    return expanded(json.loads(Path(path).read_text()))
