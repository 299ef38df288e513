"""Calibration corpora: the files of the data directory and the Python standard library."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from torq.calibration.data import (
    PYTHON_STDLIB,
    CalibrationConfig,
    calibration_windows,
    corpus_path,
    corpus_text,
    python_stdlib_files,
)


def test_the_standard_library_is_a_code_corpus_without_its_tests() -> None:
    """``python-stdlib``: this Python's ``.py`` sources in a fixed order, each under its
    path, the test suites and installed packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = python_stdlib_files()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert len(files) > 100 and rel == sorted(rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert not any(part in {"test", "site-packages"} for r in rel for part in r.split("/"))
    text = corpus_text(PYTHON_STDLIB)
    assert text.startswith(f"# {rel[0]}\n") and "\n# os.py\n" in text
    assert "def makedirs(" in text  # os.py's own source
    assert corpus_path(PYTHON_STDLIB) == root
    assert CalibrationConfig(corpus=PYTHON_STDLIB).corpus == PYTHON_STDLIB


def test_calibration_windows_from_the_standard_library(tiny_tokenizer, monkeypatch) -> None:
    """Seeded windows at random offsets of the code corpus: the same seed, the same windows.
    (Its first 30 files: the tiny test tokenizer takes a minute over all 12 MB.)"""
    import torq.calibration.data as data

    files = python_stdlib_files()[:30]
    monkeypatch.setattr(data, "python_stdlib_files", lambda: files)
    config = CalibrationConfig(corpus=PYTHON_STDLIB, n_samples=3, seqlen=16, seed=1)
    windows = calibration_windows(tiny_tokenizer, config)
    assert windows.shape == (3, 16)
    assert (windows == calibration_windows(tiny_tokenizer, config)).all()
    other = calibration_windows(tiny_tokenizer, CalibrationConfig(PYTHON_STDLIB, 3, 16, seed=2))
    assert not (windows == other).all()


def test_an_unknown_corpus_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="wikitext2-valid, wikipedia-en, python-stdlib"):
        CalibrationConfig(corpus="stdlib")
