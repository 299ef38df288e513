"""Packed MXFP4 mixture-of-experts: every expert's two linear layers in W4A4 on the kernels.

:class:`PackedMXFP4Experts` is :class:`~torq.surgery.qlinear.QuantExperts` with its weights
packed (two E2M1 codes per byte, one E8M0 scale per 32 inputs: 4.25 bits a weight) and each
expert's ``gate_up_proj`` and ``down_proj`` run by :func:`torq.kernels.dispatch.mxfp4_linear`
(Algorithm 3, option B, per expert): Triton kernels on a GPU, the fake-quant reference on a
CPU. The expert input's online transform runs once on all tokens (every expert reads the
same hidden state), each expert's ``down_proj`` transform on that expert's rows; a plain
``32×32`` block transform (the 32-block Hadamard) runs inside the kernels. Routing stays in
float, as in the model. For decode (up to :data:`GROUPED_MAX_SLOTS` token-expert pairs, one
``down_proj`` transform for all experts) every pair is a slot of one grouped integer GEMV
per projection (:func:`grouped_gemv_i8`) instead: a few launches a step, none waiting for
the host (docs/research/paper-tables.md §12.3).
"""

from __future__ import annotations

import torch
from torch import nn

import torq.kernels.triton_mxfp4 as tk
from torq.kernels.config import SCALE_RULES, Backend
from torq.kernels.dispatch import mxfp4_linear, use_triton
from torq.kernels.launch import (
    check_block_transform,
    fusable_in_prepass,
    interpreter_enabled,
    quantize_activation_i8,
    quantize_activation_torq_i8,
)
from torq.kernels.weight import MXFP4Weight
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import QuantExperts

# Up to this many (token, chosen expert) pairs a forward is one grouped integer GEMV per
# projection (:func:`grouped_gemv_i8`: decode); above it, each expert's rows run as a
# matrix (``mxfp4_linear``, one launch per expert and projection).
GROUPED_MAX_SLOTS = 512


