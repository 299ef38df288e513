"""Local-first loaders for the evaluation and calibration corpora.

Files are read from a data directory (``--data-dir`` or ``$TORQ_DATA_DIR``) laid out like
``../shared/data``. Where no directory is configured, the standard Hugging Face dataset
is used if the hub is reachable; a configured directory that lacks a file is an error that
names the path it expected, never a silent download.
"""

from __future__ import annotations

import os
from pathlib import Path

from torq.errors import TorqError

DATA_DIR_ENV = "TORQ_DATA_DIR"
WIKITEXT2_TEST_RAW = Path("wikitext-2-raw") / "wiki.test.raw"
# 995 English Wikipedia articles (BIG-bench's paragraph_segmentation task, ../shared/data's
# README): a second text, for calibration or as held-out text for perplexity
WIKIPEDIA_EN = Path("wikipedia-en") / "bigbench_paragraph_segmentation.txt"

# The texts perplexity can be measured on (``--eval-corpus``); any other value is a file.
EVAL_CORPORA: dict[str, Path] = {
    "wikitext2-test": WIKITEXT2_TEST_RAW,
    "wikipedia-en": WIKIPEDIA_EN,
}
DEFAULT_EVAL_CORPUS = "wikitext2-test"


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The data directory from the argument, else ``$TORQ_DATA_DIR``, else ``None``."""
    value = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    if value is None:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise TorqError(f"data directory not found: {path}")
    return path


def _hub_wikitext2_test() -> str:
    try:
        import datasets
    except ImportError:
        raise TorqError(
            f"no data directory given (--data-dir or ${DATA_DIR_ENV}) and the 'datasets' "
            "package is not installed for the Hugging Face hub fallback"
        ) from None
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as exc:
        raise TorqError(
            f"no data directory given (--data-dir or ${DATA_DIR_ENV}) and the hub is not "
            f"reachable ({exc.__class__.__name__})"
        ) from None
    # The hub rows are the file's lines (newline kept), so joining them rebuilds the file.
    return "".join(ds["text"])


def wikitext2_test_path(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The local WikiText-2 raw test file; ``None`` without a data directory (the hub
    fallback). A configured directory that lacks it raises :class:`TorqError`."""
    root = resolve_data_dir(data_dir)
    if root is None:
        return None
    path = root / WIKITEXT2_TEST_RAW
    if not path.is_file():
        raise TorqError(f"WikiText-2 test file not found: expected {path}")
    return path


def load_wikitext2_test(data_dir: str | os.PathLike[str] | None = None) -> str:
    """The WikiText-2 raw test split as one string (method-notes §3)."""
    path = wikitext2_test_path(data_dir)
    if path is None:
        return _hub_wikitext2_test()
    return path.read_text(encoding="utf-8")


def eval_text_path(corpus: str, data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The file of a perplexity text (:data:`EVAL_CORPORA`, or a path); ``None`` for the
    WikiText-2 test split without a data directory (the hub fallback). Checked before any
    work: a missing file raises :class:`TorqError` naming the path expected."""
    if corpus == DEFAULT_EVAL_CORPUS:
        return wikitext2_test_path(data_dir)
    return data_file(corpus, EVAL_CORPORA, data_dir, "perplexity text")


def data_file(
    name: str,
    files: dict[str, Path],
    data_dir: str | os.PathLike[str] | None,
    what: str,
    others: tuple[str, ...] = (),
) -> Path:
    """``name``'s file: one of ``files`` (paths in the data directory) or a path itself.
    Errors are one line naming ``what`` and the path expected (and the names known, with
    ``others`` that the caller resolves itself)."""
    if name not in files:
        path = Path(name).expanduser()
        if not path.is_file():
            known = ", ".join([*files, *others])
            raise TorqError(f"{what} file not found: {path} (known: {known})")
        return path
    root = resolve_data_dir(data_dir)
    if root is None:
        raise TorqError(f"{what} '{name}' needs a data directory (--data-dir or ${DATA_DIR_ENV})")
    path = root / files[name]
    if not path.is_file():
        raise TorqError(f"{what} file not found: expected {path}")
    return path


def load_eval_text(corpus: str, data_dir: str | os.PathLike[str] | None = None) -> str:
    """The text perplexity is measured on, as one string (:func:`eval_text_path`)."""
    path = eval_text_path(corpus, data_dir)
    if path is None:
        return _hub_wikitext2_test()
    return path.read_text(encoding="utf-8")
