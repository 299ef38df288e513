"""Calibrated methods on fused MoE experts (tiny Qwen3-MoE): TORQ, torq-had32, the block
Hadamards and GPTQ transform and quantize the experts instead of falling back to RTN.

One transform on the expert input (every expert reads the same hidden state; statistics
from all tokens), and on each expert's down_proj input one per expert (its routed tokens)
or one shared (all experts' inputs pooled). Routers stay in float.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torq.methods.layers as method_layers
from tests.conftest import tiny_model
from torq.calibration.data import CalibrationConfig, CaptureSettings, calibration_windows
from torq.driver import apply_method
from torq.export.checkpoint import save_quantized
from torq.export.reading import load_quantized
from torq.kernels.experts import PackedMXFP4Experts
from torq.methods import MethodContext, TorqSettings, get_method
from torq.rotations.intra_block import IntraBlockConfig
from torq.rotations.transform import BlockRotation
from torq.surgery import QuantConfig, QuantExperts

MX = QuantConfig.from_names("mxfp4", "mxfp4")


def _settings(corpus: str, sequential: bool = False, **kw) -> dict:
    """TORQ's settings and the capture, as a method's context holds them."""
    calibration = CalibrationConfig(corpus=corpus, n_samples=4, seqlen=48)
    return {
        "settings": TorqSettings(intra=IntraBlockConfig(max_iter=2), **kw),
        "capture": CaptureSettings(calibration, sequential=sequential, reservoir_tokens=64),
    }


def _apply(model, method: str, qconfig: QuantConfig, settings: dict, tokenizer) -> dict:
    ctx = MethodContext(tokenizer=tokenizer, options={"progress": False}, **settings)
    return apply_method(get_method(method), model, qconfig, ctx)


def _experts(model) -> list[QuantExperts]:
    return [m for m in model.modules() if isinstance(m, QuantExperts)]


def _layer_records(record: dict) -> list[dict]:
    layers = [r for r in record["layers"] if "experts" in r]
    assert len(layers) == 2  # both layers of the tiny model recorded their experts
    return layers


@pytest.mark.parametrize(
    ("method", "shared"),
    [("torq", False), ("torq", True), ("torq-had32", False), ("had32", False), ("gptq", False)],
)
def test_experts_transformed_and_the_same_function_in_float(
    method, shared, corpus, tiny_tokenizer, monkeypatch
) -> None:
    """With no quantization the transformed experts compute the float model exactly."""
    monkeypatch.setattr(method_layers, "EXPERT_MIN_TOKENS", 1)  # every expert its own
    model = tiny_model("qwen3_moe")
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = copy.deepcopy(model)
    record = _apply(
        q,
        method,
        QuantConfig(None, None),
        _settings(corpus, expert_down_shared=shared),
        tiny_tokenizer,
    )
    with torch.no_grad():
        out = q(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    experts = _experts(q)
    assert len(experts) == model.config.num_hidden_layers
    for ex in experts:
        if method == "gptq":  # no transform (and, in float, no GPTQ either)
            assert ex.input_transform is None
            continue
        assert isinstance(ex.input_transform, BlockRotation)
        downs = [q.transform for q in ex.down_quantizers]
        assert all(isinstance(t, BlockRotation) for t in downs)
        per_expert = method in ("torq", "torq-had32") and not shared
        assert len(downs) == (ex.num_experts if per_expert else 1)
        calibrated = method == "torq"
        assert (ex.input_transform.r_inter is not None) == calibrated
        assert (ex.input_transform.channel_scale is not None) == (method != "had32")
    # routers stay in float
    assert all(
        type(layer.mlp.gate) is type(model.model.layers[0].mlp.gate) for layer in q.model.layers
    )
    if method in ("torq", "torq-had32"):
        for rec in _layer_records(record):
            exp = rec["experts"]
            assert sum(exp["tokens_per_expert"]) == 4 * 48 * model.config.num_experts_per_tok
            assert ("down_proj_own_transform" in exp) == (not shared)


def test_experts_with_few_tokens_take_the_pooled_transform(
    corpus, tiny_tokenizer, monkeypatch
) -> None:
    monkeypatch.setattr(method_layers, "EXPERT_MIN_TOKENS", 10**9)
    model = tiny_model("qwen3_moe")
    record = _apply(model, "torq", MX, _settings(corpus), tiny_tokenizer)
    for ex in _experts(model):
        downs = {id(q.transform) for q in ex.down_quantizers}
        assert len(downs) == 1  # one module: the pooled fit
    assert all(r["experts"]["down_proj_own_transform"] == [] for r in _layer_records(record))


def _expert_inputs(model, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states and routing that reach layer 0's experts on ``windows``."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    experts = model.model.layers[0].mlp.experts
    handle = experts.register_forward_pre_hook(lambda _m, a: seen.append((a[0], a[1])))
    try:
        with torch.no_grad():
            model(input_ids=windows)
    finally:
        handle.remove()
    return torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])


def test_gptq_lowers_the_experts_error_on_their_calibration_tokens(corpus, tiny_tokenizer) -> None:
    """W4A16: GPTQ fits each expert's gate_up_proj to the tokens routed to it, so on those
    tokens its output error is below RTN's."""
    model = tiny_model("qwen3_moe")
    settings = _settings(corpus)
    w4 = QuantConfig.from_names("mxfp4", None)
    x, index = _expert_inputs(
        model, calibration_windows(tiny_tokenizer, settings["capture"].calibration)
    )
    float_w = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    errors = {}
    for method in ("rtn", "gptq"):
        q = copy.deepcopy(model)
        record = _apply(q, method, w4, settings, tiny_tokenizer)
        qw = q.model.layers[0].mlp.experts.gate_up_proj.detach()
        err = 0.0
        for e in range(float_w.shape[0]):
            xe = x[(index == e).any(-1)]
            err += float((xe @ (float_w[e] - qw[e]).T).pow(2).sum())
        errors[method] = err
        if method == "gptq":
            assert all(r["experts"]["gptq_rtn_fallback"] == [] for r in _layer_records(record))
    assert errors["gptq"] < errors["rtn"]


