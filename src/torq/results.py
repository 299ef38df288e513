"""Result records: every number is saved with the command, config, versions and machine."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from torq.version import __version__


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``): recorded with every number, and with each
    session of a kept evaluation, since a W4A4 model's answers differ between CPU kinds
    (their float rounding; docs/research-log.md §12.5)."""
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
