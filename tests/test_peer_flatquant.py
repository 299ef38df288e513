"""``benchmarks/peers/flatquant_mxfp4.py``: FlatQuant's integer quantizers replaced by MXFP4
with the straight-through gradient, and LAC's clipping applied per block of 32.

FlatQuant's own code is not here (it runs in its own environment); these stand-in classes
carry only the attributes the replacements read, as FlatQuant's ``quant_utils`` defines them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import torch

from torq.formats import get_format
from torq.formats.fake_quant import fake_quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import flatquant_mxfp4

FMT = get_format("mxfp4", "ocp")


def _stand_in() -> ModuleType:
    mod = ModuleType("quant_utils")

    class WeightQuantizer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enable, self.bits = True, 4

    class ActivationQuantizer(torch.nn.Module):
        def __init__(self, lac: bool, init: float) -> None:
            super().__init__()
            self.lac = lac
            self.sigmoid = torch.nn.Sigmoid()
            self.clip_factor_a_max = torch.nn.Parameter(torch.ones(1) * init)
            self.clip_factor_a_min = torch.nn.Parameter(torch.ones(1) * init)

    mod.WeightQuantizer = WeightQuantizer  # type: ignore[attr-defined]
    mod.ActivationQuantizer = ActivationQuantizer  # type: ignore[attr-defined]
    flatquant_mxfp4.install_mxfp4(mod, FMT)
    return mod


def test_ste_forward_is_mxfp4_and_backward_is_identity() -> None:
    x = torch.randn(3, 64, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    x.requires_grad_(True)
    y = flatquant_mxfp4.mxfp4_ste(x, FMT)
    assert torch.equal(y.detach(), fake_quantize(x.detach(), FMT))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0).expand(3, 64))


def test_weight_quantizer_is_mxfp4_per_row_block() -> None:
    mod = _stand_in()
    q = mod.WeightQuantizer()
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(1))
    q.find_params(w)
    assert q.ready()
    assert torch.equal(q.quantize(w), fake_quantize(w, FMT))
    q.enable = False
    assert torch.equal(q.quantize(w), w)


def test_lac_clamps_each_block_then_quantizes() -> None:
    mod = _stand_in()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)) * 3
    # sigmoid(0) = 1/2: every block is clamped to half its own max and half its own min.
    half = mod.ActivationQuantizer(lac=True, init=0.0)
    blocks = x.reshape(-1, 2, 32)
    hi = blocks.amax(-1, keepdim=True).clamp(min=0) / 2
    lo = blocks.amin(-1, keepdim=True).clamp(max=0) / 2
    clamped = torch.maximum(torch.minimum(blocks, hi), lo).reshape(x.shape)
    out = half.fake_quant(x)
    assert torch.equal(out.detach(), fake_quantize(clamped, FMT))
    out.sum().backward()
    # the clamp carries a gradient to both learned factors (the power-of-two scale cannot)
    assert half.clip_factor_a_max.grad.abs().item() > 0
    assert half.clip_factor_a_min.grad.abs().item() > 0
    # without LAC the activation is plain MXFP4
    plain = mod.ActivationQuantizer(lac=False, init=0.0)
    assert torch.equal(plain.fake_quant(x), fake_quantize(x, FMT))
