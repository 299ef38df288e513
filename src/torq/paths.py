"""Where torq keeps what it builds once per machine (converted models, compiled kernels),
and the file modes of what it writes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torq.errors import TorqError


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


def check_destination(path: str | os.PathLike[str], *, folder: bool, what: str) -> None:
    """Refuse, before any work is done, a destination that could not be written when the work
    ends: a file where a folder is wanted or a folder where a file is, a file among its
    parents, or a parent this user may not write to. ``what`` names the option in the
    message (``"--out"``). Raises :class:`torq.errors.TorqError`."""

    path = Path(path).expanduser()
    if path.exists():
        if folder and not path.is_dir():
            raise TorqError(f"{what} {path} exists and is not a folder")
        if not folder and path.is_dir():
            raise TorqError(f"{what} {path} is a folder; give a file name")
    parent = path if folder and path.exists() else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise TorqError(f"{what} {path} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TorqError(f"{what} {path} cannot be created: {parent} is not writable")


@contextlib.contextmanager
def exclusive(target: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock for building ``target`` (a cache entry) in the block.

    Two processes that build the same entry at once (two runs on one machine, the test
    suite's workers) would each spend minutes on it, and the second to finish would replace
    the folder the first is already reading; under this lock the second waits and finds the
    entry done. The lock file lives in ``<cache>/locks`` (named by the target's path), not
    beside the entry, so the entry's folder holds only what was built. Where ``fcntl`` is
    missing (Windows) or the lock file cannot be created, nothing is locked.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        yield
        return
    name = hashlib.sha256(str(Path(target).resolve()).encode()).hexdigest()[:24]
    lock_path = cache_dir() / "locks" / f"{name}.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock_path, "a")  # noqa: SIM115 - held across the yield
    except OSError:  # a cache this user cannot write: build unlocked, as before the lock
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, compact: bool = False) -> Path:
    """Write ``obj`` as JSON so that a reader (or a stop) never sees half a file: into a
    temporary file of its own beside ``path`` (its folders made as needed), renamed into
    place; a value JSON has no form for is written as its ``str``; ``compact``: without
    indentation or spaces. A failure leaves what was there before, and no temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            if compact:
                json.dump(obj, fh, separators=(",", ":"), default=str)
            else:
                json.dump(obj, fh, indent=1, default=str)
            fh.write("\n")
        usual_permissions(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