@pytest.mark.parametrize("method", ["torq", "torq+gptq"])
def test_quantized_experts_save_and_load_back(method, corpus, tiny_tokenizer, tmp_path) -> None:
    model = tiny_model("qwen3_moe")
    record = _apply(model, method, MX, _settings(corpus), tiny_tokenizer)
    if method == "torq+gptq":  # GPTQ ran on every expert (each saw calibration tokens)
        assert all(r["experts"]["gptq_rtn_fallback"] == [] for r in _layer_records(record))
    ids = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    save_quantized(model, tmp_path / "q", method=method)
    back, _, _ = load_quantized(tmp_path / "q")
    with torch.no_grad():
        out = back(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for a, b in zip(_experts(back), _experts(model), strict=True):
        assert torch.equal(a.input_transform.r_inter, b.input_transform.r_inter)
        assert len(a.down_quantizers) == len(b.down_quantizers)
    packed, _, _ = load_quantized(tmp_path / "q", packed=True)
    assert sum(isinstance(m, PackedMXFP4Experts) for m in packed.modules()) == 2
    with torch.no_grad():
        out_packed = packed(input_ids=ids).logits
    torch.testing.assert_close(out_packed, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_balancing_folds_into_moe_layers(
    model_type, corpus, tiny_tokenizer, monkeypatch
) -> None:
    """The `default`'s fold on MoE layers: the experts' input balancing goes into
    post_attention_layernorm with the router's columns times it, each expert's down_proj
    balancing into its up rows; only the rotations stay online, and in float the model
    computes what it did. Qwen2-MoE's shared expert, which reads the same norm, takes the
    experts' balancing, fitted on its weights and theirs, folded once: its Hadamard alone
    stays online (what compressed-tensors serves)."""
    monkeypatch.setattr(method_layers, "EXPERT_MIN_TOKENS", 1)
    model = tiny_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    q = copy.deepcopy(model)
    record = _apply(
        q, "torq-had32", QuantConfig(None, None), _settings(corpus, fold=True), tiny_tokenizer
    )
    with torch.no_grad():
        out = q(input_ids=ids).logits
    assert ((out - ref).norm() / ref.norm()) < 1e-4
    for before, after in zip(model.model.layers, q.model.layers, strict=True):
        norm = "post_attention_layernorm"
        assert not torch.equal(before.get_submodule(norm).weight, after.get_submodule(norm).weight)
        assert not torch.equal(before.mlp.gate.weight, after.mlp.gate.weight)
        (ex,) = [m for m in after.modules() if isinstance(m, QuantExperts)]
        assert isinstance(ex.input_transform, BlockRotation)
        assert ex.input_transform.channel_scale is None
        assert all(q.transform.channel_scale is None for q in ex.down_quantizers)
        if model_type == "qwen2_moe":
            shared = after.mlp.shared_expert.gate_proj.input_quantizer.transform
            assert isinstance(shared, BlockRotation) and shared.channel_scale is None
            assert shared.r_intra is not None  # its own rotation after the joint balancing
            down = after.mlp.shared_expert.down_proj.input_quantizer.transform
            assert down.channel_scale is None  # folded into the shared expert's up rows
    folds = [r["experts"]["fold"] for r in record["layers"] if "experts" in r]
    assert folds and all(f["input"]["router"] == "mlp.gate" for f in folds)
    if model_type == "qwen2_moe":  # the record says whose balancing the shared expert took
        took = [
            [k for k, v in r.items() if isinstance(v, dict) and "balancing_of" in v]
            for r in record["layers"]
        ]
        assert all(t == ["gate_proj+up_proj+shared_expert_gate"] for t in took), took
