"""Packed MXFP4 linear layers: real W4A4 inference on GPUs, the fake-quant reference elsewhere.

:class:`PackedMXFP4Linear` holds only the packed weight (two E2M1 codes per byte, one E8M0
scale byte per 32 inputs) and computes ``y = Q(T x) · Q(W')ᵀ + b`` (the paper's
Algorithm 3, option B). On a CUDA device it runs the Triton kernels of
:mod:`torq.kernels.triton_mxfp4`: for one token an int8 pre-pass (with TORQ's online
transform fused in, when the layer has one) and an integer ``dp4a`` GEMV (2–4 tokens:
the same GEMV on several rows); for 5–255 tokens a tensor-core matmul; for more, both
operands' MXFP4 values as E4M3 with power-of-two row scales and the vendor's FP8 GEMM
(exact; GPUs with FP8 tensor cores), else as bf16 and the vendor's bf16 GEMM. On a CPU
it runs the reference: :func:`torq.formats.fake_quantize` on the activation and the
dequantized weight, which is the same arithmetic, so the same model code runs everywhere.

The package follows one product's path: :mod:`~torq.kernels.weight` (the packed operand),
:mod:`~torq.kernels.config` (launch configurations and the default per token count),
:mod:`~torq.kernels.dispatch` (Triton or the reference, and which launch),
:mod:`~torq.kernels.launch` (pre-passes and kernel launches), :mod:`~torq.kernels.ops` (the
product as a PyTorch operator, which ``torch.compile`` traces), and this layer over them.
"""

from __future__ import annotations

import torch
from torch import nn

from torq.kernels.config import Backend
from torq.kernels.dispatch import mxfp4_linear
from torq.kernels.launch import check_block_transform, fusable_in_prepass
from torq.kernels.ops import mxfp4_linear_op
from torq.kernels.weight import MXFP4Weight


class PackedMXFP4Linear(nn.Module):
    """A linear layer stored as packed MXFP4 (4.25 bits per weight) with W4A4 arithmetic.

    ``input_transform`` is the online transform ``T`` whose inverse was fused into the
    weight (``W' = W Tᵀ``): a ``32×32`` block matrix (``block_transform``) runs inside the
    kernel; a general module (for example TORQ's per-position inter-block rotation) runs
    before it in torch. ``nearest``: the activation's block scales by the nearest rule
    (:class:`torq.formats.FormatSpec`; torq's default recipe), else the OCP rule.
    """

    def __init__(
        self,
        weight: MXFP4Weight,
        bias: torch.Tensor | None = None,
        block_transform: torch.Tensor | None = None,
        input_transform: nn.Module | None = None,
        backend: Backend = "auto",
        nearest: bool = False,
    ) -> None:
        super().__init__()
        check_block_transform(block_transform)
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.backend: Backend = backend
        # the activation's block scales by the nearest rule (torq's default recipe), not OCP's
        self.nearest = nearest
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("bias", bias)
        self.register_buffer("block_transform", block_transform)
        self.input_transform = input_transform
        # the FP8 prefill path's row shifts, derived from the scales (not saved; recomputed
        # when a state dict is loaded)
        self._set_fp8_rows(weight)

    def _set_fp8_rows(self, weight: MXFP4Weight) -> None:
        rows, scale, exact = weight.fp8_rows()
        self.register_buffer("fp8_row_exponents", rows, persistent=False)
        self.register_buffer("fp8_row_scale", scale, persistent=False)
        self.fp8_exact = exact

    def _load_from_state_dict(
        self, state_dict: dict[str, torch.Tensor], prefix: str, *args: object, **kwargs: object
    ) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[arg-type]
        # only when this layer's codes or scales were loaded (a model-wide load that leaves
        # this layer alone, e.g. one whose layers are offloaded to disk, keeps its rows)
        if f"{prefix}codes" in state_dict or f"{prefix}scales" in state_dict:
            self._set_fp8_rows(MXFP4Weight(self.codes, self.scales, self.in_features))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        block_transform: torch.Tensor | None = None,
        input_transform: nn.Module | None = None,
        backend: Backend = "auto",
    ) -> PackedMXFP4Linear:
        """Pack ``linear``'s (already transform-fused) weight; the bias stays in float."""
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(
            MXFP4Weight.from_float(linear.weight),
            bias,
            block_transform,
            input_transform,
            backend,
        )

    @property
    def weight_packed(self) -> MXFP4Weight:
        return MXFP4Weight(
            self.codes,
            self.scales,
            self.in_features,
            self.fp8_row_exponents,
            self.fp8_exact,
            self.fp8_row_scale,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.as_operator(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return mxfp4_linear(
            x,
            self.weight_packed,
            bias,
            self.block_transform,
            backend=self.backend,
            rotation=self.input_transform,
            nearest=self.nearest,
        )

    def as_operator(self, x: torch.Tensor) -> torch.Tensor:
        """This layer as ``torch.ops.torq.mxfp4_linear`` (:mod:`torq.kernels.ops`), the form
        ``torch.compile`` traces: one node of the graph, the same arithmetic. An online
        transform the kernels cannot run goes before it as its module."""
        t = self.input_transform
        tensors: list[torch.Tensor | None] = [None, None, None]
        if fusable_in_prepass(t):
            tensors = [t.channel_scale, t.r_inter, t.r_intra]  # type: ignore[union-attr]
        elif t is not None:
            x = t(x)
        return mxfp4_linear_op(
            x,
            self.codes,
            self.scales,
            self.in_features,
            None if self.bias is None else self.bias.to(x.dtype),
            self.block_transform,
            *tensors,
            self.fp8_row_exponents,
            self.fp8_row_scale,
            self.fp8_exact,
            self.nearest,
            self.backend,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, block_transform={self.block_transform is not None}"
            + (", activation scales: nearest rule" if self.nearest else "")
        )
