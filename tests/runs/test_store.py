"""``torq.runs.store``: where a run keeps its evaluation."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from torq.runs.config import RunConfig
from torq.runs.store import method_resume_dir, portable_path, setting_digest, setting_key

DOCS = Path(__file__).resolve().parents[2] / "docs" / "formats"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxint4"])
def test_the_carried_rows_are_found_again_by_their_settings(fmt: str) -> None:
    """The answers behind §12.2's zero-shot rows (``docs/formats/carry``) are found by the
    settings their record keeps: the setting key of each row is the one stored when it ran,
    and its hash names the carried file. A change to how settings are keyed or hashed
    would orphan every row carried between machines; this fails first."""
    record = json.loads((DOCS / f"smollm2-{fmt}-zs300.json").read_text())
    model = record["config"]["model"]
    for row in record["rows"]:
        assert setting_key(record["config"], row["method"]) == row["key"]
        digest = setting_digest(record["config"], row["method"])
        assert (DOCS / "carry" / f"{model}-{row['method']}-{digest}.npz").is_file()


def test_a_methods_resume_folder_and_portable_copy_are_named_by_its_settings(
    tmp_path: Path,
) -> None:
    """``<resume>/<model>/<method>-<digest>`` and ``<portable>/<model>-<method>-<digest>.npz``;
    another setting of the method (its format) gets other names."""
    config = RunConfig(
        model="m", methods=["torq"], resume_dir=str(tmp_path / "r"), portable_dir=str(tmp_path)
    )
    resume = Path(method_resume_dir(config, "torq"))
    digest = setting_digest(asdict(config), "torq")
    assert resume == tmp_path / "r" / "m" / f"torq-{digest}"
    assert portable_path(config, resume) == tmp_path / f"m-torq-{digest}.npz"
    other = replace(config, weight_format="nvfp4", act_format="nvfp4")
    assert setting_digest(asdict(other), "torq") != digest
