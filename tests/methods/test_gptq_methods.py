"""GPTQ as a method and composed with transforms, end to end on tiny models."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.conftest import TINY_TEXT, calibrated_context, tiny_model
from torq.driver import apply_method
from torq.errors import TorqError
from torq.formats import fake_quantize, get_format
from torq.methods import MethodContext, get_method
from torq.surgery import QuantConfig, QuantLinear


def _ctx(corpus: str, tokenizer) -> MethodContext:
    return calibrated_context(tokenizer, corpus)


def test_names_compose() -> None:
    assert get_method("gptq").name == "gptq"
    assert get_method("rtn+gptq").name == "gptq"
    m = get_method("torq+gptq")
    assert m.name == "torq+gptq" and m.gptq_enabled
    assert get_method("had32+GPTQ").gptq_enabled
    assert not get_method("torq").gptq_enabled
    with pytest.raises(TorqError, match="composes with"):
        get_method("fp+gptq")


@pytest.mark.parametrize("method", ["gptq", "had32+gptq", "quarot+gptq", "torq+gptq", "mr-gptq"])
def test_gptq_weights_are_on_the_grid_and_beat_rtn(method, corpus, tiny_tokenizer) -> None:
    """Weight-only MXFP4: the GPTQ variant's weights lie on the grid, and on the calibration
    text its logits are closer to the float model's than the same method with RTN weights."""
    model = tiny_model("llama")
    fmt = get_format("mxfp4")
    qconfig = QuantConfig(fmt, None)
    ids = tiny_tokenizer(TINY_TEXT * 3, return_tensors="pt").input_ids[:, :96]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    errors = {}
    for name in (method, method.replace("+gptq", "") if "+" in method else "rtn"):
        q = copy.deepcopy(model)
        record = apply_method(get_method(name), q, qconfig, _ctx(corpus, tiny_tokenizer))
        json.dumps(record)
        with torch.no_grad():
            errors[name] = float((q(input_ids=ids).logits - ref).norm() / ref.norm())
        if name == method:
            qlinears = [m for m in q.modules() if isinstance(m, QuantLinear)]
            assert len(qlinears) == 7 * model.config.num_hidden_layers
            for m in qlinears:
                assert torch.equal(fake_quantize(m.weight, fmt), m.weight)
    gptq_err, rtn_err = errors[method], errors[next(n for n in errors if n != method)]
    assert gptq_err < rtn_err, errors


def test_mr_gptq_rotates_each_block_of_the_format(corpus, tiny_tokenizer) -> None:
    """MR-GPTQ's micro-rotation follows the weight format's block: 32 in MXFP4, 16 in NVFP4
    (its NVFP4 form), where its MSE-chosen E4M3 block scales keep the weights exportable."""
    from torq.formats.packed import encode_nvfp4_exact

    model = tiny_model("llama")
    for fmt, block in (("mxfp4", 32), ("nvfp4", 16)):
        q = copy.deepcopy(model)
        qconfig = QuantConfig.from_names(fmt, fmt)
        apply_method(get_method("mr-gptq"), q, qconfig, _ctx(corpus, tiny_tokenizer))
        qlinears = [m for m in q.modules() if isinstance(m, QuantLinear)]
        assert {m.input_quantizer.transform.block_size for m in qlinears} == {block}
        if fmt == "nvfp4":
            for m in qlinears:
                assert encode_nvfp4_exact(m.weight, m.weight_tensor_scale) is not None


def test_activation_error_power_is_the_quantizers_error_per_channel() -> None:
    """``E[(Q_a(T x) − T x)²]`` per channel: for Gaussian tokens MXFP4's error power is
    about 1.3 % of the signal's (its Gaussian floor), with a block rotation it is the
    error of the rotated tokens, and float activations add nothing."""
    from torq.methods.layers import activation_error_power
    from torq.rotations.transform import BlockRotation

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 64, generator=gen)
    fmt = get_format("mxfp4")
    power = activation_error_power(x, None, fmt)
    assert power.shape == (64,) and power.dtype == torch.float64
    assert 0.010 < float(power.mean()) < 0.016
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    rotation = BlockRotation(32, r_intra=q)
    t = rotation(x)
    expected = (fake_quantize(t, fmt) - t).double().pow(2).mean(0)
    torch.testing.assert_close(activation_error_power(x, rotation, fmt), expected)
    assert not activation_error_power(x, None, None).any()


def test_input_noise_raises_the_hessians_diagonal(monkeypatch) -> None:
    """``GPTQConfig(input_noise=True)``: GPTQ sees ``T H Tᵀ + diag(E[e²])``, the group's
    Hessian with the activation quantizer's error power on its diagonal."""
    import torq.methods.layers as layers
    from torq.calibration.capture import BlockStatistics, LinearGroup
    from torq.surgery.gptq import GPTQConfig

    seen: list[torch.Tensor] = []
    real = layers.gptq_quantize

    def watch(weight, h, *args, **kwargs):
        seen.append(h.clone())
        return real(weight, h, *args, **kwargs)

    monkeypatch.setattr(layers, "gptq_quantize", watch)
    gen = torch.Generator().manual_seed(0)
    stats = BlockStatistics(64, 32, 256, seed=0, hessian=True)
    stats.update(torch.randn(512, 64, generator=gen))
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    for noise in (False, True):
        layer = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False))
        group = LinearGroup("in", ["0"], 64)
        layers.quantize_group(layer, group, None, qconfig, stats, GPTQConfig(input_noise=noise))
    plain, noisy = seen
    power = layers.activation_error_power(stats.sample, None, qconfig.activation)
    torch.testing.assert_close(noisy - plain, torch.diag(power))
    assert float(power.min()) > 0


