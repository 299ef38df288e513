"""Run records: written whole, with the modes of an ordinary file."""

from __future__ import annotations

import json
import os

import pytest

from torq.paths import usual_permissions, write_json_atomic


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
