"""TORQ end to end on tiny models: the transformed model is the same function in float."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.conftest import TINY_TEXT, tiny_model
from torq.calibration.data import CalibrationConfig
from torq.methods import MethodContext, TorqSettings, get_method
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.intra_block import IntraBlockConfig
from torq.rotations.transform import BlockRotation
from torq.surgery import QuantConfig, QuantLinear


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "corpus.txt"
    path.write_text(TINY_TEXT * 30, encoding="utf-8")
    return str(path)


def _settings(corpus: str, **kw) -> TorqSettings:
    return TorqSettings(
        calibration=CalibrationConfig(corpus=corpus, n_samples=3, seqlen=48),
        intra=IntraBlockConfig(max_iter=2),
        reservoir_tokens=64,
        **kw,
    )


def _apply(model, method: str, qconfig: QuantConfig, settings: TorqSettings, tokenizer):
    ctx = MethodContext(tokenizer=tokenizer, options={"torq_settings": settings, "progress": False})
    return get_method(method).apply(model, qconfig, ctx)


@pytest.mark.parametrize(
    ("method", "balance"),
    [
        ("torq", 0.5),
        ("torq", None),
        ("torq-inter", None),
        ("torq-intra", None),
        ("torq-had32", 0.5),
    ],
)
def test_transformed_model_matches_in_float(arch, method, balance, corpus, tiny_tokenizer) -> None:
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = copy.deepcopy(model)
    settings = _settings(corpus, balance=balance)
    record = _apply(q, method, QuantConfig(None, None), settings, tiny_tokenizer)
    with torch.no_grad():
        out = q(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    assert record["settings"]["balance"] == balance
    qlinears = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert qlinears and all(isinstance(m.input_transform, BlockRotation) for m in qlinears)
    has_inter = method not in ("torq-intra", "torq-had32")
    has_intra = method != "torq-inter"
    t = qlinears[0].input_transform
    assert (t.r_inter is not None) == has_inter and (t.r_intra is not None) == has_intra
    assert (t.channel_scale is not None) == (balance is not None)
    if method == "torq-had32":  # the fixed block Hadamard, not a calibrated rotation
        h = hadamard_matrix(32)
        assert torch.allclose(t.r_intra.double(), h / h[0].norm(), atol=1e-6)
    json.dumps(record)  # the record is JSON-serialisable as it stands
    assert record["calibration_seconds"]["solve"] >= 0


def test_qkv_share_one_transform(corpus, tiny_tokenizer) -> None:
    model = tiny_model("llama")
    _apply(model, "torq", QuantConfig(None, None), _settings(corpus), tiny_tokenizer)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.input_transform is attn.k_proj.input_transform is attn.v_proj.input_transform
    assert mlp.gate_proj.input_transform is mlp.up_proj.input_transform
    assert attn.o_proj.input_transform is not attn.q_proj.input_transform


@pytest.mark.parametrize("sequential", [False, True])
def test_w4a4_torq_runs_and_is_finite(sequential, corpus, tiny_tokenizer) -> None:
    model = tiny_model("qwen2")
    qc = QuantConfig.from_names("mxfp4", "mxfp4")
    rec = _apply(model, "torq", qc, _settings(corpus, sequential=sequential), tiny_tokenizer)
    assert rec["settings"]["sequential"] is sequential
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 300, (1, 16))).logits
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", ["had32", "had128", "hadfull"])
def test_block_hadamard_baseline_is_exact_in_float(arch, method) -> None:
    model = tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = copy.deepcopy(model)
    record = get_method(method).apply(q, QuantConfig(None, None), MethodContext())
    # tiny widths: 64 and 128 (hidden, intermediate); groups 32 / ≤128 / full width
    expected = {"had32": {64: 32, 128: 32}, "had128": {64: 64, 128: 128}}.get(
        method, {64: 64, 128: 128}
    )
    groups = record["group_by_width"]
    assert groups and all(expected[w] == g for w, g in groups.items())
    with torch.no_grad():
        out = q(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    qlinears = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert qlinears and all(isinstance(m.input_transform, BlockRotation) for m in qlinears)


def test_guard_keeps_the_transform_with_the_lower_held_back_error(corpus, tiny_tokenizer) -> None:
    """``torq-guard``: each group's calibrated transform is checked on the sampled tokens
    held back (a quarter) against the balanced ``H₃₂``; the group keeps the one with the
    lower W4A4 output error, which the record names with both errors; where it is the
    Hadamard, the transform is ``torq-had32``'s exactly. The fit sees the rest only."""
    from torq.calibration.capture import BlockStatistics
    from torq.formats import get_format
    from torq.methods.torq_rotation import build_group_transform, output_error

    fmt = get_format("mxfp4")
    chosen = set()
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        stats = BlockStatistics(64, 32, reservoir=96, seed=seed)
        x = torch.randn(96, 64, generator=gen) * torch.exp(torch.randn(1, 64, generator=gen))
        stats.update(x)
        weight = torch.randn(48, 64, generator=gen) * 0.1
        settings = _settings(corpus, guard=0.25)
        t, rec = build_group_transform(stats, settings, fmt, weight, fmt)
        guard = rec["guard"]
        assert guard["held_tokens"] == 24 and rec["intra"]["samples"] == 72 * 2
        errors = guard["error"]
        assert guard["chosen"] == min(errors, key=errors.get)
        held = stats.sample[72:]
        assert output_error(held, weight, t, fmt, fmt) == errors[guard["chosen"]]
        if guard["chosen"] == "hadamard":
            assert t.r_inter is None
            assert torch.equal(t.r_intra, hadamard_matrix(32, dtype=torch.float64).float())
        chosen.add(guard["chosen"])
        _, plain_rec = build_group_transform(stats, _settings(corpus), fmt, weight, fmt)
        assert "guard" not in plain_rec and rec["intra"]["samples"] < plain_rec["intra"]["samples"]
    assert chosen  # (which one wins depends on the draw)
    with pytest.raises(ValueError, match="fraction"):
        _settings(corpus, guard=1.0)


def test_guard_runs_as_a_method_and_stays_out_of_the_other_keys(corpus, tiny_tokenizer) -> None:
    from dataclasses import asdict

    from torq.pipeline import RunConfig

    model = tiny_model("llama")
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    rec = _apply(model, "torq-guard", qconfig, _settings(corpus), tiny_tokenizer)
    json.dumps(rec)
    groups = [g for layer in rec["layers"] for k, g in layer.items() if isinstance(g, dict)]
    guarded = [g["guard"] for g in groups if "guard" in g]
    assert len(guarded) == 4 * model.config.num_hidden_layers
    assert rec["settings"]["guard"] == 0.25
    base = asdict(RunConfig(model="m"))
    assert "guard" not in get_method("torq").settings_key(base)
    run_guard = {**base, "torq": {**base["torq"], "guard": 0.5}}
    assert get_method("torq").settings_key(run_guard) != get_method("torq").settings_key(base)
