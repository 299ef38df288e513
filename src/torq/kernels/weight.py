"""The packed MXFP4 weight operand of the W4A4 kernels (paper eq. 1, OCP scale rule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torq.formats import dequantize, get_format, quantize
from torq.formats.packed import PackedTensor
from torq.kernels.config import (
    FP8_EXACT_SPAN,
    FP8_MIN_ROW_EXPONENT,
    FP8_ROW_HEADROOM,
    MAX_KERNEL_SCALE_BYTE,
)


@dataclass
class MXFP4Weight:
    """A weight ``W [N, K]`` in packed MXFP4: ``codes uint8 [N, Kp/2]``, ``scales uint8
    [N, Kp/32]`` (E8M0), ``Kp = ceil(K/32)·32``; padding elements are code 0."""

    codes: torch.Tensor
    scales: torch.Tensor
    in_features: int
    # FP8 prefill path (fp8_rows): each row's shift r_n (int32 [N]), its scale
    # 2**(r_n − 6) (float32 [1, N]) and whether every row's values are exact in E4M3 after
    # it; computed on first use when not given, then cached.
    fp8_row_exponents: torch.Tensor | None = None
    fp8_exact: bool | None = None
    fp8_row_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> MXFP4Weight:
        """Quantize a float weight with the OCP scale rule (method notes, section 1)."""
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in], got shape {tuple(weight.shape)}")
        if not torch.isfinite(weight).all():
            raise ValueError("the weight holds NaN or Inf; refusing to pack it")
        packed = quantize(weight.detach(), get_format("mxfp4"))
        if int(packed.scales.max()) > MAX_KERNEL_SCALE_BYTE:
            raise ValueError("weight magnitudes of 2**115 or more are outside the kernel's range")
        packed_weight = cls(
            packed.codes.contiguous(), packed.scales.contiguous(), int(weight.shape[1])
        )
        packed_weight.fp8_rows()
        return packed_weight

    def fp8_rows(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Row shifts of the FP8 prefill path: ``(r int32 [N], scale float32 [1, N], exact)``.

        ``r_n`` is row ``n``'s largest block exponent (at least −120); the row is written
        in E4M3 as ``Q(W)_n · 2**(6 − r_n)`` and multiplied back by ``scale_n =
        2**(r_n − 6)``. E4M3 holds E2M1 values times ``2**j`` exactly for ``j`` in [−8, 6],
        so the row is exact iff every block holding a nonzero code has a scale of at least
        ``2**(r_n − 14)``; ``exact`` says whether that holds for every row (checked once per
        weight, cached)."""
        if self.fp8_row_exponents is None or self.fp8_exact is None:
            n = self.out_features
            exponents = self.scales.to(torch.int32) - 127
            rows = exponents.amax(dim=1).clamp(min=FP8_MIN_ROW_EXPONENT)
            nonzero = (self.codes.view(n, -1, 16) & 0x77).ne(0).any(dim=-1)
            low = exponents < rows[:, None] - FP8_EXACT_SPAN
            self.fp8_row_exponents = rows.to(torch.int32).contiguous()
            self.fp8_exact = not bool((low & nonzero).any())
        if self.fp8_row_scale is None:
            biased = self.fp8_row_exponents - FP8_ROW_HEADROOM + 127
            self.fp8_row_scale = (biased << 23).view(torch.float32).reshape(1, -1)
        return self.fp8_row_exponents, self.fp8_row_scale, self.fp8_exact

    def to_packed_tensor(self) -> PackedTensor:
        return PackedTensor(
            fmt=get_format("mxfp4"),
            codes=self.codes,
            scales=self.scales,
            tensor_scale=None,
            shape=(self.out_features, self.in_features),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.to_packed_tensor(), dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel()
