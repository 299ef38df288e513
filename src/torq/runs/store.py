"""Where a run keeps its evaluation as it goes: each method's resume folder (named by its
settings) and its perplexity windows' file there."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from torq.calibration.data import CaptureSettings
from torq.data import DEFAULT_EVAL_CORPUS
from torq.errors import TorqError
from torq.methods.registry import RunKey, get_method, method_spec
from torq.paths import write_json_atomic
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


def run_key(record: dict[str, Any]) -> RunKey:
    """The :class:`RunKey` of a run's record (``RunConfig.record()``, or a record made
    before the run's settings were typed: the same keys)."""
    given = {k: record.get(k) for k in ("model", "weight_format", "act_format", "scale_mode")}
    rest = {k: record[k] for k in ("act_scale", "seqlen", "gguf_dtype", "seed") if k in record}
    return RunKey(**given, **rest, ignore=tuple(record.get("ignore") or ()))


def record_key(record: dict[str, Any], name: str) -> str:
    """The settings key (:meth:`~torq.methods.registry.Method.settings_key`) of the method
    ``name`` in a run's record: from its spec, or, in records made before runs held specs,
    from the run's TORQ and GPTQ settings, which then held the capture too."""
    method = get_method(name)
    spec = next(
        (
            m
            for m in record.get("methods") or []
            if isinstance(m, dict) and m["name"] == method.name
        ),
        None,
    )
    if spec is None and "torq" not in record:  # a bare name: its settings' defaults
        spec = asdict(method_spec(method.name))
    if spec is not None:
        capture = record.get("capture") or asdict(CaptureSettings())
        return method.settings_key(run_key(record), spec["settings"], spec["gptq"], capture)
    torq = record["torq"]
    capture = {k: torq.get(k) for k in ("calibration", "sequential", "reservoir_tokens")}
    return method.settings_key(run_key(record), torq, record.get("gptq"), capture)


def setting_key(record: dict[str, Any], method: str) -> str:
    """What makes two rows of one method the same quantized model (``record``: the run's
    record, ``RunConfig.record()``): the method's own settings key, :func:`record_key`."""
    return record_key(record, method)


def setting_digest(record: dict[str, Any], method: str) -> str:
    """The short hash of :func:`setting_key` that names a method's resume folder: the same
    settings find the same kept answers."""
    return hashlib.sha1(setting_key(record, method).encode()).hexdigest()[:10]


def method_resume_dir(resume_dir: str | None, record: dict[str, Any], method: str) -> str:
    """``<resume_dir>/<model>/<method>-<hash of its setting key>``: one quantized model's
    kept evaluation (the fingerprints stored there guard against a stale directory)."""
    if resume_dir is None:
        raise TorqError("no resume directory configured")
    digest = setting_digest(record, method)
    model = "".join(c if c.isalnum() or c in "-._" else "_" for c in record["model"])
    return str(Path(resume_dir) / model / f"{method}-{digest}")


def open_method_resume_dir(
    resume_dir: str | None, record: dict[str, Any], method: str
) -> Path | None:
    """The method's resume folder (:func:`method_resume_dir`) with its setting key written
    in it (:func:`torq.runs.kept.record_setting`), or ``None`` when the run keeps none."""
    if resume_dir is None:
        return None
    resume = Path(method_resume_dir(resume_dir, record, method))
    record_setting(resume, setting_key(record, method))
    return resume
