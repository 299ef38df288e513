"""``torq.runs.store``: where a run keeps its evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest

from torq.results import read_record
from torq.runs.config import RunConfig
from torq.runs.store import method_resume_dir, setting_digest, setting_key

DOCS = Path(__file__).resolve().parents[2] / "docs" / "records" / "formats"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxint4"])
def test_recorded_rows_keep_their_settings_keys(fmt: str) -> None:
    """A recorded row's settings key is the one its settings make today: a change to how
    settings are keyed would orphan every kept resume folder (their names are its hash);
    this fails first."""
    record = read_record(DOCS / f"smollm2-{fmt}-zs300.json")
    for row in record["rows"]:
        assert setting_key(record["config"], row["method"]) == row["key"]


def test_a_methods_resume_folder_is_named_by_its_settings(tmp_path: Path) -> None:
    """``<resume>/<model>/<method>-<digest>``; another setting of the method (its format)
    gets another name."""
    config = RunConfig.of(model="m", methods=["torq"], resume_dir=str(tmp_path / "r"))
    resume = Path(method_resume_dir(str(tmp_path / "r"), config.record(), "torq"))
    digest = setting_digest(config.record(), "torq")
    assert resume == tmp_path / "r" / "m" / f"torq-{digest}"
    other = config.replace(weight_format="nvfp4", act_format="nvfp4")
    assert setting_digest(other.record(), "torq") != digest
