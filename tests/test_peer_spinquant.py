"""``benchmarks/peers/spinquant_mxfp4.py``: SpinQuant's integer quantizers replaced by MXFP4
with the straight-through gradient, and the CPU stand-ins its code needs without a GPU.

SpinQuant's own code is not here (it runs in FlatQuant's environment); these stand-in classes
carry only the attributes the replacements read, as SpinQuant's ``utils/quant_utils.py``
defines them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from torq.formats import get_format
from torq.formats.fake_quant import fake_quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import spinquant_mxfp4

FMT = get_format("mxfp4", "nearest")


def _stand_in() -> ModuleType:
    mod = ModuleType("quant_utils")

    class WeightQuantizer(torch.nn.Module):
        def __init__(self, bits: int) -> None:
            super().__init__()
            self.bits = bits

    class ActQuantizer(torch.nn.Module):
        def __init__(self, bits: int) -> None:
            super().__init__()
            self.bits = bits

    mod.WeightQuantizer = WeightQuantizer  # type: ignore[attr-defined]
    mod.ActQuantizer = ActQuantizer  # type: ignore[attr-defined]
    spinquant_mxfp4.install_mxfp4(mod, FMT)
    return mod


def test_weight_quantizer_is_mxfp4_in_training_and_in_rtn() -> None:
    mod = _stand_in()
    q = mod.WeightQuantizer(4)
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(1), requires_grad=True)
    q.find_params(w.detach())
    assert q.ready()
    # training (QuantizeLinear.forward): MXFP4 forward, identity gradient
    out = q.quantize(w)
    assert torch.equal(out.detach(), fake_quantize(w.detach(), FMT))
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    # its PTQ RTN (rtn_fwrd) reads the first of fake_quantize's three values
    deq, _, _ = q.fake_quantize(w.detach())
    assert torch.equal(deq, fake_quantize(w.detach(), FMT))
    assert torch.equal(mod.WeightQuantizer(16).quantize(w.detach()), w.detach())


def test_activation_quantizer_is_mxfp4_per_token_block() -> None:
    mod = _stand_in()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)) * 3
    q = mod.ActQuantizer(4)
    q.find_params(x)  # nothing to fit: the block scales come from x itself
    assert torch.equal(q(x), fake_quantize(x, FMT))
    assert torch.equal(mod.ActQuantizer(16)(x), x)


def test_sylvester_is_the_unnormalised_walsh_hadamard_matrix() -> None:
    h = spinquant_mxfp4.sylvester(64, torch.float64)
    assert torch.equal(h @ h.T, 64 * torch.eye(64, dtype=torch.float64))
    assert torch.equal(h, h.T)
    # natural (Sylvester) order: row i, column j is (-1)^popcount(i & j)
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in range(64)] for a in range(64)])
    assert torch.equal(h, (1 - 2 * parity).to(torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        spinquant_mxfp4.sylvester(48, torch.float64)


def test_fast_hadamard_stand_in_multiplies_by_the_matrix() -> None:
    spinquant_mxfp4.install_fast_hadamard_stub()
    from fast_hadamard_transform import hadamard_transform

    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(3))
    expected = x @ spinquant_mxfp4.sylvester(32, torch.float32) * 0.5
    assert torch.allclose(hadamard_transform(x, 0.5), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="maps cuda to the CPU only without one")
def test_cuda_on_cpu_maps_the_device_and_restores() -> None:
    to, cuda = torch.Tensor.to, torch.Tensor.cuda
    x = torch.ones(2)
    with spinquant_mxfp4.cuda_on_cpu():
        assert x.to("cuda").device.type == "cpu"
        y = x.to(device=torch.device("cuda"), dtype=torch.float64)
        assert y.device.type == "cpu" and y.dtype == torch.float64
        assert x.cuda() is x
    assert torch.Tensor.to is to and torch.Tensor.cuda is cuda


def test_gptq_columns_use_the_block_scales_fitted_at_the_block_start() -> None:
    mod = _stand_in()
    q = mod.WeightQuantizer(4)
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)) * 2
    for start in (0, 32):
        block = w[:, start : start + 32]
        q.find_params(block)  # its GPTQ: at each block's first column
        cols = [q.fake_quantize(block[:, i : i + 1]) for i in range(32)]
        deq = torch.cat([c[0] for c in cols], 1)
        # column by column on the block's scales = MXFP4 of the whole block
        assert torch.equal(deq, fake_quantize(block, FMT))
        codes, scales = cols[3][1], cols[3][2]
        assert torch.equal(codes * scales, cols[3][0])
