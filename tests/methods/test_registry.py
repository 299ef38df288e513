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
from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.errors import TorqError
from torq.methods import METHODS, Method, MethodContext, TransformBuilder, get_method, register
from torq.methods.hadamard import HadamardSettings, block_hadamard
from torq.methods.layers import layer_plan
from torq.methods.registry import MethodSpec, method_spec, method_specs
from torq.methods.settings import TorqSettings
from torq.pipeline import run
from torq.runs.config import RunConfig
from torq.runs.store import method_resume_dir, record_key
from torq.surgery.gptq import GPTQConfig
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


@pytest.mark.parametrize(("suffix", "asymmetry"), [("gptaq", 0.25), ("qronos", 1.0)])
def test_weight_quantizers_that_see_the_quantized_input(suffix: str, asymmetry: float) -> None:
    """``+gptaq`` and ``+qronos`` are GPTQ on the mismatched loss, weighted 0.25 and 1."""
    composed = get_method(f"torq-had32+{suffix}")
    assert composed.transform is get_method("torq-had32").transform
    assert composed.gptq_config(MethodContext()).asymmetry == asymmetry
    assert get_method(f"rtn+{suffix}") is get_method(suffix)
    assert get_method(suffix).gptq_config(MethodContext()).asymmetry == asymmetry
    assert get_method("had32+gptq").gptq_config(MethodContext()).asymmetry == 0.0
    # Qronos damps as its reference code does, GPTAQ as GPTQ
    damping = (suffix == "qronos", "largest-eigenvalue" if suffix == "qronos" else "mean-diagonal")
    cfg = composed.gptq_config(MethodContext())
    assert (cfg.damp == 1e-3, cfg.damp_scale) == damping
    with pytest.raises(ValueError, match="suffix"):
        get_method("had32").with_gptq(suffix="+awq")


def test_only_quarot_fuses_an_offline_rotation_part_by_part() -> None:
    config = tiny_model("llama").config
    ctx = MethodContext(model_config=config)
    with_parts = {n for n, m in METHODS.items() if m.transform.residual(ctx) is not None}
    assert with_parts == {"quarot"}
    assert layer_plan(get_method("quarot+gptq"), QuantConfig(None, None), ctx).parts is not None


# The resume folders of SmolLM2-135M's full zero-shot rows (docs/research/zero-shot.md §5.0), named
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
    capture = CaptureSettings(calibration=CalibrationConfig(n_samples=32))
    for name in KEPT_ROWS:
        method = name.rsplit("-", 1)[0]
        # the run's methods as bare names and as specs (what a run records) alike
        for methods in (["fp"], method_specs([method])):
            config = RunConfig.of(
                model="smollm2-135m", resume_dir="r", capture=capture, methods=methods
            )
            folder = method_resume_dir("r", config.record(), method)
            assert Path(folder).name == name, method


def test_records_made_before_runs_held_specs_keep_their_keys() -> None:
    """A record of a run whose TORQ settings held the capture (the form of every record
    in docs/records/ before specs) gives the key a spec of the same settings gives."""
    capture = CaptureSettings(calibration=CalibrationConfig(n_samples=32), reservoir_tokens=512)
    torq = TorqSettings(balance=0.3)
    gptq = GPTQConfig(damp=0.05)
    for name in ("torq", "torq-had32+gptq", "mr-gptq", "had32", "quarot+gptq"):
        new = RunConfig.of(
            model="m", methods=method_specs([name], torq, gptq), capture=capture
        ).record()
        old = {k: v for k, v in new.items() if k not in ("methods", "capture")}
        old["methods"] = [name]
        old["torq"] = {**asdict(torq), **asdict(capture)}
        old["gptq"] = asdict(gptq)
        assert record_key(old, name) == record_key(new, name), name


def _key(name: str, *given: object) -> str:
    return record_key(RunConfig.of(model="m", methods=method_specs([name], *given)).record(), name)


def test_keys_hold_only_what_a_method_reads() -> None:
    other_torq = TorqSettings(balance=0.3)
    other_gptq = GPTQConfig(damp=0.1)
    assert _key("had32", other_torq) == _key("had32")
    assert _key("torq", other_torq) != _key("torq")
    assert _key("torq", other_gptq) == _key("torq")
    assert _key("torq+gptq", other_gptq) != _key("torq+gptq")
    assert _key("torq+gptq", other_torq) != _key("torq+gptq")
    # MR-GPTQ's own GPTQ settings are in its key, over the run's; settings added since
    # the carried keys were made stay out of the others' keys at their defaults
    mr = json.loads(_key("mr-gptq"))[1]["gptq"]
    assert mr["act_order"] is True and mr["scale_search"] == "mse"
    plain = json.loads(_key("gptq"))[1]["gptq"]
    assert "scale_search" not in plain and plain["act_order"] is False
    assert _key("gptq", GPTQConfig(scale_search="mse")) != _key("gptq")
    # reduced-precision calibration statistics make another model of a calibrating method
    # only (its key gains the arithmetic; "exact" keys stay as they were)

    def captured(name: str, arithmetic: str) -> str:
        config = RunConfig.of(
            model="m", methods=method_specs([name]), capture=CaptureSettings(arithmetic=arithmetic)
        )
        return record_key(config.record(), name)

    for name in ("had32+gptaq", "torq", "wush"):
        assert captured(name, "tf32") != captured(name, "exact") == _key(name), name
    assert captured("had32", "tf32") == _key("had32")


def test_a_spec_holds_its_own_settings_only() -> None:
    """Each method takes the settings values of its own types; the run has no field for
    any method's settings."""
    torq, gptq = TorqSettings(balance=0.3), GPTQConfig(damp=0.05)
    assert method_spec("torq", torq, gptq) == MethodSpec("torq", torq, None)
    had = HadamardSettings(unrotated=("q_proj",))
    assert method_spec("had32+gptq", torq, gptq, had) == MethodSpec("had32+gptq", had, gptq)
    assert method_spec("had32", torq).settings == HadamardSettings()
    assert method_spec("mr-gptq", gptq).gptq == GPTQConfig(
        damp=0.05, act_order=True, scale_search="mse"
    )
    assert method_spec("torq").settings == TorqSettings()
    assert method_spec("fp", torq).settings is None
    assert not set(RunConfig().record()) & {"torq", "gptq"}
    with pytest.raises(TorqError, match="same method"):
        method_specs(["rtn+gptq", "gptq"])


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
    common["capture"] = CaptureSettings(CalibrationConfig(n_samples=2, seqlen=48))
    whole = {r["method"]: r["ppl"] for r in whole_model_run(RunConfig.of(**common))["rows"]}
    streamed = run(RunConfig.of(**common), progress=False)["rows"]
    assert whole["my-had32"] == whole["had32"]
    assert whole["my-had32+gptq"] == whole["had32+gptq"]
    assert whole["had32+gptq"] != whole["had32"]
    assert {r["method"]: r["ppl"] for r in streamed} == whole
