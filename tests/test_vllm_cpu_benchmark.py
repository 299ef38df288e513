"""``benchmarks/vllm_cpu.py``'s stand-ins for vLLM's GPU-only routines compute what those
routines do: compressed-tensors' MXFP4 weight layout, and the normalized Hadamard."""

from __future__ import annotations

import torch
from benchmarks.vllm_cpu import _dequantize, _hadamard
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

from torq.rotations.hadamard import hadamard_matrix


def test_the_weight_stand_in_reads_compressed_tensors_packing() -> None:
    """E2M1 values packed by compressed-tensors' own packer, with E8M0 scales, come back as
    the values times two to the scale's exponent."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    gen = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(6, 64, generator=gen) < 0.5, -1.0, 1.0)
    values = grid[torch.randint(0, 8, (6, 64), generator=gen)] * signs
    scales = torch.randint(120, 135, (6, 2), generator=gen, dtype=torch.uint8)
    got = _dequantize(pack_fp4_to_uint8(values), scales, torch.float32)
    want = values * torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert torch.equal(got, want)


def test_the_hadamard_stand_in_is_the_normalized_sylvester_matrix() -> None:
    """Hadacore multiplies the last dimension by the normalized Sylvester Hadamard: torq's
    32-point matrix, which is symmetric, so the side does not matter."""
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    h = hadamard_matrix(32).float()
    assert torch.allclose(_hadamard(x), x @ h, atol=1e-6)
    assert torch.equal(h, h.T)
