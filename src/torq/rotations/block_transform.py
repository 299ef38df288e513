"""An online transform with its own invertible matrix for each block of channels
(:class:`BlockMatrices`), and the WUSH transform that fills it (:func:`wush_matrices`).

WUSH (IST-DASLab, ICML 2026) is a closed-form, data-aware block transform. For each block
``b`` of ``K`` input channels, with the weight Gram ``G_W = W_bᵀ W_b`` and the activation
second moment ``G_X = E[x_b x_bᵀ]``, let ``G_W = L Lᵀ`` (Cholesky) and
``Lᵀ G_X L = U Λ Uᵀ`` (eigen-decomposition); then

    ``T_b = H_K Λ^{-1/4} Uᵀ Lᵀ``

(``H_K`` the normalized Hadamard). After it the activations and the fused weights
``W_b T_b⁻¹`` have the same Gram, ``H Λ^{1/2} Hᵀ``: their energy is balanced and spread by the
Hadamard over each block, which is what a block-scaled 4-bit format rounds best. ``T_b`` is
not orthogonal, so the weights take ``T⁻¹`` (not ``Tᵀ``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import saved_as


@saved_as("block_matrices")
class BlockMatrices(nn.Module):
    """The online forward transform ``z_b = T_b x_b``, one invertible ``K×K`` matrix per
    block of ``K`` channels (``matrices``: ``[n_blocks, K, K]``)."""

    def __init__(self, matrices: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if matrices.dim() != 3 or matrices.shape[1] != matrices.shape[2]:
            raise ValueError(f"block matrices are [n_blocks, K, K], got {tuple(matrices.shape)}")
        self.register_buffer("matrices", matrices.to(dtype).contiguous())
        self.n_blocks, self.block_size = int(matrices.shape[0]), int(matrices.shape[1])

    def saved_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Its manifest entry and tensors (:func:`torq.rotations.transform.saved_transform`)."""
        entry = {"block_size": self.block_size, "n_blocks": self.n_blocks}
        return entry, {"matrices": self.matrices.detach().cpu().contiguous()}

    @classmethod
    def from_saved(cls, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> BlockMatrices:
        """Built back from :meth:`saved_state`'s entry and tensors."""
        return cls(tensors["matrices"], dtype=tensors["matrices"].dtype)

    def served_form(self) -> str | None:
        """compressed-tensors holds no per-block matrices (:meth:`unserved_reason`)."""
        return None

    def unserved_reason(self) -> str:
        return "WUSH's per-block matrices"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        if d != self.n_blocks * self.block_size:
            raise ValueError(
                f"input width {d} does not match the transform's "
                f"{self.n_blocks}×{self.block_size} blocks"
            )
        y = x.reshape(-1, self.n_blocks, self.block_size)
        z = torch.einsum("tnj,nij->tni", y, self.matrices.to(y.dtype))
        return z.reshape(x.shape)

    @torch.no_grad()
    def fuse_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        """``W' = W T⁻¹`` (block by block ``W_b T_b⁻¹``, so ``W' T x = W x``), in float64,
        returned in W's dtype."""
        w64 = weight.detach().to(torch.float64)
        inverse = torch.linalg.inv(self.matrices.to(device=w64.device, dtype=torch.float64))
        n, k = self.n_blocks, self.block_size
        out = torch.einsum("onj,nji->oni", w64.reshape(-1, n, k), inverse)
        return out.reshape(weight.shape).to(weight.dtype)

    @torch.no_grad()
    def conjugate_hessian(self, h: torch.Tensor) -> torch.Tensor:
        """``T M Tᵀ`` of a ``[d, d]`` matrix (GPTQ's Hessian of ``T x`` from that of ``x``),
        in ``M``'s dtype and on its device."""
        n, k = self.n_blocks, self.block_size
        t = self.matrices.to(device=h.device, dtype=h.dtype)
        m = h.reshape(n, k, n, k)
        return torch.einsum("aip,apbq,bjq->aibj", t, m, t).reshape(h.shape)


def block_grams(gram: torch.Tensor, block: int) -> torch.Tensor:
    """The diagonal ``block×block`` blocks of a ``[d, d]`` matrix, ``[d / block, block, block]``."""
    n = gram.shape[0] // block
    g = gram.reshape(n, block, n, block)
    idx = torch.arange(n)
    return g[idx, :, idx, :]


def wush_matrices(
    weight_gram: torch.Tensor, act_gram: torch.Tensor, damp: float = 0.01
) -> torch.Tensor:
    """WUSH's ``T_b = H Λ^{-1/4} Uᵀ Lᵀ`` for each block (module doc), from the weight Grams
    ``W_bᵀ W_b`` and activation second moments ``E[x_b x_bᵀ]`` (``[n_blocks, K, K]`` each),
    in float64. Each Gram gets ``damp`` times its mean diagonal added to its diagonal first
    (as GPTQ damps its Hessian), so that a channel that never fires keeps ``T`` finite."""
    gw = weight_gram.to(torch.float64)
    gx = act_gram.to(torch.float64)
    k = gw.shape[-1]
    eye = torch.eye(k, dtype=torch.float64)

    def damped(g: torch.Tensor) -> torch.Tensor:
        mean = g.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
        return g + damp * mean[:, None, None] * eye

    lower = torch.linalg.cholesky(damped(gw))  # G_W = L Lᵀ
    m = lower.transpose(-2, -1) @ damped(gx) @ lower  # Lᵀ G_X L
    m = (m + m.transpose(-2, -1)) / 2
    eigenvalues, u = torch.linalg.eigh(m)
    scale = eigenvalues.clamp_min(1e-30) ** -0.25
    h = hadamard_matrix(k, dtype=torch.float64)
    return h @ (scale[:, :, None] * u.transpose(-2, -1)) @ lower.transpose(-2, -1)
