"""Static NVFP4 activation tensor scales (``act_scale="static"``): the format, the
quantizer's observation, the driver's calibration pass, checkpoints, and the CLI's checks."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_model
from tests.methods.conftest import corpus as corpus
from tests.methods.test_torq_method import _apply, _settings
from torq.formats import fake_quantize, get_format
from torq.formats.reference import nvfp4_tensor_scale, tensor_amax
from torq.surgery import QuantConfig
from torq.surgery.qlinear import ActivationQuantizer, QuantLinear, calibrate_activation_scales

NV = get_format("nvfp4")


def test_a_given_tensor_scale_is_the_dynamic_one_at_the_tensors_own_amax() -> None:
    """``fake_quantize(x, nvfp4, g)`` is NVFP4 with the tensor scale ``g``: at ``x``'s own
    ``amax / 2688`` it is the dynamic quantization bit for bit; a smaller ``g`` (a calibrated
    amax below this tensor's) saturates the values past it at ``±6 · 448 · g``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen) * 3
    own = nvfp4_tensor_scale(tensor_amax(x))
    assert torch.equal(fake_quantize(x, NV, own), fake_quantize(x, NV))
    small = own / 4
    y = fake_quantize(x, NV, small)
    assert float(y.abs().max()) == pytest.approx(6 * 448 * float(small), rel=1e-6)
    inside = x.abs() < 0.2 * float(x.abs().max())
    assert bool(torch.isfinite(y).all()) and bool((y[inside] != 0).any())
    with pytest.raises(ValueError, match="NVFP4's"):
        fake_quantize(x, get_format("mxfp4"), own)


def test_quantconfig_refuses_a_static_scale_without_nvfp4_activations() -> None:
    assert QuantConfig.from_names("nvfp4", "nvfp4", act_scale="static").static_activations
    with pytest.raises(ValueError, match="NVFP4's"):
        QuantConfig.from_names("mxfp4", "mxfp4", act_scale="static")
    with pytest.raises(ValueError, match="NVFP4's"):
        QuantConfig.from_names("nvfp4", None, act_scale="static")
    # the default leaves the recorded config as it was
    assert "act_scale" not in QuantConfig.from_names("nvfp4", "nvfp4").to_dict()


def test_observation_takes_the_largest_transformed_input_of_a_shared_quantizer() -> None:
    """Two linears reading one tensor share a quantizer: observed once per tensor, its scale
    is ``max |T x| / 2688`` over every call, and afterwards it quantizes with that scale."""
    gen = torch.Generator().manual_seed(1)
    transform = torch.nn.Linear(32, 32, bias=False)
    config = QuantConfig.from_names("nvfp4", "nvfp4", act_scale="static")
    shared = ActivationQuantizer(config.activation, transform)
    a = QuantLinear(torch.randn(16, 32, generator=gen), None, config, input_quantizer=shared)
    b = QuantLinear(torch.randn(8, 32, generator=gen), None, config, input_quantizer=shared)
    module = torch.nn.ModuleList([a, b])
    xs = [torch.randn(5, 32, generator=gen) * s for s in (1.0, 4.0, 2.0)]

    def forward() -> list[torch.Tensor]:
        return [a(x) + b(x).sum() for x in xs]

    with torch.no_grad():
        dynamic = forward()
        observed, counts = calibrate_activation_scales(module, forward)
        expected = max(float(transform(x).abs().max()) for x in xs)
        assert counts == {"static": 1, "unobserved": 0}
        assert all(torch.equal(o, d) for o, d in zip(observed, dynamic, strict=True))
        g = shared.tensor_scale
        assert g is not None and float(g) == float(nvfp4_tensor_scale(torch.tensor(expected)))
        # the largest input (×4) quantized with its own scale: the calibrated one is that
        assert expected == float(transform(xs[1]).abs().max())
        own = torch.nn.functional.linear(fake_quantize(transform(xs[1]), NV), a.weight)
        assert torch.equal(a(xs[1]), own)
        small = fake_quantize(transform(xs[0]), NV, g)
        assert torch.equal(shared(xs[0].clone()), small)


@pytest.mark.parametrize("method", ["rtn", "had32", "torq-had32", "gptq"])
def test_every_activation_quantizer_gets_a_static_scale_from_calibration(
    method, corpus, tiny_tokenizer
) -> None:
    """``act_scale="static"``: every method (fixed transforms too) reads the calibration
    windows and each of the model's NVFP4 activation quantizers ends with a static scale,
    recorded per layer; the float-equivalent model differs from the dynamic one."""
    model = tiny_model("llama")
    ids = torch.randint(
        0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2)
    )
    static, dynamic = copy.deepcopy(model), copy.deepcopy(model)
    settings = _settings(corpus)
    record = _apply(
        static,
        method,
        QuantConfig.from_names("nvfp4", "nvfp4", act_scale="static"),
        settings,
        tiny_tokenizer,
    )
    _apply(dynamic, method, QuantConfig.from_names("nvfp4", "nvfp4"), settings, tiny_tokenizer)
    quantizers = {m for m in static.modules() if isinstance(m, ActivationQuantizer)}
    assert quantizers and all(q.tensor_scale is not None for q in quantizers)
    assert record["act_scale"] == "static"
    assert all(layer["activation_scales"]["static"] > 0 for layer in record["layers"])
    with torch.no_grad():
        a, b = static(input_ids=ids).logits, dynamic(input_ids=ids).logits
    assert bool(torch.isfinite(a).all()) and not torch.equal(a, b)


def test_static_scales_survive_a_checkpoint(corpus, tiny_tokenizer, tmp_path) -> None:
    from torq.export import load_quantized, save_quantized

    model = tiny_model("qwen2")
    qconfig = QuantConfig.from_names("nvfp4", "nvfp4", act_scale="static")
    _apply(model, "had32", qconfig, _settings(corpus), tiny_tokenizer)
    save_quantized(model, tmp_path / "saved", tiny_tokenizer, method="had32")
    loaded, _, _ = load_quantized(tmp_path / "saved")
    scales = {
        n: float(m.input_quantizer.tensor_scale)
        for n, m in model.named_modules()
        if isinstance(m, QuantLinear)
    }
    again = {
        n: float(m.input_quantizer.tensor_scale)
        for n, m in loaded.named_modules()
        if isinstance(m, QuantLinear)
    }
    assert scales == again
    ids = torch.randint(
        0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_cli_checks_the_static_scale_before_any_work(tiny_checkpoint, tmp_path, capsys) -> None:
    from torq.cli import main

    base = ["run", "--model", str(tiny_checkpoint), "--methods", "rtn", "--no-progress"]
    assert main([*base, "--act-scale", "static", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "--act-scale static is NVFP4's" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()
