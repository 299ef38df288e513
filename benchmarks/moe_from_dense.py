"""A real-weights mixture-of-experts model made from a dense one: each MLP's intermediate
neurons split into experts, written as a Mixtral (from Llama-family models: SmolLM2) or a
Qwen2-MoE checkpoint (from Qwen2: its q/k/v biases; Qwen2.5-Coder), to measure MoE
quantization on trained weights where no MoE checkpoint can be fetched.

An MLP ``down(act(gate x) * up x)`` is a sum over its intermediate neurons, so splitting them
into ``E`` slices gives ``E`` experts whose outputs add up to the MLP's. Two variants:

* **exact** (``--top-k`` not given): every token goes to every expert. The router's weights
  are zero, so its softmax gives each expert ``1/E``, and each expert's ``down`` is scaled by
  ``E``; with ``E`` a power of two both are exact in floating point, and the model computes
  the dense model's function (up to the order of the sums). Qwen2-MoE always has a shared
  expert, gated by ``sigmoid(w·x)``: it takes a slice of the neurons too, its gate weights
  are zero (``sigmoid(0) = 1/2``) and its ``down`` is doubled.
* **sparse** (``--top-k k``): each token goes to ``k`` of the ``E`` experts, chosen by a
  router fitted on calibration tokens. The neurons are first grouped by co-activation
  (MoEfication's idea, Zhang et al. 2022): each neuron's share of each token's MLP output,
  ``|h_j| ‖d_j‖``, over a sample of calibration tokens, and a balanced spherical k-means of
  those profiles into ``E`` groups of equal size, so that the neurons that carry a token
  together sit in one expert; Qwen2-MoE's shared expert takes the neurons of largest mean
  share. The router is then, per layer, a ridge regression from the MLP's input to the log
  of each expert's output norm, so that the top ``k`` logits name the experts with the
  largest predicted outputs. The logits are scaled down (``--router-temperature``) so that
  the renormalized top-k weights stay near ``1/k``, and each expert's ``down`` is scaled by
  ``k``: the layer then adds up the ``k`` chosen groups of the dense MLP and drops the
  rest. Its perplexity is higher than the dense model's, since a gated MLP is not sparse
  (the record says by how much): SmolLM2-135M, first 2 windows, dense 19.02, the top 6 of 8
  experts 36.33; the top 2 of 8 is unusable (5.2·10⁴ on 4 windows; 5.7·10⁵ with contiguous
  slices in place of the grouping).

    python -m benchmarks.moe_from_dense --model smollm2-135m --experts 8 \\
        --out results/moe/smollm2-e8
    python -m benchmarks.moe_from_dense --model smollm2-135m --experts 8 --top-k 6 \\
        --calib-samples 16 --max-windows 2 --out results/moe/smollm2-e8-k6

Writes the checkpoint (config, safetensors, tokenizer) to ``--out`` and a record
``--out``.json (and its table, ``.md``): the dense and the MoE model's perplexity on the
first ``--max-windows`` WikiText-2 test windows. The checkpoints are made on demand, never
committed.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import save
from torq.experimental import (
    CalibrationConfig,
    calibration_windows,
    command_line,
    load_model,
    load_wikitext2_test,
    machine_info,
    now_iso,
    perplexity,
    windows_from_text,
)

# the dense architectures this splits, and the MoE architecture each becomes
MOE_OF = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe"}
# the blocks of the 4-bit formats: an expert's intermediate width must be a multiple
BLOCK = 32


def expert_widths(intermediate: int, experts: int, shared: bool) -> tuple[int, int]:
    """The routed experts' width and the shared expert's (0 without one): equal routed
    slices, multiples of 32; with a shared expert, it takes what is left (at least a slice's
    worth)."""
    if not shared:
        if intermediate % (experts * BLOCK):
            raise SystemExit(
                f"--experts {experts}: the MLP's {intermediate} neurons do not split into "
                f"{experts} experts of a multiple of {BLOCK}"
            )
        return intermediate // experts, 0
    width = intermediate // (experts + 1) // BLOCK * BLOCK
    if width == 0:
        raise SystemExit(f"--experts {experts}: too many for {intermediate} neurons")
    return width, intermediate - experts * width


def moe_config(dense: Any, experts: int, top_k: int) -> Any:
    """The MoE model's config: the dense config's attention, norms and embeddings, its MLP
    as ``experts`` routed experts (``top_k`` a token) and, for Qwen2-MoE, a shared one."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    kind = MOE_OF.get(dense.model_type)
    if kind is None:
        raise SystemExit(
            f"model type {dense.model_type!r}: this splits {', '.join(MOE_OF)} models only"
        )
    width, shared = expert_widths(dense.intermediate_size, experts, kind == "qwen2_moe")
    common = {
        k: v
        for k, v in dense.to_dict().items()
        if k not in ("model_type", "architectures", "intermediate_size", "_name_or_path")
        and not k.startswith("transformers")
    }
    if kind == "mixtral":
        return MixtralConfig(
            **common,
            intermediate_size=width,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            router_jitter_noise=0.0,
            architectures=["MixtralForCausalLM"],
        )
    return Qwen2MoeConfig(
        **common,
        intermediate_size=shared,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=shared,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        architectures=["Qwen2MoeForCausalLM"],
    )