@pytest.mark.parametrize("method", ["had32", "had32+gptq"])
def test_the_block_hadamard_leaves_unrotated_linears_without_it(
    method, corpus, tiny_tokenizer
) -> None:
    """``HadamardSettings(unrotated=("k_proj", "q_proj", "v_proj"))``, as the recipes name a
    model's linears with a bias: q/k/v have no online transform, the other linears the
    32-block Hadamard, their weights as without the setting, bit for bit; the setting enters
    the settings key only when given, and names are checked."""

    from torq.methods.hadamard import HadamardSettings
    from torq.methods.registry import method_spec
    from torq.runs.config import RunConfig
    from torq.runs.store import record_key

    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    models = {}
    biased = ("k_proj", "q_proj", "v_proj")
    for label, settings in (("plain", HadamardSettings(unrotated=biased)), ("own", None)):
        ctx = _ctx(corpus, tiny_tokenizer)
        ctx.settings = settings
        models[label] = tiny_model("qwen2")
        apply_method(get_method(method), models[label], qconfig, ctx)
    for plain, own in zip(models["plain"].model.layers, models["own"].model.layers, strict=True):
        for name in ("q_proj", "k_proj", "v_proj"):
            assert getattr(plain.self_attn, name).input_quantizer.transform is None
        for sub, name in (("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "down_proj")):
            ours, theirs = getattr(getattr(plain, sub), name), getattr(getattr(own, sub), name)
            assert ours.input_quantizer.transform is theirs.input_quantizer.transform
            assert torch.equal(ours.weight, theirs.weight)

    def key(*given: object) -> str:
        return record_key(
            RunConfig.of(model="m", methods=[method_spec(method, *given)]).record(), method
        )

    assert "unrotated" not in key()
    assert key(HadamardSettings(unrotated=biased)) != key()
    with pytest.raises(ValueError, match="unrotated names"):
        HadamardSettings(unrotated=("q proj",))


def test_the_residual_hadamard_rotates_the_norms_readers_offline(corpus, tiny_tokenizer) -> None:
    """``HadamardSettings(residual=True)``, GPTQ's weights: q/k/v and gate/up (Qwen2's q/k/v
    with a bias) run no transform; their input is the normalized residual stream rotated by
    ``H₃₂`` on each block, the online block Hadamard's rotation, fused offline (first layer:
    the float model's norm output over its weight, rotated so); o_proj and down_proj keep
    the online Hadamard; in float the model is the float model; the setting enters the key
    only when given."""

    from torq.methods.hadamard import HadamardSettings
    from torq.methods.registry import method_spec
    from torq.rotations.hadamard import hadamard_matrix
    from torq.runs.config import RunConfig
    from torq.runs.store import record_key

    method = "had32+gptq"
    ids = tiny_tokenizer(TINY_TEXT, return_tensors="pt").input_ids[:, :24]
    model = tiny_model("qwen2")
    settings = HadamardSettings(residual=True)
    in_float = copy.deepcopy(model)
    ctx = _ctx(corpus, tiny_tokenizer)
    ctx.settings = settings
    apply_method(get_method(method), in_float, QuantConfig(None, None), ctx)
    seen: dict[str, torch.Tensor] = {}

    def keep(label: str):
        def hook(module, args, output=None) -> None:
            seen[label] = (output if output is not None else args[0]).detach()

        return hook

    norm = model.model.layers[0].input_layernorm
    handles = [
        norm.register_forward_hook(keep("norm")),
        in_float.model.layers[0].self_attn.q_proj.register_forward_pre_hook(keep("q")),
    ]
    with torch.no_grad():
        torch.testing.assert_close(
            in_float(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
    for handle in handles:
        handle.remove()
    h = hadamard_matrix(32).float()
    normalized = seen["norm"] / norm.weight.detach()
    rotated = (normalized.reshape(*normalized.shape[:-1], -1, 32) @ h.T).flatten(-2)
    torch.testing.assert_close(seen["q"], rotated, rtol=1e-4, atol=1e-5)

    ctx = _ctx(corpus, tiny_tokenizer)
    ctx.settings = settings
    q = copy.deepcopy(model)
    apply_method(get_method(method), q, QuantConfig.from_names("mxfp4", "mxfp4"), ctx)
    for layer in q.model.layers:
        for sub, name in (("self_attn", n) for n in ("q_proj", "k_proj", "v_proj")):
            assert getattr(getattr(layer, sub), name).input_quantizer.transform is None
        for name in ("gate_proj", "up_proj"):
            assert getattr(layer.mlp, name).input_quantizer.transform is None
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert linear.input_quantizer.transform.block_size == 32

    def key(*given: object) -> str:
        return record_key(
            RunConfig.of(model="m", methods=[method_spec(method, *given)]).record(), method
        )

    assert "residual" not in key()
    assert key(settings) != key()