def grouped_gemv_i8(
    q8: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    experts: torch.Tensor,
    codes: torch.Tensor,
    weight_scales: torch.Tensor,
    in_features: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out[s] = Q(x[rows[s]]) · Q(W_{experts[s]})ᵀ`` for every slot ``s`` in one launch
    (Algorithm 3, option B, per expert): ``q8``/``scales`` the integer pre-pass of ``x``
    (:func:`~torq.kernels.launch.quantize_activation_i8`), ``codes [E, N, Kp/2]`` and
    ``weight_scales [E, N, Kp/32]`` the experts' packed weights. Returns ``[S, N]``."""

    _, n, half = codes.shape
    kp = half * 2
    words = codes.view(torch.int32)  # [E, N, Kp/8]
    block_k = min(4096, 1 << (kp - 1).bit_length())
    block_n = 4
    slots = rows.numel()
    out = torch.empty((slots, n), dtype=out_dtype, device=q8.device)
    if slots == 0:
        return out
    tk._mx_gemv_grouped_i8_kernel[(tk.cdiv(n, block_n), slots)](
        q8.view(torch.int32),
        scales,
        rows,
        experts,
        words,
        weight_scales,
        out,
        n,
        in_features,
        q8.stride(0) // 4,
        scales.stride(0),
        words.stride(0),
        words.stride(1),
        weight_scales.stride(0),
        weight_scales.stride(1),
        out.stride(0),
        EVEN_K=kp % block_k == 0,
        USE_ASM=not interpreter_enabled(),
        STREAM=True,
        BN=block_n,
        BK=block_k,
        num_warps=4,
    )
    return out


def _pack(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` float weights as stacked packed MXFP4 ``(codes [E, N, Kp/2], scales [E,
    N, Kp/32])``, expert by expert (each is one linear weight)."""
    packed = [MXFP4Weight.from_float(w) for w in weights.detach().float()]
    return torch.stack([p.codes for p in packed]), torch.stack([p.scales for p in packed])


def _block_part(transform: nn.Module | None) -> tuple[torch.Tensor | None, nn.Module | None]:
    """Split an online transform into what the kernels take: a ``BlockRotation`` that is
    only a shared ``32×32`` intra-block matrix (no channel scale, permutation or inter-block
    rotation) becomes the kernels' block transform; anything else stays a torch module."""
    if isinstance(transform, BlockRotation) and transform.kernel_form(32) == "block_matrix":
        # BlockRotation computes Z = Y R_intra on each block row, i.e. z_b = R_intraᵀ y_b
        return transform.r_intra.T.contiguous(), None
    return None, transform


class PackedMXFP4Experts(nn.Module):
    """Fused MoE experts stored as packed MXFP4 and computed W4A4 (module doc).

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` as the
    model's experts module: ``Σ_j w_j · down_e(Q_a(T_e(act(gate_e) · up_e)))`` over each
    token's chosen experts ``e``, with ``gate_e, up_e = gate_up_e(Q_a(T x))``.
    """

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        act_fn: nn.Module,
        input_transform: nn.Module | None = None,
        down_transforms: list[nn.Module | None] | None = None,
        backend: Backend = "auto",
        nearest: bool = False,
    ) -> None:
        super().__init__()
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise ValueError("fused expert weights are 3-D [experts, out, in]")
        e, two_i, h = gate_up_proj.shape
        if down_proj.shape != (e, h, two_i // 2) or two_i % 2:
            raise ValueError(
                f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj "
                f"{tuple(down_proj.shape)} are not [E, 2I, H] and [E, H, I]"
            )
        down = list(down_transforms) if down_transforms is not None else [None]
        if all(t is down[0] for t in down):
            down = down[:1]  # one module for every expert: shared (the grouped path takes it)
        if len(down) not in (1, e):
            raise ValueError(
                f"down_transforms: one shared or one per expert ({e}), got {len(down)}"
            )
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, two_i // 2
        self.act_fn = act_fn
        self.backend: Backend = backend
        # the activations' block scales by the nearest rule (torq's default recipe)
        self.nearest = nearest
        gu_codes, gu_scales = _pack(gate_up_proj)
        dn_codes, dn_scales = _pack(down_proj)
        self.register_buffer("gate_up_codes", gu_codes)
        self.register_buffer("gate_up_scales", gu_scales)
        self.register_buffer("down_codes", dn_codes)
        self.register_buffer("down_scales", dn_scales)
        block, self.input_transform = _block_part(input_transform)
        check_block_transform(block)
        self.register_buffer("block_transform", block)
        parts = [_block_part(t) for t in down]
        self.down_transforms = nn.ModuleList(
            t if t is not None else nn.Identity() for _, t in parts
        )
        for i, (b, _) in enumerate(parts):
            check_block_transform(b)
            if b is not None:  # (a buffer, so that it moves with the module)
                self.register_buffer(f"down_block_transform{i}", b)
        self._weights: tuple[object, list[tuple[MXFP4Weight, MXFP4Weight]]] | None = None

    @classmethod
    def from_quant_experts(
        cls, experts: nn.Module, backend: Backend = "auto"
    ) -> PackedMXFP4Experts:
        """Pack a :class:`~torq.surgery.qlinear.QuantExperts` in MXFP4 W4A4 (its weights are
        already on the MXFP4 grid, so packing them again is exact)."""

        if not isinstance(experts, QuantExperts):
            raise TypeError(f"expected QuantExperts, got {type(experts).__name__}")
        for side, spec in (
            ("weight", experts.config.weight),
            ("activation", experts.config.activation),
        ):
            ok = spec is not None and (spec.name, spec.block_size) == ("mxfp4", 32)
            if ok and side == "activation":  # (a weight's codes hold whatever rule chose them)
                ok = spec.scale_mode in SCALE_RULES
            if not ok:
                raise ValueError(
                    f"the kernels run MXFP4 weights and activations (the OCP or nearest rule); "
                    f"these experts' {side} format is {spec.to_dict() if spec else 'float'}"
                )
        return cls(
            experts.gate_up_proj,
            experts.down_proj,
            experts.act_fn,
            experts.input_transform,
            [q.transform for q in experts.down_quantizers],
            backend,
            nearest=experts.config.activation.scale_mode == "nearest",
        )

    def _expert_weights(self) -> list[tuple[MXFP4Weight, MXFP4Weight]]:
        # built once per storage (a .to() makes new buffers), so each weight's FP8 row
        # shifts are computed once, not on every call
        key = (self.gate_up_codes.data_ptr(), self.down_codes.data_ptr())
        if self._weights is None or self._weights[0] != key:
            weights = [
                (
                    MXFP4Weight(self.gate_up_codes[e], self.gate_up_scales[e], self.hidden_size),
                    MXFP4Weight(self.down_codes[e], self.down_scales[e], self.intermediate_size),
                )
                for e in range(self.num_experts)
            ]
            self._weights = (key, weights)
        return self._weights[1]

    def _down(self, expert: int) -> tuple[torch.Tensor | None, nn.Module | None]:
        i = 0 if len(self.down_transforms) == 1 else expert
        module = self.down_transforms[i]
        block = getattr(self, f"down_block_transform{i}", None)
        return block, None if isinstance(module, nn.Identity) else module

    @staticmethod
    def routes(top_k_index: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Each chosen expert with its tokens and their slots: ``(e, token_idx, k_pos)``
        (reading which experts were chosen waits for the device)."""
        out = []
        for e in torch.unique(top_k_index).tolist():
            token_idx, k_pos = torch.where(top_k_index == e)
            out.append((int(e), token_idx, k_pos))
        return out

    def run(
        self,
        hidden_states: torch.Tensor,
        routes: list[tuple[int, torch.Tensor, torch.Tensor]],
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The experts on given :meth:`routes`: no host synchronisation, so a fixed routing
        can be captured in a CUDA graph."""
        out = torch.zeros_like(hidden_states)
        x = hidden_states if self.input_transform is None else self.input_transform(hidden_states)
        weights = self._expert_weights()
        for e, token_idx, k_pos in routes:
            if e < 0 or e >= self.num_experts:
                continue  # (a padding slot)
            gate_up, down = weights[e]
            gate, up = mxfp4_linear(
                x[token_idx],
                gate_up,
                None,
                self.block_transform,
                backend=self.backend,
                nearest=self.nearest,
            ).chunk(2, dim=-1)
            block, rotation = self._down(e)
            y = mxfp4_linear(
                self.act_fn(gate) * up,
                down,
                None,
                block,
                backend=self.backend,
                rotation=rotation,
                nearest=self.nearest,
            )
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, k_pos, None]).to(out.dtype))
        return out

    def _prepass(
        self, x: torch.Tensor, block: torch.Tensor | None, rotation: nn.Module | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if block is None and fusable_in_prepass(rotation):
            # the transform in the pre-pass
            return quantize_activation_torq_i8(x, rotation, nearest=self.nearest)
        if rotation is not None:
            x = rotation(x)
        return quantize_activation_i8(x, block, nearest=self.nearest)

    def grouped(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The decode path: every (token, chosen expert) pair is a slot of one grouped
        integer GEMV per projection (:func:`grouped_gemv_i8`), so a step costs a fixed
        handful of launches, none waiting for the host, whatever experts are chosen.
        Needs Triton and one ``down_proj`` transform shared by the experts."""
        if len(self.down_transforms) != 1:
            raise ValueError("the grouped path needs one down_proj transform for all experts")
        t, k = top_k_index.shape
        valid = (top_k_index >= 0) & (top_k_index < self.num_experts)
        experts = torch.where(valid, top_k_index, 0).reshape(-1).to(torch.int32)
        weights = torch.where(valid, top_k_weights, 0).to(torch.float32)
        rows = torch.arange(t, device=hidden_states.device, dtype=torch.int32)
        rows = rows.repeat_interleave(k)
        q8, xs = self._prepass(hidden_states, self.block_transform, self.input_transform)
        gate_up = grouped_gemv_i8(
            q8,
            xs,
            rows,
            experts,
            self.gate_up_codes,
            self.gate_up_scales,
            self.hidden_size,
            hidden_states.dtype,
        )
        gate, up = gate_up.chunk(2, dim=-1)
        block, rotation = self._down(0)
        h8, hs = self._prepass(self.act_fn(gate) * up, block, rotation)
        slots = torch.arange(t * k, device=hidden_states.device, dtype=torch.int32)
        y = grouped_gemv_i8(
            h8,
            hs,
            slots,
            experts,
            self.down_codes,
            self.down_scales,
            self.intermediate_size,
            torch.float32,
        )
        out = (y.view(t, k, -1) * weights[..., None]).sum(dim=1)
        return out.to(hidden_states.dtype)

    # torch.compile compiles around it (a graph break): which experts run, and on which
    # tokens, depends on the routing's values
    @torch.compiler.disable
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        slots = top_k_index.numel()
        if (
            slots <= GROUPED_MAX_SLOTS
            and len(self.down_transforms) == 1
            and use_triton(hidden_states, self.backend)
        ):
            return self.grouped(hidden_states, top_k_index, top_k_weights)
        return self.run(hidden_states, self.routes(top_k_index), top_k_weights)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights (codes and scales of every expert)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.gate_up_codes, self.gate_up_scales, self.down_codes, self.down_scales)
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, "
            f"block_transform={self.block_transform is not None}"
        )
