"""``torq.runs.store``: where a run keeps its evaluation."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from torq.runs.config import RunConfig
from torq.runs.store import method_resume_dir, setting_digest, setting_key

DOCS = Path(__file__).resolve().parents[2] / "docs" / "records" / "formats"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxint4"])
def test_recorded_rows_keep_their_settings_keys(fmt: str) -> None:
    """A recorded row's settings key is the one its settings make today: a change to how
    settings are keyed would orphan every kept resume folder (their names are its hash);
    this fails first."""
    record = json.loads((DOCS / f"smollm2-{fmt}-zs300.json").read_text())
    for row in record["rows"]:
        assert setting_key(record["config"], row["method"]) == row["key"]


def test_a_methods_resume_folder_is_named_by_its_settings(tmp_path: Path) -> None:
    """``<resume>/<model>/<method>-<digest>``; another setting of the method (its format)
    gets another name."""
    config = RunConfig(model="m", methods=["torq"], resume_dir=str(tmp_path / "r"))
    resume = Path(method_resume_dir(config, "torq"))
    digest = setting_digest(asdict(config), "torq")
    assert resume == tmp_path / "r" / "m" / f"torq-{digest}"
    other = replace(config, weight_format="nvfp4", act_format="nvfp4")
    assert setting_digest(asdict(other), "torq") != digest
