"""Model surgery on tiny random models of every supported architecture."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import tiny_model
from torq.formats import fake_quantize, get_format
from torq.models import decoder_layers
from torq.surgery import QuantConfig, QuantExperts, QuantLinear, quantize_model

MXFP4 = QuantConfig.from_names("mxfp4", "mxfp4")


def _logits(model: nn.Module, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _linears_in_layers(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in decoder_layers(model).modules())


def test_every_decoder_linear_is_replaced(arch: str) -> None:
    model = tiny_model(arch)
    n_linear = _linears_in_layers(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    counts = quantize_model(model, MXFP4)
    layers = decoder_layers(model)
    assert not any(
        isinstance(m, nn.Linear) and not isinstance(m, QuantLinear) for m in layers.modules()
    )
    assert counts["linear"] == sum(isinstance(m, QuantLinear) for m in layers.modules())
    assert counts["linear"] == n_linear
    # Outside the decoder stack nothing changes type.
    assert model.get_input_embeddings() is embed
    assert model.get_output_embeddings() is head
    assert type(model.get_output_embeddings()) is nn.Linear
    if arch == "qwen3_moe":
        assert counts["experts"] == len(layers)
        assert counts["kept_router"] == len(layers)
        assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in layers)
    else:
        assert counts["experts"] == 0
        assert counts["linear"] == 7 * len(layers)


def test_float_config_is_the_identity(arch: str) -> None:
    model = tiny_model(arch)
    ref = _logits(model)
    quantize_model(model, QuantConfig(weight=None, activation=None))
    torch.testing.assert_close(_logits(model), ref, rtol=1e-5, atol=1e-5)


def test_w4a4_changes_output_but_stays_finite(arch: str) -> None:
    model = tiny_model(arch)
    ref = _logits(model)
    qmodel = copy.deepcopy(model)
    quantize_model(qmodel, MXFP4)
    out = _logits(qmodel)
    assert torch.isfinite(out).all()
    rel = (out - ref).norm() / ref.norm()
    assert 1e-3 < rel < 1.0, f"relative logit error {rel:.3g} out of the plausible W4A4 range"


def test_quant_linear_weights_and_inputs_lie_on_the_grid() -> None:
    fmt = get_format("mxfp4")
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, bias=True)
    q = QuantLinear.from_linear(lin, QuantConfig(weight=fmt, activation=fmt))
    assert torch.equal(q.weight, fake_quantize(lin.weight.detach(), fmt))
    assert torch.equal(q.bias, lin.bias.detach())
    x = torch.randn(3, 5, 96) * 4
    seen: list[torch.Tensor] = []
    q.register_forward_hook(lambda m, i, o: seen.append(m.quantize_input(i[0])))
    y = q(x)
    xq = seen[0]
    # Quantize-dequantize is idempotent: the layer's input is already on the MXFP4 grid.
    assert torch.equal(fake_quantize(xq, fmt), xq)
    torch.testing.assert_close(y, torch.nn.functional.linear(xq, q.weight, q.bias))


def test_weight_only_and_activation_only() -> None:
    fmt = get_format("mxfp4")
    torch.manual_seed(0)
    lin = nn.Linear(64, 16)
    x = torch.randn(4, 64)
    w_only = QuantLinear.from_linear(lin, QuantConfig(weight=fmt, activation=None))
    a_only = QuantLinear.from_linear(lin, QuantConfig(weight=None, activation=fmt))
    with torch.no_grad():
        torch.testing.assert_close(
            w_only(x), nn.functional.linear(x, fake_quantize(lin.weight, fmt), lin.bias)
        )
        torch.testing.assert_close(a_only(x), lin(fake_quantize(x, fmt)))


def test_quant_experts_match_reference_loop() -> None:
    model = tiny_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    fmt = get_format("mxfp4")
    q = QuantExperts(experts, QuantConfig(weight=fmt, activation=fmt))
    torch.manual_seed(0)
    x = torch.randn(10, 64)
    idx = torch.randint(0, 4, (10, 2))
    wts = torch.rand(10, 2)
    expected = torch.zeros_like(x)
    gu = fake_quantize(experts.gate_up_proj.detach(), fmt)
    dn = fake_quantize(experts.down_proj.detach(), fmt)
    for t in range(10):
        for k in range(2):
            e = int(idx[t, k])
            g, u = (fake_quantize(x[t], fmt) @ gu[e].T).chunk(2)
            h = fake_quantize(experts.act_fn(g) * u, fmt)
            expected[t] += wts[t, k] * (h @ dn[e].T)
    with torch.no_grad():
        torch.testing.assert_close(q(x, idx, wts), expected, rtol=1e-5, atol=1e-5)


def test_unsupported_model_is_a_clear_error() -> None:
    from torq.errors import TorqError

    with pytest.raises(TorqError, match="decoder layers"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), MXFP4)


def test_shared_input_quantizer_computes_once_per_tensor() -> None:
    from torq.surgery.qlinear import ActivationQuantizer

    fmt = get_format("mxfp4")
    calls = []

    class CountingIdentity(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x.clone()

    shared = ActivationQuantizer(fmt, CountingIdentity())
    layers = [
        QuantLinear(torch.randn(8, 32), None, QuantConfig(fmt, fmt), input_quantizer=shared)
        for _ in range(3)
    ]
    x = torch.randn(4, 32)
    outs = [lin(x) for lin in layers]
    assert len(calls) == 1 and shared._last is None  # served all three, then released
    expected = [nn.functional.linear(fake_quantize(x, fmt), lin.weight) for lin in layers]
    for o, e in zip(outs, expected, strict=True):
        torch.testing.assert_close(o, e)
    x.mul_(2)  # an in-place change must not be served from the cache
    layers[0](x)
    layers[1](x.clone())
    assert len(calls) == 3
