"""Packed MXFP4 experts against torq's fake-quant experts (``QuantExperts``).

The reference backend must give the fake-quant model's numbers (the same arithmetic); the
Triton backend (Triton's interpreter without a GPU) the same up to the order of its float32
sums.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from torq.formats import fake_quantize, get_format
from torq.kernels.experts import GROUPED_MAX_SLOTS, PackedMXFP4Experts
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import ActivationQuantizer, QuantConfig, QuantExperts

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MX = QuantConfig.from_names("mxfp4", "mxfp4")


def _experts() -> torch.nn.Module:
    return tiny_model("qwen3_moe").model.layers[0].mlp.experts


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen).softmax(-1)
    return index, weights


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q


def _calibrated(width: int, seed: int) -> BlockRotation:
    """A transform of TORQ's full form: channel scale, inter-block and intra-block rotation."""
    gen = torch.Generator().manual_seed(seed)
    b = width // 32
    return BlockRotation(
        32,
        r_inter=torch.stack([_orthogonal(b, gen) for _ in range(32)]),
        r_intra=_orthogonal(32, gen),
        channel_scale=torch.rand(width, generator=gen) + 0.5,
    )


def _h32(width: int) -> BlockRotation:
    return BlockRotation(32, r_intra=hadamard_matrix(32, dtype=torch.float64))


def _quant_experts(transforms: str) -> QuantExperts:
    """Fake-quant experts of the tiny Qwen3-MoE whose weights carry the inverse of the given
    online transforms: none, the 32-block Hadamard on both inputs, a calibrated input
    transform with a Hadamard on each expert's down_proj input but one, or calibrated
    transforms on the input and one shared by the down_proj inputs."""
    ex = _experts()
    gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
    e, _, h = gu.shape
    i = dn.shape[-1]
    if transforms == "none":
        return QuantExperts(ex, MX)
    if transforms == "h32":
        t_in, t_down = _h32(h), [_h32(i)]
    elif transforms == "calibrated-shared":
        t_in, t_down = _calibrated(h, 1), [_calibrated(i, 2)]
    else:
        t_in = _calibrated(h, 1)
        t_down = [_h32(i) if j else _calibrated(i, 2 + j) for j in range(e)]
    gu = t_in.fuse_inverse(gu.reshape(-1, h)).reshape(gu.shape)
    dn = torch.stack([t_down[j % len(t_down)].fuse_inverse(dn[j]) for j in range(e)])
    fmt = get_format("mxfp4")
    return QuantExperts.from_quantized(
        ex.act_fn,
        fake_quantize(gu, fmt),
        fake_quantize(dn, fmt),
        MX,
        ActivationQuantizer(MX.activation, t_in),
        [ActivationQuantizer(MX.activation, t) for t in t_down],
    )


@pytest.mark.parametrize("transforms", ["none", "h32", "calibrated"])
def test_reference_backend_is_the_fake_quant_experts(transforms: str) -> None:
    qe = _quant_experts(transforms)
    packed = PackedMXFP4Experts.from_quant_experts(qe, backend="reference")
    x = torch.randn(11, qe.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(3))
    index, weights = _routing(11, qe.num_experts, 2, 4)
    torch.testing.assert_close(packed(x, index, weights), qe(x, index, weights), rtol=0, atol=1e-6)
    # a plain 32-block Hadamard runs inside the kernels, anything else as a torch module
    has_block = packed.block_transform is not None
    assert has_block == (transforms == "h32")
    assert (packed.input_transform is not None) == (transforms == "calibrated")


@pytest.mark.parametrize(
    ("tokens", "transforms"),
    [(1, "h32"), (3, "calibrated"), (8, "h32"), (4, "calibrated-shared"), (16, "none")],
)
def test_triton_backend_matches_the_reference(tokens: int, transforms: str) -> None:
    """Per expert (``mxfp4_linear``) and, for few tokens with one down_proj transform, the
    grouped decode GEMV."""
    qe = _quant_experts(transforms)
    ref = PackedMXFP4Experts.from_quant_experts(qe, backend="reference").to(DEVICE)
    tri = PackedMXFP4Experts.from_quant_experts(qe, backend="triton").to(DEVICE)
    x = torch.randn(tokens, qe.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(5))
    index, weights = _routing(tokens, qe.num_experts, 2, 6)
    args = (x.to(DEVICE), index.to(DEVICE), weights.to(DEVICE))
    y, y_ref = tri(*args), ref(*args)
    err = float((y.double() - y_ref.double()).norm() / y_ref.double().norm())
    assert err < 1e-5
    grouped = tokens * 2 <= GROUPED_MAX_SLOTS and len(tri.down_transforms) == 1
    assert grouped == (transforms != "calibrated" and tokens * 2 <= GROUPED_MAX_SLOTS)
    if grouped:  # the forward took the grouped path; the per-expert one agrees with it
        per_expert = tri.run(args[0], tri.routes(args[1]), args[2])
        assert float((y - per_expert).norm() / per_expert.norm()) < 1e-5


def test_packed_size_and_refusals() -> None:
    qe = _quant_experts("none")
    packed = PackedMXFP4Experts.from_quant_experts(qe)
    weights = qe.gate_up_proj.numel() + qe.down_proj.numel()
    assert packed.nbytes * 8 == weights * 4.25  # two codes a byte, one scale per 32
    qe.config = QuantConfig.from_names("mxfp4", "mxfp4", scale_mode="paper")
    with pytest.raises(ValueError, match="the OCP or nearest rule"):
        PackedMXFP4Experts.from_quant_experts(qe)
    qe.config = QuantConfig.from_names("mxfp4", "mxfp4", scale_mode="nearest")
    assert PackedMXFP4Experts.from_quant_experts(qe).nearest
    with pytest.raises(ValueError, match="one shared or one per expert"):
        PackedMXFP4Experts(qe.gate_up_proj, qe.down_proj, qe.act_fn, None, [_h32(64), _h32(64)])
    # one module for every expert is the shared case
    same = _h32(64)
    shared = PackedMXFP4Experts(qe.gate_up_proj, qe.down_proj, qe.act_fn, None, [same] * 4)
    assert len(shared.down_transforms) == 1