def _slices(mlp: nn.Module, groups: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """``(gate, up, down)`` weights of each group of intermediate neurons (index tensors)."""
    return [
        (mlp.gate_proj.weight[rows], mlp.up_proj.weight[rows], mlp.down_proj.weight[:, rows])
        for rows in groups
    ]


def contiguous_groups(intermediate: int, experts: int, width: int) -> list[torch.Tensor]:
    """The exact variant's split: expert ``e`` takes neurons ``[e·width, (e+1)·width)``, the
    shared expert (if any) the rest."""
    groups = [torch.arange(e * width, (e + 1) * width) for e in range(experts)]
    if experts * width < intermediate:
        groups.append(torch.arange(experts * width, intermediate))
    return groups


def neuron_mass(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[tokens, intermediate]``: each neuron's share of each token's MLP output,
    ``|h_j| ‖d_j‖ / Σ_i |h_i| ‖d_i‖`` (``h`` the neurons' activations, ``d_j`` the down
    projection's column ``j``), so that every token weighs the same."""
    h = mlp.act_fn(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
    mass = h.abs() * mlp.down_proj.weight.norm(dim=0)
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)


def balanced_assignment(scores: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each row (neuron) to a column (expert), every column taking ``capacity`` rows: the
    (row, column) pairs taken greedily by decreasing score."""
    rows, cols = scores.shape
    order = torch.argsort(scores.flatten(), descending=True).tolist()
    owner = [-1] * rows
    room = [capacity] * cols
    left = rows
    for pair in order:
        r, c = divmod(pair, cols)
        if owner[r] < 0 and room[c] > 0:
            owner[r], room[c] = c, room[c] - 1
            left -= 1
            if left == 0:
                break
    return torch.tensor(owner)


def coactivation_groups(
    mass: torch.Tensor, experts: int, width: int, iterations: int = 25, seed: int = 0
) -> list[torch.Tensor]:
    """The sparse variant's split, MoEfication's idea (Zhang et al., 2022) for gated MLPs:
    neurons that carry a token's output together go to the same expert, so that a token's
    top-k experts hold most of its MLP. ``mass`` is :func:`neuron_mass` on calibration
    tokens. With a shared expert (more neurons than ``experts · width``), it takes the
    neurons of largest mean mass (those every token uses); the rest are split by a balanced
    spherical k-means of their mass profiles over the tokens (equal sizes ``width``)."""
    intermediate = mass.shape[1]
    neurons = torch.arange(intermediate)
    shared = None
    if experts * width < intermediate:
        by_mean = torch.argsort(mass.mean(0), descending=True)
        cut = intermediate - experts * width
        shared, neurons = by_mean[:cut], by_mean[cut:]
    profiles = mass[:, neurons].T.double()
    profiles = profiles / profiles.norm(dim=1, keepdim=True).clamp_min(1e-30)
    gen = torch.Generator().manual_seed(seed)
    centroids = profiles[torch.randperm(len(neurons), generator=gen)[:experts]]
    owner = torch.zeros(len(neurons), dtype=torch.long)
    for _ in range(iterations):
        new = balanced_assignment(profiles @ centroids.T, width)
        if torch.equal(new, owner):
            break
        owner = new
        centroids = torch.stack([profiles[owner == e].mean(0) for e in range(experts)])
        centroids = centroids / centroids.norm(dim=1, keepdim=True).clamp_min(1e-30)
    groups = [torch.sort(neurons[owner == e]).values for e in range(experts)]
    return groups if shared is None else [*groups, torch.sort(shared).values]


@torch.no_grad()
def fill_layer(
    moe_mlp: nn.Module,
    mlp: nn.Module,
    experts: int,
    top_k: int,
    router: torch.Tensor | None,
    groups: list[torch.Tensor],
) -> None:
    """The MoE block ``moe_mlp`` from the dense ``mlp``: routed expert ``e`` from the
    neurons ``groups[e]``, the shared expert (Qwen2-MoE) from ``groups[experts]``;
    ``router``: the fitted router's weights (sparse), else zero (every expert, ``1/E``
    each)."""
    scale = float(experts if router is None else top_k)
    for e, (g, u, d) in enumerate(_slices(mlp, groups[:experts])):
        moe_mlp.experts.gate_up_proj[e] = torch.cat([g, u])
        moe_mlp.experts.down_proj[e] = d * scale
    moe_mlp.gate.weight.copy_(torch.zeros_like(moe_mlp.gate.weight) if router is None else router)
    if hasattr(moe_mlp, "shared_expert"):
        shared = moe_mlp.shared_expert
        ((g, u, d),) = _slices(mlp, groups[experts:])
        shared.gate_proj.weight.copy_(g)
        shared.up_proj.weight.copy_(u)
        shared.down_proj.weight.copy_(d * 2.0)  # its gate: sigmoid(0) = 1/2
        moe_mlp.shared_expert_gate.weight.zero_()


@torch.no_grad()
def _each_mlp_input(
    dense: nn.Module, windows: torch.Tensor, take: Callable[[int, nn.Module, torch.Tensor], None]
) -> None:
    """``take(layer index, mlp, x)`` for each MLP's input ``x`` (``[tokens, hidden]``) as the
    dense model runs over the token windows, one at a time."""

    def hook(i: int) -> Any:
        def capture(mlp: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            take(i, mlp, args[0].reshape(-1, args[0].shape[-1]).float())

        return capture

    layers = dense.model.layers
    handles = [layer.mlp.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for w in windows:
            dense(input_ids=w.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()


def group_neurons(
    dense: nn.Module, windows: torch.Tensor, experts: int, width: int, tokens: int = 4096
) -> list[list[torch.Tensor]]:
    """Per layer, :func:`coactivation_groups` on the neuron masses of ``tokens`` calibration
    tokens (a seeded sample, the same positions in every layer)."""
    per_window = max(1, tokens // len(windows))
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(windows.shape[1], generator=gen)[:per_window] for _ in windows]
    masses: dict[int, list[torch.Tensor]] = {}
    seen = [0] * len(dense.model.layers)

    def take(i: int, mlp: nn.Module, x: torch.Tensor) -> None:
        masses.setdefault(i, []).append(neuron_mass(mlp, x[picks[seen[i]]]))
        seen[i] += 1

    _each_mlp_input(dense, windows, take)
    return [coactivation_groups(torch.cat(masses[i]), experts, width) for i in sorted(masses)]


@torch.no_grad()
def fit_routers(
    dense: nn.Module,
    windows: torch.Tensor,
    groups: list[list[torch.Tensor]],
    experts: int,
    temperature: float,
) -> list[torch.Tensor]:
    """Per layer, ``[E, hidden]`` router weights: ridge regression (λ = 1e-3 of the mean
    diagonal) from the MLP's input ``x`` to ``log ‖expert_e(x)‖`` over the calibration
    tokens (expert ``e`` the neurons ``groups[layer][e]``), times ``temperature``."""
    sums: dict[int, list[torch.Tensor]] = {}

    def take(i: int, mlp: nn.Module, x: torch.Tensor) -> None:
        norms = []
        for g, u, d in _slices(mlp, groups[i][:experts]):
            h = mlp.act_fn(x @ g.T) * (x @ u.T)
            norms.append((h @ d.T).norm(dim=-1).double())
        target = torch.stack(norms, -1).clamp_min(1e-12).log()
        target = target - target.mean(-1, keepdim=True)
        xd = x.double()
        xtx, xty = xd.T @ xd, xd.T @ target
        if i not in sums:
            sums[i] = [xtx, xty]
        else:
            sums[i][0] += xtx
            sums[i][1] += xty

    _each_mlp_input(dense, windows, take)
    routers = []
    for i in sorted(sums):
        xtx, xty = sums[i]
        damp = 1e-3 * xtx.diagonal().mean()
        eye = torch.eye(xtx.shape[0], dtype=xtx.dtype)
        w = torch.linalg.solve(xtx + damp * eye, xty).T  # [E, hidden]
        routers.append((w * temperature).float())
    return routers


def build(
    dense: nn.Module,
    experts: int,
    top_k: int | None,
    calib: torch.Tensor | None = None,
    temperature: float = 0.05,
) -> nn.Module:
    """The MoE model made from ``dense`` (module doc); ``top_k`` ``None``: the exact variant
    (contiguous slices), else the sparse one, its neurons grouped by co-activation and its
    routers fitted on the token windows ``calib``."""
    from transformers import AutoModelForCausalLM

    k = experts if top_k is None else top_k
    config = moe_config(dense.config, experts, k)
    moe = AutoModelForCausalLM.from_config(config, dtype=dense.dtype)
    width = moe.model.layers[0].mlp.experts.down_proj.shape[-1]
    intermediate = dense.config.intermediate_size
    routers = None
    if top_k is None:
        groups = [contiguous_groups(intermediate, experts, width)] * len(dense.model.layers)
    else:
        if calib is None:
            raise ValueError("the sparse variant fits its routers on calibration windows")
        groups = group_neurons(dense, calib, experts, width)
        routers = fit_routers(dense, calib, groups, experts, temperature)
    missing = set(moe.state_dict())
    with torch.no_grad():
        for name, tensor in dense.state_dict().items():
            if name in missing and ".mlp." not in name:
                moe.state_dict()[name].copy_(tensor)
                missing.discard(name)
        pairs = zip(dense.model.layers, moe.model.layers, strict=True)
        for i, (layer, moe_layer) in enumerate(pairs):
            router = None if routers is None else routers[i]
            fill_layer(moe_layer.mlp, layer.mlp, experts, k, router, groups[i])
    moe.eval()
    return moe


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a dense model torq loads (name or folder)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per layer")
    ap.add_argument("--top-k", type=int, help="experts a token (sparse); default: all (exact)")
    ap.add_argument("--calib-samples", type=int, default=16, help="windows the routers fit on")
    ap.add_argument("--router-temperature", type=float, default=0.05)
    ap.add_argument("--max-windows", type=int, default=4, help="test windows for the PPLs")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True, help="the checkpoint folder (its record: .json)")
    args = ap.parse_args(argv)
    if args.experts < 2 or (args.top_k is not None and not 1 <= args.top_k < args.experts):
        raise SystemExit("--experts at least 2, --top-k between 1 and --experts − 1")
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"--out {out} exists: name a new folder")
    loaded = load_model(args.model)
    dense, tokenizer = loaded.model.eval(), loaded.tokenizer
    calib = None
    if args.top_k is not None:
        config = CalibrationConfig(n_samples=args.calib_samples, seqlen=2048)
        calib = calibration_windows(tokenizer, config, args.data_dir)
    t0 = time.perf_counter()
    moe = build(dense, args.experts, args.top_k, calib, args.router_temperature)
    seconds = time.perf_counter() - t0
    test = windows_from_text(load_wikitext2_test(args.data_dir), tokenizer, 2048, args.max_windows)
    ppl = {
        "dense": perplexity(dense, test, progress=False).ppl,
        "moe": perplexity(moe, test, progress=False).ppl,
    }
    moe.save_pretrained(out)
    tokenizer.save_pretrained(out)
    variant = "exact" if args.top_k is None else f"sparse, top {args.top_k}"
    record = {
        "model": args.model,
        "checkpoint": str(out),
        "architecture": moe.config.model_type,
        "experts": args.experts,
        "top_k": moe.config.num_experts_per_tok,
        "variant": variant,
        "build_seconds": seconds,
        "windows": int(test.shape[0]),
        "ppl": ppl,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
    }
    change = 100 * (ppl["moe"] / ppl["dense"] - 1)
    lines = [
        f"{args.model} as {moe.config.model_type}, {args.experts} experts ({variant}); "
        f"PPL on the first {test.shape[0]} WikiText-2 test windows of 2048 tokens",
        "",
        "| model | PPL |",
        "| --- | ---: |",
        f"| dense | {ppl['dense']:.4f} |",
        f"| MoE | {ppl['moe']:.4f} ({change:+.3f} %) |",
    ]
    save(out.with_suffix(".json"), record, "\n".join(lines))
    if not math.isfinite(ppl["moe"]):
        raise SystemExit("the MoE model's perplexity is not finite")


if __name__ == "__main__":
    main()
