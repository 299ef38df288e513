"""Where torq keeps what it builds once per machine (converted models, compiled kernels),
and the file modes of what it writes."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$TORQ_CACHE``, default ``~/.cache/torq``."""
    return Path(os.environ.get("TORQ_CACHE", Path.home() / ".cache" / "torq")).expanduser()


def usual_permissions(path: Path) -> None:
    """Give ``path`` (a file, or a folder and the files directly in it) the mode a plain
    ``open``/``mkdir`` would: ``tempfile.mkstemp``/``mkdtemp`` and safetensors create them
    owner-only, which hides results and caches from the other users of a shared machine."""
    umask = os.umask(0)
    os.umask(umask)
    if path.is_dir():
        path.chmod(0o777 & ~umask)
        for f in path.iterdir():
            if f.is_file():
                f.chmod(0o666 & ~umask)
    else:
        path.chmod(0o666 & ~umask)
