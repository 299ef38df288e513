"""Run records: written whole, with the modes of an ordinary file."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from torq.paths import usual_permissions, write_json_atomic
from torq.results import COLUMNS, read_record, write_record


@pytest.fixture
def umask() -> int:
    old = os.umask(0o022)
    yield 0o022
    os.umask(old)


def test_record_is_whole_and_readable_by_others(tmp_path, umask) -> None:
    out = write_json_atomic(tmp_path / "sub" / "run.json", {"ppl": 1.5, "rows": [1, 2]})
    assert json.loads(out.read_text()) == {"ppl": 1.5, "rows": [1, 2]}
    assert out.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in out.parent.iterdir()] == ["run.json"]  # no temporary left


def test_unserialisable_record_leaves_the_old_file(tmp_path, umask) -> None:
    out = write_json_atomic(tmp_path / "run.json", {"a": 1})
    with pytest.raises(ValueError):
        write_json_atomic(out, {"x": _Unprintable()})
    assert json.loads(out.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


class _Unprintable:
    """Fails half-way through serialisation (the writer falls back to ``str``)."""

    def __str__(self) -> str:
        raise ValueError("cannot describe")


def test_usual_permissions_on_a_folder(tmp_path, umask) -> None:
    folder = tmp_path / "d"
    folder.mkdir(mode=0o700)
    (folder / "f").write_text("x")
    (folder / "f").chmod(0o600)
    usual_permissions(folder)
    assert folder.stat().st_mode & 0o777 == 0o755
    assert (folder / "f").stat().st_mode & 0o777 == 0o644


def _layer(i: int) -> dict:
    return {
        "layer": i,
        "groups": [{"name": "qkv", "width": 576}, {"name": "down", "width": 1536}],
        "qkv": {"seconds": 0.1 * i, "gptq": {"q": {"proxy_loss": i / 7}}},
        "stop": "tolerance" if i % 2 else None,
    }


def test_a_record_is_read_back_exactly_as_it_was_written(tmp_path) -> None:
    record = {
        "rows": [
            {"method": "fp", "details": {"layers": [_layer(i) for i in range(5)]}},
            {"method": "rtn", "details": {}},
        ],
        "mixed": [{"a": 1}, {"b": 2}, [{"c": 3}]],
        "one": [{"a": 1}],
        "numbers": [1.5, 2.5],
    }
    out = write_record(tmp_path / "run.json", record)
    assert read_record(out) == record
    text = out.read_text()
    assert "\n" not in text.rstrip("\n") and ": " not in text  # no indentation, no spaces
    # the five layers' shared groups are stored once
    assert text.count("1536") == 1
    stored = json.loads(text)["rows"]["of"]["details"]  # two rows whose details differ
    assert stored[0]["layers"][COLUMNS] == 5


def test_an_older_indented_record_reads_as_it_is(tmp_path) -> None:
    out = write_json_atomic(tmp_path / "old.json", {"rows": [{"method": "fp"}, {"method": "x"}]})
    assert read_record(out) == {"rows": [{"method": "fp"}, {"method": "x"}]}


def test_every_kept_record_is_stored_compactly_and_docs_fit_in_4_mib() -> None:
    """The records beside the docs stay in the compact form (:func:`write_record`), so that
    every one of them is kept: the docs' files, as git stores them (each zlib-compressed, a
    blob), hold at most 4 MiB (10.1 MiB uncompressed when the budget was set)."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    records = sorted((docs / "records").rglob("*.json"))
    assert len(records) > 100
    indented = [p.name for p in records if "\n " in p.read_text()]
    assert indented == []
    files = [p for p in docs.rglob("*") if p.is_file()]
    stored = sum(len(zlib.compress(p.read_bytes(), 6)) for p in files)
    assert stored <= 4 * 2**20, f"docs/ takes {stored / 2**20:.2f} MiB in git"
