"""``torq.paths``: destinations checked before the work that writes them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torq.errors import TorqError
from torq.paths import check_destination


def test_check_destination_accepts_what_can_be_written(tmp_path: Path) -> None:
    check_destination(tmp_path / "new" / "deeper" / "r.json", folder=False, what="--out")
    check_destination(tmp_path / "new-folder" / "sub", folder=True, what="--save-dir")
    existing = tmp_path / "r.json"
    existing.write_text("{}")
    check_destination(existing, folder=False, what="--out")  # replaced at the end
    check_destination(tmp_path, folder=True, what="--save-dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # nothing created


@pytest.mark.parametrize(
    ("relative", "folder", "needle"),
    [
        ("f", True, "exists and is not a folder"),
        ("d", False, "is a folder; give a file name"),
        ("f/r.json", False, "is a file"),
        ("f/a/b", True, "is a file"),
    ],
)
def test_check_destination_refuses_files_and_folders_mixed_up(
    tmp_path: Path, relative: str, folder: bool, needle: str
) -> None:
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(TorqError, match="--opt") as err:
        check_destination(tmp_path / relative, folder=folder, what="--opt")
    assert needle in str(err.value)


def test_check_destination_refuses_a_parent_it_may_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.access answers for this user (root may write anywhere, so the answer is faked)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(TorqError, match=f"{tmp_path} is not writable"):
        check_destination(tmp_path / "new" / "r.json", folder=False, what="--out")
    (tmp_path / "open").mkdir()
    check_destination(tmp_path / "open" / "r.json", folder=False, what="--out")
