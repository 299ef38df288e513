"""``torch.ops.torq.mxfp4_linear``: the packed layer's product as a PyTorch operator."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kernels.test_triton_mxfp4 import DEVICE, _torq_rotation
from torq.kernels import PackedMXFP4Linear
from torq.kernels.ops import mxfp4_linear_op


def _layer(backend: str, bias: bool = True) -> PackedMXFP4Linear:
    gen = torch.Generator().manual_seed(3)
    rotation = _torq_rotation(4, gen)
    linear = nn.Linear(128, 48, bias=bias)
    return PackedMXFP4Linear.from_linear(linear, input_transform=rotation, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_the_operator_computes_the_layer(backend: str, tokens: int) -> None:
    """Through the operator (TORQ's transform passed as its tensors and rebuilt inside) the
    layer gives its own output bit for bit: on the Triton kernels (in the interpreter on a
    CPU) by token count the fused pre-pass (1), the GEMV on rows (3) and the tensor-core
    matmul with the transform run before it (9), and on the reference."""
    layer = _layer(backend).to(DEVICE)
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    with torch.no_grad():
        assert torch.equal(layer.as_operator(x), layer(x))


def test_the_operator_passes_torch_library_checks() -> None:
    """``torch.library.opcheck``: the schema, the shape function against the real output, and
    the operator under dynamo and AOT autograd's tracing (reference arithmetic)."""
    layer = _layer("reference", bias=False)
    t = layer.input_transform
    args = (
        torch.randn(2, 5, 128),
        layer.codes,
        layer.scales,
        128,
        None,
        None,
        t.channel_scale,
        t.r_inter,
        t.r_intra,
        layer.fp8_row_exponents,
        layer.fp8_row_scale,
        layer.fp8_exact,
        False,
        "reference",
    )
    torch.library.opcheck(mxfp4_linear_op, args)
    assert mxfp4_linear_op(*args).shape == (2, 5, 48)
