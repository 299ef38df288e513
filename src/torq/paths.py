"""Where torq keeps what it builds once per machine (converted models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$TORQ_CACHE``, default ``~/.cache/torq``."""
    return Path(os.environ.get("TORQ_CACHE", Path.home() / ".cache" / "torq")).expanduser()
