"""Methods as typed values: composition with GPTQ, settings keys, and a new method in one
definition (issue 26, item 5)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_model
from tests.whole_model import whole_model_run
from torq.calibration.data import CalibrationConfig
from torq.errors import TorqError
from torq.methods import METHODS, Method, MethodContext, TransformBuilder, get_method, register
from torq.methods.hadamard import block_hadamard
from torq.methods.layers import layer_plan
from torq.methods.settings import TorqSettings
from torq.pipeline import run
from torq.runs.config import RunConfig
from torq.runs.store import method_resume_dir
from torq.surgery.qlinear import QuantConfig


def test_gptq_is_composition_not_a_new_method() -> None:
    had = get_method("had32")
    composed = get_method("had32+gptq")
    assert composed.transform is had.transform and composed.weights == "gptq"
    assert composed == had.with_gptq()
    assert get_method("rtn+gptq") is get_method("gptq")
    assert get_method("torq+gptq").calibrates() and not get_method("had32").calibrates()
    assert get_method("had32+gptq").calibrates()  # GPTQ needs the Hessians
    with pytest.raises(TorqError, match="composes with"):
        get_method("fp+gptq")
    with pytest.raises(TorqError, match="does not compose"):
        get_method("gptq").with_gptq()
    with pytest.raises(ValueError):
        Method("x", "bad", weights="awq")


def test_only_quarot_fuses_an_offline_rotation_part_by_part() -> None:
    config = tiny_model("llama").config
    ctx = MethodContext(model_config=config)
    with_parts = {n for n, m in METHODS.items() if m.transform.residual(ctx) is not None}
    assert with_parts == {"quarot"}
    assert layer_plan(get_method("quarot+gptq"), QuantConfig(None, None), ctx).parts is not None


# The resume folders of SmolLM2-135M's full zero-shot rows (docs/research-log.md §5.0), named
# by the hash of each method's settings key when they were measured.
KEPT_ROWS = (
    "gptq-c8af7445d7", "had128-afc12e8be0", "hadfull-20ba38fe04", "quarot-3fa46f9946",
    "torq+gptq-616102201e", "torq-had32-442ed82675", "torq-inter-6724f9bd24",
    "torq-intra-508f1e8da1",
)  # fmt: skip


def test_settings_keys_name_the_directories_they_named_before() -> None:
    """A method's resume folder is named by the hash of its settings key: the keys of
    today give the names the kept zero-shot rows were measured under, so a resumed row
    finds its answers (QuaRot's name changed once, on purpose, when its signs moved)."""
    config = RunConfig(model="smollm2-135m", resume_dir="r")
    config.torq = TorqSettings(calibration=CalibrationConfig(n_samples=32))
    for name in KEPT_ROWS:
        method = name.rsplit("-", 1)[0]
        assert Path(method_resume_dir(config, method)).name == name, method


def test_keys_hold_only_what_a_method_reads() -> None:
    base = asdict(RunConfig(model="m"))
    other_torq = {**base, "torq": {**base["torq"], "balance": 0.3}}
    other_gptq = {**base, "gptq": {**base["gptq"], "damp": 0.1}}
    assert get_method("had32").settings_key(other_torq) == get_method("had32").settings_key(base)
    assert get_method("torq").settings_key(other_torq) != get_method("torq").settings_key(base)
    assert get_method("torq").settings_key(other_gptq) == get_method("torq").settings_key(base)
    torq_gptq = get_method("torq+gptq")
    assert torq_gptq.settings_key(other_gptq) != torq_gptq.settings_key(base)
    assert torq_gptq.settings_key(other_torq) != torq_gptq.settings_key(base)
    # MR-GPTQ's own GPTQ settings are in its key, over the run's; settings added since
    # the carried keys were made stay out of the others' keys at their defaults
    mr = json.loads(get_method("mr-gptq").settings_key(base))[1]["gptq"]
    assert mr["act_order"] is True and mr["scale_search"] == "mse"
    plain = json.loads(get_method("gptq").settings_key(base))[1]["gptq"]
    assert "scale_search" not in plain and plain["act_order"] is False
    mse = {**base, "gptq": {**base["gptq"], "scale_search": "mse"}}
    assert get_method("gptq").settings_key(mse) != get_method("gptq").settings_key(base)


class _Hadamard32Again(TransformBuilder):
    """A 'new rotation method' written as a user would: one class and one register call."""

    def fixed(self, width: int, qconfig: QuantConfig, ctx: MethodContext) -> torch.nn.Module:
        return block_hadamard(width, 32)


@pytest.fixture
def new_method():
    method = register(Method("my-had32", "a new method, defined in one place", _Hadamard32Again()))
    try:
        yield method
    finally:
        METHODS.pop(method.name)


def test_a_new_method_is_one_definition(
    new_method, tmp_path, tiny_tokenizer, tiny_calibration_data_dir
) -> None:
    """Registered, it runs whole and streamed, alone and with GPTQ, and equals ``had32``
    (which it reimplements) bit for bit."""
    data = tiny_calibration_data_dir
    folder = tmp_path / "model"
    tiny_model("qwen3").save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    methods = ["had32", "my-had32", "had32+gptq", "my-had32+gptq"]
    common = {"model": str(folder), "methods": methods, "seqlen": 48, "max_windows": 2}
    common["data_dir"] = str(data)
    common["torq"] = TorqSettings(calibration=CalibrationConfig(n_samples=2, seqlen=48))
    whole = {r["method"]: r["ppl"] for r in whole_model_run(RunConfig(**common))["rows"]}
    streamed = run(RunConfig(**common), progress=False)["rows"]
    assert whole["my-had32"] == whole["had32"]
    assert whole["my-had32+gptq"] == whole["had32+gptq"]
    assert whole["had32+gptq"] != whole["had32"]
    assert {r["method"]: r["ppl"] for r in streamed} == whole
