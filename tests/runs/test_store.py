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


def test_a_run_refuses_a_calibrated_copy_made_on_another_cpu(tmp_path: Path) -> None:
    """``torq run --portable-dir``: a calibrated method's copy from another CPU is refused by
    the run's checks, before any model is loaded (calibrated here it would be another
    model, RESULTS §12.5); RTN's goes on, and so does one whose model is kept."""
    from tests.test_generation_benchmark import _carry_from
    from torq.errors import TorqError
    from torq.eval.resume import MODEL_FILE, MODEL_INFO
    from torq.methods import get_method
    from torq.runs.config import check_carried_cpus

    config = RunConfig(
        model="m", methods=["torq", "rtn"], resume_dir=str(tmp_path / "r"),
        portable_dir=str(tmp_path / "carry"),
    )  # fmt: skip
    methods = [get_method("torq"), get_method("rtn")]
    for method in methods:
        _carry_from(portable_path(config, Path(method_resume_dir(config, method.name))), "X")
    refused = r"m-torq-\w+\.npz holds answers of a model calibrated on X"
    with pytest.raises(TorqError, match=refused):
        check_carried_cpus(config, methods)
    check_carried_cpus(config, methods[1:])
    kept = Path(method_resume_dir(config, "torq"))
    kept.mkdir(parents=True)
    (kept / MODEL_FILE).write_bytes(b"")
    (kept / MODEL_INFO).write_text("{}")
    check_carried_cpus(config, methods)
    check_carried_cpus(replace(config, portable_dir=None), methods)
