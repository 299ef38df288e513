"""Where a long evaluation keeps what it has measured as it goes (:class:`EvalStore`), so
that the same call after a stop measures only what is missing.

The evaluation functions receive a store and know nothing else of it: not where it lives,
not which run or method it belongs to. :class:`torq.runs.store.FolderStore` keeps one in a
method's resume folder; :class:`MemoryStore` keeps one in memory (tests, one session).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EvalStore(Protocol):
    """Named JSON records, written whole (a stop never leaves half of one), and the path of
    a file a library keeps its own progress in (lm-eval's answer cache)."""

    def read(self, name: str) -> dict[str, Any] | None:
        """The record ``name`` as last written, or ``None``."""
        ...

    def write(self, name: str, value: dict[str, Any]) -> None:
        """Replace the record ``name`` with ``value``, whole or not at all."""
        ...

    def file(self, name: str) -> str:
        """A path for a library's own file called ``name`` (its parent exists)."""
        ...


class MemoryStore:
    """An :class:`EvalStore` in memory: what one session measured, kept for its next call."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self._files: tempfile.TemporaryDirectory[str] | None = None

    def read(self, name: str) -> dict[str, Any] | None:
        value = self.records.get(name)
        return None if value is None else copy.deepcopy(value)

    def write(self, name: str, value: dict[str, Any]) -> None:
        self.records[name] = copy.deepcopy(value)

    def file(self, name: str) -> str:
        if self._files is None:  # a library's files need a disk; removed with the store
            self._files = tempfile.TemporaryDirectory(prefix="torq-store-")
        return str(Path(self._files.name) / name)

    def __str__(self) -> str:
        return "the in-memory store"
