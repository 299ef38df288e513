"""Folding torq's channel balancing into the module that produces each group's input.

The balancing (:mod:`torq.rotations.balance`) divides a group's input by per-channel scales
``s`` before its block rotation: ``T x = R (x ⊘ s)``, with ``diag(s)`` fused into the
group's weights. Run online, that division is a step no serving engine has. But every
input group of a Llama-style decoder layer is produced by a module that is linear in the
channel being divided, so ``⊘ s`` can be done there, offline, leaving ``R`` alone online
(for a 32-block Hadamard: the transform compressed-tensors, transformers and vLLM run):

* q/k/v read ``input_layernorm``'s output and gate/up read ``post_attention_layernorm``'s
  (Gemma 3: ``pre_feedforward_layernorm``'s): ``γ ⊙ n(x) ⊘ s = (γ ⊘ s) ⊙ n(x)``, the norm's
  weight divided (Gemma's norms multiply by ``1 + w``: ``w ← (1 + w) ⊘ s − 1``);
* ``down_proj`` reads ``act(gate) ⊙ up``: ``up_proj``'s rows (and bias) divided;
* ``o_proj`` reads the attention output, linear in the values: ``v_proj``'s rows divided.
  With grouped-query attention one value channel feeds the same channel of several query
  heads, so ``o_proj``'s scales must be equal across them (:func:`o_proj_ties`; the
  balancing then works on the sets' mean statistics, :func:`balance.tied_energies`).
* Phi-3 and Phi-4 fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``: the
  divisions go into ``qkv_proj``'s value rows and ``gate_up_proj``'s second (``up``) half.

* Fused MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE) read ``post_attention_layernorm``'s
  output as a dense MLP's gate/up do: their input's division goes into that norm, and the
  router beside them, which reads the same output in float, takes ``diag(s)`` into its
  columns, so that every token is routed as before. Each expert's ``down_proj`` reads
  ``act(gate) ⊙ up``: its division goes into that expert's ``up`` rows of ``gate_up_proj``.
  A linear group reading the same output (Qwen2-MoE's shared expert and its gate) takes the
  experts' balancing, fitted on its weights and theirs, and so folds with it.

Up to float rounding the folded model computes what the unfolded one does, but for the
rows of ``v_proj`` and ``up_proj``: they are quantized after the division, and a row
scaled by a factor that is not a power of two rounds to other codes (and, under GQA,
``o_proj``'s scales are tied). Those are the two differences a folded run measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torq.calibration.capture import ExpertsGroup, LinearGroup
from torq.errors import TorqError
from torq.rotations.transform import BlockRotation


@dataclass(frozen=True)
class Producer:
    """Where a group's ``⊘ s`` goes: a norm's ``weight`` or a linear's rows (``kind``). A
    Gemma norm multiplies by ``1 + weight`` (``plus_one``), so its weight becomes
    ``(1 + w) ⊘ s − 1``."""

    kind: str  # "norm" or "rows"
    module: str  # its path inside the decoder layer
    plus_one: bool = False
    # of a fused linear's rows, the group's part: "v" (a q/k/v product's value rows), "up"
    # (a gate/up product's second half, which ``act(gate) · up`` multiplies); None: all
    part: str | None = None


_ROWS = {
    "self_attn.o_proj": Producer("rows", "self_attn.v_proj"),
    "mlp.down_proj": Producer("rows", "mlp.up_proj"),
}
_LLAMA = {
    "self_attn.q_proj": Producer("norm", "input_layernorm"),
    "mlp.gate_proj": Producer("norm", "post_attention_layernorm"),
    **_ROWS,
}
# Gemma 3: the MLP reads pre_feedforward_layernorm's output (post_attention_layernorm and
# post_feedforward_layernorm scale the blocks' outputs, not a quantized input)
_GEMMA3 = {
    "self_attn.q_proj": Producer("norm", "input_layernorm", plus_one=True),
    "mlp.gate_proj": Producer("norm", "pre_feedforward_layernorm", plus_one=True),
    **_ROWS,
}
# Phi-3 (and Phi-4) fuse q/k/v into one qkv_proj and gate/up into one gate_up_proj: the
# divisions of o_proj and down_proj go into their value rows and their up half
_PHI3 = {
    "self_attn.qkv_proj": Producer("norm", "input_layernorm"),
    "mlp.gate_up_proj": Producer("norm", "post_attention_layernorm"),
    "self_attn.o_proj": Producer("rows", "self_attn.qkv_proj", part="v"),
    "mlp.down_proj": Producer("rows", "mlp.gate_up_proj", part="up"),
}
# Cohere (Command R, Command A) runs attention and the MLP side by side on one norm's
# output: q/k/v and gate/up are one group, whose division goes into that norm (a LayerNorm
# without bias: the weight multiplies after the centring, as an RMSNorm's does)
_PARALLEL = {"self_attn.q_proj": Producer("norm", "input_layernorm"), **_ROWS}
# MoE layers: the fused experts and a shared expert read post_attention_layernorm's output
_MOE = {
    **_LLAMA,
    "mlp.experts": Producer("norm", "post_attention_layernorm"),
    "mlp.shared_expert.gate_proj": Producer("norm", "post_attention_layernorm"),
    "mlp.shared_expert.down_proj": Producer("rows", "mlp.shared_expert.up_proj"),
}
# by model type, then by the group's first member, in the layer's own names
PRODUCERS: dict[str, dict[str, Producer]] = {
    "mixtral": _MOE,
    "qwen2_moe": _MOE,
    "qwen3_moe": _MOE,
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma3_text": _GEMMA3,
    "gemma2": _GEMMA3,
    "granite": _LLAMA,
    "phi3": _PHI3,
    "cohere": _PARALLEL,
    "cohere2": _PARALLEL,
}
FOLDABLE_MODEL_TYPES = tuple(PRODUCERS)


def check_foldable(model_config: Any) -> None:
    """Refuse, in one line, a model whose layers the fold does not know."""
    model_type = getattr(model_config, "model_type", None)
    if model_type not in PRODUCERS:
        experts = any(
            (getattr(model_config, k, None) or 0) > 0
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
        )
        way_out = (
            "--recipe fast, or torq run --methods had32+gptq, quantizes it without it (in "
            "torq's format: fused MoE experts have no compressed-tensors form)"
            if experts
            else "--recipe fast, or torq run --methods had32+gptq --save-format "
            "compressed-tensors --save-dir DIR, writes a servable checkpoint without it"
        )
        raise TorqError(
            "the channel balancing folds into the layers of "
            f"{', '.join(FOLDABLE_MODEL_TYPES)} models, not '{model_type}' (--fold-balance, "
            f"the default recipe's): {way_out}"
        )


def producer_of(group: LinearGroup, model_config: Any) -> Producer:
    """The module that produces ``group``'s input (module doc)."""
    check_foldable(model_config)
    found = PRODUCERS[model_config.model_type].get(group.members[0])
    if found is None:
        raise TorqError(f"no module to fold the balancing of {group.name} into")
    return found


