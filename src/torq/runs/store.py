"""Where a run keeps its evaluation as it goes: each method's resume folder (named by its
settings) and its perplexity windows' file there."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from torq.data import DEFAULT_EVAL_CORPUS
from torq.errors import TorqError
from torq.methods.registry import record_key
from torq.paths import write_json_atomic
from torq.runs.config import RunConfig
from torq.runs.kept import record_setting


def eval_dataset_label(corpus: str) -> str:
    """How a result names its perplexity text (``"wikitext-2-raw test"``, as it always has)."""
    return {DEFAULT_EVAL_CORPUS: "wikitext-2-raw test", "wikipedia-en": "wikipedia-en"}.get(
        corpus, f"file {corpus}"
    )


def ppl_record_name(corpus: str, windows: torch.Tensor) -> str:
    """The kept perplexity windows' record in a method's store: one per text and window
    shape (the WikiText-2 test split's name is the one it always had)."""
    shape = f"{windows.shape[0]}x{windows.shape[1]}"
    if corpus == DEFAULT_EVAL_CORPUS:
        return f"ppl-{shape}"
    digest = hashlib.sha1(corpus.encode()).hexdigest()[:8]
    return f"ppl-{_slug_name(corpus)}-{digest}-{shape}"


class FolderStore:
    """An :class:`~torq.eval.store.EvalStore` in a folder (a method's resume folder): each
    record a JSON file ``<name>.json`` written whole (:func:`torq.paths.write_json_atomic`),
    a library's files beside them."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def read(self, name: str) -> dict[str, Any] | None:
        path = self.root / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def write(self, name: str, value: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / f"{name}.json", value)

    def file(self, name: str) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        return str(self.root / name)

    def __str__(self) -> str:
        return str(self.root)


def _slug_name(text: str) -> str:
    name = Path(text).name or text
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)[:40]


def setting_key(config: dict[str, Any], method: str) -> str:
    """What makes two rows of one method the same quantized model (``config`` is
    ``asdict(RunConfig)``): the method's own settings key, :func:`record_key`."""
    return record_key(config, method)


def setting_digest(config: dict[str, Any], method: str) -> str:
    """The short hash of :func:`setting_key` that names a method's resume folder (``config``
    is ``asdict(RunConfig)``, as a run's record keeps it): the same settings find the same
    kept answers."""
    return hashlib.sha1(setting_key(config, method).encode()).hexdigest()[:10]


def method_resume_dir(config: RunConfig, method: str) -> str:
    """``<resume_dir>/<model>/<method>-<hash of its setting key>``: one quantized model's
    kept evaluation (the fingerprints stored there guard against a stale directory)."""
    if config.resume_dir is None:
        raise TorqError("no resume directory configured")
    digest = setting_digest(asdict(config), method)
    model = "".join(c if c.isalnum() or c in "-._" else "_" for c in config.model)
    return str(Path(config.resume_dir) / model / f"{method}-{digest}")


def open_method_resume_dir(config: RunConfig, method: str) -> Path | None:
    """The method's resume folder (:func:`method_resume_dir`) with its setting key written
    in it (:func:`torq.runs.kept.record_setting`), or ``None`` when the run keeps none."""
    if config.resume_dir is None:
        return None
    resume = Path(method_resume_dir(config, method))
    record_setting(resume, setting_key(asdict(config), method))
    return resume
