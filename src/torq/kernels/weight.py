"""The packed MXFP4 weight operand of the W4A4 kernels (paper eq. 1, OCP scale rule)."""

from __future__ import annotations

import torch

from torq.formats import get_format, pack_exact, quantize
from torq.formats.packed import PackedTensor
from torq.kernels.config import (
    FP8_EXACT_SPAN,
    FP8_MIN_ROW_EXPONENT,
    FP8_ROW_HEADROOM,
    MAX_KERNEL_SCALE_BYTE,
)


class MXFP4Weight(PackedTensor):
    """A linear weight ``W [N, K]`` in packed MXFP4 as the kernels read it: the
    :class:`~torq.formats.packed.PackedTensor` every quantized weight of torq is held as
    (``codes uint8 [N, Kp/2]``, ``scales uint8 [N, Kp/32]`` E8M0, ``Kp = ceil(K/32)·32``,
    padding elements code 0), 2-D and in MXFP4, with the FP8 prefill path's row shifts
    cached beside it."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        fp8_row_exponents: torch.Tensor | None = None,
        fp8_exact: bool | None = None,
        fp8_row_scale: torch.Tensor | None = None,
    ) -> None:
        if codes.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in], got codes {tuple(codes.shape)}")
        super().__init__(
            fmt=get_format("mxfp4"),
            codes=codes,
            scales=scales,
            tensor_scale=None,
            shape=(int(codes.shape[0]), int(in_features)),
        )
        # FP8 prefill path (fp8_rows): each row's shift r_n (int32 [N]), its scale
        # 2**(r_n − 6) (float32 [1, N]) and whether every row's values are exact in E4M3
        # after it; computed on first use when not given, then cached.
        self.fp8_row_exponents = fp8_row_exponents
        self.fp8_exact = fp8_exact
        self.fp8_row_scale = fp8_row_scale

    @property
    def in_features(self) -> int:
        return int(self.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.shape[0])

    @classmethod
    def from_packed(cls, packed: PackedTensor) -> MXFP4Weight:
        """The kernels' view of a packed weight (a ``ValueError`` when it is not a 2-D
        MXFP4 weight with OCP's block size, or its scales leave the kernels' range)."""
        if packed.fmt.name != "mxfp4" or packed.fmt.block_size != 32:
            raise ValueError(
                f"the kernels take MXFP4 with blocks of 32, not {packed.fmt.name} with "
                f"blocks of {packed.fmt.block_size}"
            )
        if len(packed.shape) != 2:
            raise ValueError(f"a linear weight is 2-D [out, in], got shape {packed.shape}")
        if packed.scales.numel() and int(packed.scales.max()) > MAX_KERNEL_SCALE_BYTE:
            raise ValueError("weight magnitudes of 2**115 or more are outside the kernel's range")
        weight = cls(packed.codes.contiguous(), packed.scales.contiguous(), packed.shape[1])
        weight.fp8_rows()
        return weight

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> MXFP4Weight:
        """Quantize a float weight with the OCP scale rule (method notes, section 1)."""
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in], got shape {tuple(weight.shape)}")
        if not torch.isfinite(weight).all():
            raise ValueError("the weight holds NaN or Inf; refusing to pack it")
        return cls.from_packed(quantize(weight.detach(), get_format("mxfp4")))

    @classmethod
    def from_quantized(cls, weight: torch.Tensor) -> MXFP4Weight:
        """The packed form of a weight already on the MXFP4 grid (whatever scale rule chose
        it), found exactly (:func:`~torq.formats.packed.pack_exact`); a ``ValueError`` when
        it is not on the grid."""
        packed = pack_exact(weight.detach().float(), get_format("mxfp4"))
        if packed is None:
            raise ValueError("its weight is not on the MXFP4 grid (not packed exactly)")
        return cls.from_packed(packed)

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

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel()
