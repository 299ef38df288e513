"""One quantized weight: the packed form (codes, scales, format) that a quantized layer
gives, a checkpoint stores, the kernels read and compressed-tensors exports."""

from __future__ import annotations

import pytest
import torch

from torq.formats import PackedTensor, fake_quantize, get_format, pack_exact, quantize
from torq.kernels.weight import MXFP4Weight
from torq.surgery.qlinear import QuantConfig, QuantExperts, QuantLinear


@pytest.mark.parametrize(
    ("name", "scale_mode"),
    [
        ("mxfp4", "ocp"),
        ("mxfp4", "nearest"),
        ("mxfp4", "rceil"),
        ("mxint4", "ocp"),
        ("nvfp4", "ocp"),
    ],
)
def test_a_quantized_layer_packs_its_weight_exactly(name: str, scale_mode: str) -> None:
    torch.manual_seed(0)
    spec = get_format(name, scale_mode)
    layer = QuantLinear(torch.randn(24, 80), None, QuantConfig(weight=spec, activation=spec))
    packed = layer.packed_weight()
    assert packed is not None and packed.fmt == spec and packed.shape == (24, 80)
    assert torch.equal(packed.dequantize(), layer.weight)
    state = packed.to_state()
    assert set(state) == {"codes", "scales"} | ({"tensor_scale"} if name == "nvfp4" else set())
    again = PackedTensor.from_state(spec, (24, 80), **state)
    assert torch.equal(again.dequantize(), layer.weight)


def test_a_weight_off_the_grid_or_unquantized_has_no_packed_form() -> None:
    spec = get_format("mxfp4")
    w = torch.randn(8, 64)
    assert pack_exact(w, spec) is None  # not on the grid
    assert pack_exact(fake_quantize(w, spec), spec) is not None
    bad = fake_quantize(w, spec)
    bad[0, 0] = float("nan")
    assert pack_exact(bad, spec) is None
    nv = get_format("nvfp4")
    assert pack_exact(fake_quantize(w, nv), nv) is None  # NVFP4 needs its tensor scale
    fp = QuantLinear(w, None, QuantConfig(weight=None, activation=None))
    assert fp.packed_weight() is None


def test_stored_tensors_that_do_not_fit_the_shape_are_refused() -> None:
    spec = get_format("mxfp4")
    state = quantize(torch.randn(8, 64), spec)
    with pytest.raises(ValueError, match=r"do not fit the shape \(8, 96\)"):
        PackedTensor.from_state(spec, (8, 96), state.codes, state.scales)
    nv = quantize(torch.randn(8, 64), "nvfp4")
    with pytest.raises(ValueError, match="tensor scale"):
        PackedTensor.from_state(get_format("nvfp4"), (8, 64), nv.codes, nv.scales)


def test_the_kernels_weight_is_the_packed_weight() -> None:
    """The kernels' operand is a :class:`PackedTensor` (MXFP4, 2-D) made from a layer's
    packed form, whatever rule chose its scales; other forms are refused with the reason."""
    torch.manual_seed(1)
    spec = get_format("mxfp4", "nearest")
    layer = QuantLinear(torch.randn(16, 70), None, QuantConfig(weight=spec, activation=spec))
    packed = layer.packed_weight()
    assert packed is not None
    kernel = MXFP4Weight.from_packed(packed)
    assert isinstance(kernel, PackedTensor)
    assert (kernel.out_features, kernel.in_features) == (16, 70)
    assert torch.equal(kernel.dequantize(), layer.weight)
    assert torch.equal(MXFP4Weight.from_quantized(layer.weight).dequantize(), layer.weight)
    with pytest.raises(ValueError, match="not on the MXFP4 grid"):
        MXFP4Weight.from_quantized(torch.randn(16, 70))
    with pytest.raises(ValueError, match="not mxint4"):
        MXFP4Weight.from_packed(quantize(torch.randn(4, 32), "mxint4"))


def test_fused_experts_pack_both_projections() -> None:
    torch.manual_seed(2)
    spec = get_format("mxfp4")
    gu = fake_quantize(torch.randn(3, 8, 32), spec)
    dn = fake_quantize(torch.randn(3, 32, 4 * 8), spec)
    experts = QuantExperts.from_quantized(torch.nn.SiLU(), gu, dn, QuantConfig(spec, spec))
    packed_gu, packed_dn = experts.packed_weights()
    assert packed_gu is not None and packed_dn is not None
    assert torch.equal(packed_gu.dequantize(), gu) and torch.equal(packed_dn.dequantize(), dn)
