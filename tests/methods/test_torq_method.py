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