def is_o_proj(group: LinearGroup) -> bool:
    """Whether a group is attention's output projection, whose balancing folds into
    ``v_proj``'s rows and so must be equal across the query heads of one value head."""
    return group.members[0] == "self_attn.o_proj"


def o_proj_ties(model_config: Any) -> torch.Tensor:
    """For each input channel of ``o_proj`` (query head ``h``, dimension ``d``), the value
    channel it comes from: ``(h // (H / H_kv)) · head_dim + d``."""
    n_heads, n_kv, head_dim = _heads(model_config)
    if n_heads % n_kv:
        raise TorqError(f"{n_heads} attention heads do not share {n_kv} value heads evenly")
    kv = torch.arange(n_heads) // (n_heads // n_kv)
    return (kv[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


def _heads(model_config: Any) -> tuple[int, int, int]:
    """Attention's query heads, key-value heads and head dimension."""
    n_heads = int(model_config.num_attention_heads)
    n_kv = int(getattr(model_config, "num_key_value_heads", None) or n_heads)
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // n_heads
    return n_heads, n_kv, int(head_dim)


@torch.no_grad()
def fold_scales(
    layer: nn.Module, group: LinearGroup, scales: torch.Tensor, model_config: Any
) -> dict[str, Any]:
    """Divide the output of ``group``'s producer by ``scales`` (``[d]``, the group's input
    channels; for ``o_proj``, equal across the query heads of one value head). Must run
    before the producer is quantized. Returns a record of what was divided."""
    where = producer_of(group, model_config)
    target = layer.get_submodule(where.module)
    s = scales.detach().to("cpu", torch.float64)
    if where.kind == "rows" and is_o_proj(group):
        ties = o_proj_ties(model_config)
        per_value = torch.zeros(int(ties.max()) + 1, dtype=torch.float64)
        per_value[ties] = s  # equal within each set: any one of them
        if not torch.allclose(per_value[ties], s, rtol=1e-12, atol=0.0):
            raise TorqError("o_proj's scales differ within a value head: they cannot be folded")
        s = per_value
    weight = target.weight
    s = s.to(weight.device)  # the scales are computed on the CPU; the layer may be on a GPU
    if where.kind == "norm":
        _divide_norm(target, where, s)
    else:
        rows = _part_rows(where, weight.shape[0], model_config)
        if rows.stop - rows.start != s.numel():
            raise TorqError(
                f"{where.module} has {rows.stop - rows.start} rows to divide, not {s.numel()}"
            )
        part = weight[rows]
        part.copy_((part.to(torch.float64) / s[:, None]).to(weight.dtype))
        bias = getattr(target, "bias", None)
        if bias is not None:
            bias[rows].copy_((bias[rows].to(torch.float64) / s).to(bias.dtype))
    record = {"into": where.module, "kind": where.kind}
    if where.part is not None:
        record["part"] = where.part
    return record


def _part_rows(where: Producer, n_rows: int, model_config: Any) -> slice:
    """The rows of ``where``'s linear that make the group's input (:attr:`Producer.part`)."""
    if where.part is None:
        return slice(0, n_rows)
    if where.part == "up":
        return slice(n_rows // 2, n_rows)
    n_heads, n_kv, head_dim = _heads(model_config)
    start = (n_heads + n_kv) * head_dim  # after the query and key rows
    return slice(start, start + n_kv * head_dim)


def _divide_norm(norm: nn.Module, where: Producer, s: torch.Tensor) -> None:
    """A norm's output divided by ``s``: its weight (a Gemma norm's ``1 + w``) divided."""
    weight = norm.weight
    s = s.to(weight.device, torch.float64)
    if weight.shape != s.shape:
        raise TorqError(f"{where.module} has {weight.numel()} weights, not {s.numel()}")
    offset = 1.0 if where.plus_one else 0.0
    weight.copy_(((weight.to(torch.float64) + offset) / s - offset).to(weight.dtype))


@dataclass
class ExpertTransforms:
    """A fused-experts module's online transforms: on the input every expert reads, and on
    each expert's ``down_proj`` input (one shared by all, or one per expert)."""

    input: nn.Module | None
    down: list[nn.Module | None]


def _scale_of(t: nn.Module | None) -> torch.Tensor | None:
    return t.channel_scale if isinstance(t, BlockRotation) else None


@torch.no_grad()
def fold_expert_scales(
    layer: nn.Module, group: ExpertsGroup, transforms: ExpertTransforms, model_config: Any
) -> tuple[ExpertTransforms, dict[str, Any]]:
    """The experts' balancing done offline (module doc): the input's ``⊘ s`` by the norm
    before them, the router's columns times ``s``; each ``down_proj``'s ``⊘ s_e`` by its
    expert's ``up`` rows. Must run before the experts are quantized. Returns the transforms
    left online (their rotations) and a record of what was divided."""
    where = producer_of(group, model_config)
    path = group.members[0]
    parent = path.rpartition(".")[0]
    record: dict[str, Any] = {}
    online_in = transforms.input
    s = _scale_of(online_in)
    if s is not None:
        s64 = s.detach().to("cpu", torch.float64)
        _divide_norm(layer.get_submodule(where.module), where, s64)
        router = layer.get_submodule(f"{parent}.gate")
        w = router.weight
        if w.shape[-1] != s64.numel():
            raise TorqError(f"{parent}.gate reads {w.shape[-1]} channels, not {s64.numel()}")
        w.copy_((w.to(torch.float64) * s64.to(w.device)).to(w.dtype))
        online_in = online_in.without_channel_scale()  # type: ignore[union-attr]
        record["input"] = {"into": where.module, "kind": "norm", "router": f"{parent}.gate"}
    experts = layer.get_submodule(path)
    gate_up = experts.gate_up_proj
    n_experts, rows = gate_up.shape[0], gate_up.shape[1] // 2
    online: dict[int, nn.Module | None] = {}
    for e in range(n_experts):
        t = transforms.down[0 if len(transforms.down) == 1 else e]
        s_e = _scale_of(t)
        if s_e is None:
            continue
        up = gate_up[e, rows:]  # gate_up_proj holds gate's rows, then up's
        up.copy_((up.to(torch.float64) / s_e.to(up.device, torch.float64)[:, None]).to(up.dtype))
        online[id(t)] = t.without_channel_scale()  # type: ignore[union-attr]
    if online:
        record["down"] = {"into": f"{path}.gate_up_proj", "kind": "up rows"}
    down = [online.get(id(t), t) for t in transforms.down]
    return ExpertTransforms(online_in, down), record
