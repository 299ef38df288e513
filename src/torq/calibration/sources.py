"""Calibration data: the corpora torq knows, and the data a user brings.

A calibration source (``--calib-data``) is one of:

* a corpus name (``wikitext2-valid``, ``wikipedia-en``, ``python-stdlib``) or a text file:
  one long text, each window taken at a seeded random token offset (as GPTQ, QuaRot and
  TORQ calibrate; method-notes §3);
* a ``.jsonl`` (or ``.json``) file, a ``.parquet`` file, or a Hugging Face dataset folder
  (``save_to_disk``'s, or a folder of JSON lines / parquet files): one document per
  record, its ``text`` column, or its ``messages`` column (chat turns, rendered with the
  model's own chat template); ``PATH#COLUMN`` names another column.

Documents are packed: shuffled with the seed, each tokenized and followed by the end of
sequence token, laid end to end and cut into windows. Attention crosses documents inside a
window, as it does across the articles of a text corpus: calibration reads per-token
activation statistics, a chat's template marks where a conversation starts, and windows of
one short document each would be mostly padding (a GSM8K chat is about 200 tokens of a
2048-token window).

Several sources, separated by commas, are mixed: ``SOURCE:N`` takes ``N`` of the run's
windows from that source; sources without a count share the rest equally.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torq.data import WIKIPEDIA_EN, data_file
from torq.errors import TorqError

CORPORA: dict[str, Path] = {
    "wikitext2-valid": Path("wikitext-2") / "wiki.valid.tokens",
    "wikipedia-en": WIKIPEDIA_EN,
}
# A code corpus every machine has (the paper's Table 5 calibrates on code too): the
# ``.py`` sources of the running Python's standard library, its test suites left out.
PYTHON_STDLIB = "python-stdlib"
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
# files read as records, one document each; any other file is one text
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
TEXT_COLUMN, CHAT_COLUMN = "text", "messages"


@dataclass(frozen=True)
class Source:
    """One calibration source: a corpus name or a path, the column its documents are in
    (None: ``messages``, else ``text``), and how many of the run's windows it gives (None:
    a share of the rest)."""

    name: str
    column: str | None = None
    windows: int | None = None

    @property
    def is_text(self) -> bool:
        """Read as one long text (a corpus or a text file), not as records."""
        if self.name in CORPORA or self.name == PYTHON_STDLIB:
            return True
        path = Path(self.name).expanduser()
        return not path.is_dir() and path.suffix.lower() not in RECORD_SUFFIXES


def parse_sources(spec: str) -> list[Source]:
    """The sources of ``--calib-data`` (``PATH[#COLUMN][:N]``, comma separated); a bad one
    is a one-line :class:`ValueError`."""
    sources = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise ValueError(f"empty calibration source in '{spec}'")
        windows = None
        head, sep, tail = part.rpartition(":")
        if sep and tail.isdigit():
            part, windows = head, int(tail)
            if windows < 1:
                raise ValueError(f"calibration source '{part}' takes no windows (:{tail})")
        name, _, column = part.partition("#")
        source = Source(name, column or None, windows)
        path = Path(name).expanduser()
        known = name in CORPORA or name == PYTHON_STDLIB
        if not known and not path.suffix and not path.is_dir():
            raise ValueError(
                f"unknown calibration data '{name}'; known: {', '.join(CORPORA)}, "
                f"{PYTHON_STDLIB}, a file or a dataset folder"
            )
        if column and source.is_text:
            raise ValueError(f"'{name}' is read as one text: it has no column '{column}'")
        sources.append(source)
    return sources


def window_counts(sources: list[Source], n: int) -> list[int]:
    """Each source's windows out of ``n``: its own count, or an equal share of the rest
    (the first sources take the remainder)."""
    given = sum(s.windows or 0 for s in sources)
    rest = [i for i, s in enumerate(sources) if s.windows is None]
    if given > n or (not rest and given != n):
        counts = " + ".join(str(s.windows) for s in sources if s.windows)
        raise TorqError(
            f"the calibration sources' windows ({counts} = {given}) must add to "
            f"--calib-samples ({n})"
        )
    if rest and n - given < len(rest):
        raise TorqError(
            f"--calib-samples {n} leaves {n - given} windows for {len(rest)} calibration "
            "sources without a count"
        )
    counts = [s.windows or 0 for s in sources]
    share, extra = divmod(n - given, max(len(rest), 1))
    for k, i in enumerate(rest):
        counts[i] = share + (1 if k < extra else 0)
    return counts


# ---------------------------------------------------------------------------------------
# Reading a source


def python_stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (``sysconfig``'s ``stdlib``), sorted by their
    path under it, test suites and installed packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP.intersection(p.relative_to(root).parts) and p.is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_path(corpus: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file behind a corpus name (or the corpus itself when it is a path); for
    ``python-stdlib``, the standard library's folder (checked to hold sources)."""
    if corpus == PYTHON_STDLIB:
        if not python_stdlib_files():
            raise TorqError("calibration corpus python-stdlib: no standard library sources")
        return Path(sysconfig.get_paths()["stdlib"])
    return data_file(corpus, CORPORA, data_dir, "calibration corpus", (PYTHON_STDLIB,))


def corpus_text(corpus: str, data_dir: str | os.PathLike[str] | None = None) -> str:
    """A text source as one string: a file's text, or for ``python-stdlib`` the standard
    library's sources one after another (each preceded by its path as a comment)."""
    if corpus == PYTHON_STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        parts = []
        for path in python_stdlib_files():
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(f"# {path.relative_to(root).as_posix()}\n{text}")
        return "\n\n".join(parts)
    text = corpus_path(corpus, data_dir).read_text(encoding="utf-8")
    if not text.strip():
        raise TorqError(f"calibration data {corpus} is empty")
    return text


def _data_files(folder: Path) -> tuple[str, list[str]]:
    """The ``datasets`` builder and files of a folder of JSON lines or parquet files."""
    for builder, patterns in (("json", ("*.jsonl", "*.json")), ("parquet", ("*.parquet",))):
        files = sorted(str(p) for pattern in patterns for p in folder.rglob(pattern))
        if files:
            return builder, files
    raise TorqError(
        f"calibration data {folder}: a folder must be a saved Hugging Face dataset or hold "
        ".jsonl, .json or .parquet files"
    )


def _records(path: Path) -> tuple[list[str], Iterator[dict[str, Any]]]:
    """The column names and the records of a records source."""
    if path.suffix.lower() in (".jsonl", ".json") and path.is_file():
        return _json_records(path)
    import datasets

    if path.is_dir() and (
        (path / "dataset_info.json").is_file() or (path / "state.json").is_file()
    ):
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            data = data["train"] if "train" in data else next(iter(data.values()))
    elif path.is_dir():
        builder, files = _data_files(path)
        data = datasets.load_dataset(builder, data_files=files, split="train")
    else:
        data = datasets.load_dataset("parquet", data_files=[str(path)], split="train")
    return list(data.column_names), iter(data)


def _json_records(path: Path) -> tuple[list[str], Iterator[dict[str, Any]]]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise TorqError(
            f"calibration data {path}: not JSON lines ({exc.msg}, line {exc.lineno})"
        ) from None
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise TorqError(f"calibration data {path}: no records (one JSON object per line)")
    return list(rows[0]), iter(rows)


def documents(source: Source) -> tuple[str, list[Any]]:
    """``(column, documents)`` of a records source: each record's ``source.column``, or its
    ``messages``, or its ``text``; a missing column, an empty source or a malformed chat is
    a one-line :class:`TorqError`."""
    path = Path(source.name).expanduser()
    if not path.exists():
        raise TorqError(f"calibration data not found: {path}")
    columns, records = _records(path)
    column = source.column or next((c for c in (CHAT_COLUMN, TEXT_COLUMN) if c in columns), None)
    if column is None or column not in columns:
        wanted = (
            f"no column '{source.column}'"
            if source.column
            else "neither a 'messages' nor a 'text' column"
        )
        raise TorqError(f"calibration data {path} has {wanted} (it has: {', '.join(columns)})")
    docs = []
    for i, record in enumerate(records):
        value = record.get(column)
        if column == CHAT_COLUMN or isinstance(value, list):
            _check_chat(value, path, i)
        elif not isinstance(value, str):
            raise TorqError(f"calibration data {path}: record {i + 1} has no text in '{column}'")
        if value:
            docs.append(value)
    if not docs:
        raise TorqError(f"calibration data {path} is empty")
    return column, docs


def _check_chat(value: Any, path: Path, i: int) -> None:
    turns_ok = isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
        for t in value
    )
    if not turns_ok:
        raise TorqError(
            f"calibration data {path}: record {i + 1}'s messages are not a list of "
            "{'role', 'content'} turns"
        )


def is_chat(docs: list[Any]) -> bool:
    """Whether the documents are chats (lists of turns), not texts."""
    return bool(docs) and isinstance(docs[0], list)


def check_source(source: Source, data_dir: str | os.PathLike[str] | None) -> None:
    """Read ``source`` as calibration will, so that bad data fails before any work."""
    if source.is_text:
        corpus_path(source.name, data_dir)
    else:
        documents(source)


# ---------------------------------------------------------------------------------------
# Windows


def text_windows(ids: torch.Tensor, n: int, seqlen: int, seed: int, what: str) -> torch.Tensor:
    """``[n, seqlen]`` windows at seeded random offsets of one token stream."""
    if ids.numel() <= seqlen:
        raise TorqError(f"{what} has {ids.numel()} tokens, too few for windows of {seqlen}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen, (n,), generator=g)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def packed_windows(
    tokenizer: Any, docs: list[Any], n: int, seqlen: int, seed: int, what: str
) -> torch.Tensor:
    """``[n, seqlen]`` windows of documents packed end to end (module doc): shuffled with
    ``seed``, chats rendered with the tokenizer's chat template, each document followed by
    the end of sequence token."""
    chat = is_chat(docs)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise TorqError(
            f"{what} holds chat messages, but the model's tokenizer has no chat template"
        )
    eos = tokenizer.eos_token_id
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    need, stream = n * seqlen, []
    total = 0
    for i in order:
        doc = docs[i]
        text = tokenizer.apply_chat_template(doc, tokenize=False) if chat else doc
        ids = tokenizer(text, add_special_tokens=False).input_ids
        stream.append(torch.tensor([*ids, *([] if eos is None else [eos])], dtype=torch.long))
        total += stream[-1].numel()
        if total >= need:
            break
    if total < need:
        raise TorqError(
            f"{what} has {total} tokens, too few for {n} windows of {seqlen}; lower "
            "--calib-samples or --calib-seqlen, or bring more data"
        )
    return torch.cat(stream)[:need].view(n, seqlen)


def source_windows(
    tokenizer: Any,
    source: Source,
    n: int,
    seqlen: int,
    seed: int,
    data_dir: str | os.PathLike[str] | None = None,
) -> torch.Tensor:
    """``n`` windows of ``seqlen`` tokens from one source."""
    if source.is_text:
        text = corpus_text(source.name, data_dir)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        return text_windows(ids, n, seqlen, seed, f"calibration data {source.name}")
    _, docs = documents(source)
    return packed_windows(tokenizer, docs, n, seqlen, seed, f"calibration data {source.name}")


# ---------------------------------------------------------------------------------------
# What a record keeps of the data


def sha256_of(path: Path) -> str:
    """A file's sha256; a folder's, of its files' paths and contents in sorted order."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def describe_sources(
    spec: str, n: int, data_dir: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """For a record: each source's name, path, size in bytes, sha256, how it is read, and
    its windows out of ``n``."""
    sources = parse_sources(spec)
    out = []
    for source, windows in zip(sources, window_counts(sources, n), strict=True):
        if source.name == PYTHON_STDLIB:
            path = corpus_path(source.name, data_dir)
            size = sum(p.stat().st_size for p in python_stdlib_files())
            digest = None  # this Python's own sources: named by the Python version
        else:
            path = corpus_path(source.name, data_dir) if source.is_text else Path(source.name)
            path = path.expanduser()
            files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
            size, digest = sum(p.stat().st_size for p in files), sha256_of(path)
        entry: dict[str, Any] = {
            "source": source.name,
            "path": str(path),
            "bytes": size,
            "sha256": digest,
            "windows": windows,
        }
        if source.is_text:
            entry["read_as"] = "text"
        else:
            column, docs = documents(source)
            entry.update(read_as="chat" if is_chat(docs) else "documents", column=column)
            entry["documents"] = len(docs)
        out.append(entry)
    return out
