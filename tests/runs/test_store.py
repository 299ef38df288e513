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


def test_a_run_refuses_a_quantized_row_made_on_another_cpu(tmp_path: Path) -> None:
    """``torq run --resume-dir/--portable-dir``: a quantized method's copy or resume
    directory from another CPU is refused by the run's checks, before any model is loaded
    (the same W4A4 model answers otherwise there, RESULTS §12.5); FP's goes on."""
    from tests.test_generation_benchmark import _carry_from
    from torq.errors import TorqError
    from torq.methods import get_method
    from torq.runs.config import check_carried_cpus

    config = RunConfig(
        model="m", methods=["rtn", "fp"], resume_dir=str(tmp_path / "r"),
        portable_dir=str(tmp_path / "carry"),
    )  # fmt: skip
    methods = [get_method("rtn"), get_method("fp")]
    for method in methods:
        _carry_from(portable_path(config, Path(method_resume_dir(config, method.name))), "X")
    refused = r"m-rtn-\w+\.npz holds W4A4 answers made on X"
    with pytest.raises(TorqError, match=refused):
        check_carried_cpus(config, methods)
    check_carried_cpus(config, methods[1:])
    resume = Path(method_resume_dir(config, "rtn"))
    resume.mkdir(parents=True)
    (resume / "meta.json").write_text(json.dumps({"sessions": [{"cpu": "X"}]}))
    no_copy = replace(config, portable_dir=None)
    with pytest.raises(TorqError, match=r"rtn-\w+ holds W4A4 answers made on X"):
        check_carried_cpus(no_copy, methods)
    check_carried_cpus(replace(no_copy, resume_dir=None), methods)
