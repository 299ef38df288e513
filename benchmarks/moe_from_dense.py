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
  router fitted on calibration tokens: per layer, a ridge regression from the MLP's input
  to the log of each expert's output norm (the experts that matter most for a token are
  those that add the most to it), so that the top ``k`` logits name the experts with the
  largest predicted outputs. The logits are scaled down (``--router-temperature``) so that
  the renormalized top-k weights stay near ``1/k``, and each expert's ``down`` is scaled by
  ``k``: the layer then adds up the ``k`` chosen slices of the dense MLP and drops the
  rest. Its perplexity is higher than the dense model's; the record says by how much. As
  built it is not yet a usable model: SmolLM2-135M with the top 2 of 8 experts gives a
  perplexity of 5.7·10⁵ (dense 24.5, first 4 windows). The slices are contiguous neurons,
  not the sets that fire together, so each token loses most of its MLP; grouping the
  neurons by co-activation before the split is what it lacks.

    python -m benchmarks.moe_from_dense --model smollm2-135m --experts 8 \\
        --out results/moe/smollm2-e8
    python -m benchmarks.moe_from_dense --model smollm2-135m --experts 8 --top-k 2 \\
        --calib-samples 16 --out results/moe/smollm2-e8-k2

Writes the checkpoint (config, safetensors, tokenizer) to ``--out`` and a record
``--out``.json (and its table, ``.md``): the dense and the MoE model's perplexity on the
first ``--max-windows`` WikiText-2 test windows. The checkpoints are made on demand, never
committed.
"""

from __future__ import annotations

import argparse
import math
import time
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


def _slices(mlp: nn.Module, starts: list[int], width: int) -> list[tuple[torch.Tensor, ...]]:
    """``(gate, up, down)`` weights of the neurons ``[s, s + width)`` for each start."""
    out = []
    for s in starts:
        rows = slice(s, s + width)
        out.append(
            (mlp.gate_proj.weight[rows], mlp.up_proj.weight[rows], mlp.down_proj.weight[:, rows])
        )
    return out


@torch.no_grad()
def fill_layer(
    moe_mlp: nn.Module,
    mlp: nn.Module,
    experts: int,
    top_k: int,
    router: torch.Tensor | None,
) -> None:
    """The MoE block ``moe_mlp`` from the dense ``mlp``: routed experts from its first
    neurons, the shared expert (Qwen2-MoE) from the rest; ``router``: the fitted router's
    weights (sparse), else zero (every expert, ``1/E`` each)."""
    width = moe_mlp.experts.down_proj.shape[-1]
    scale = float(experts if router is None else top_k)
    for e, (g, u, d) in enumerate(_slices(mlp, [e * width for e in range(experts)], width)):
        moe_mlp.experts.gate_up_proj[e] = torch.cat([g, u])
        moe_mlp.experts.down_proj[e] = d * scale
    moe_mlp.gate.weight.copy_(torch.zeros_like(moe_mlp.gate.weight) if router is None else router)
    if hasattr(moe_mlp, "shared_expert"):
        shared = moe_mlp.shared_expert
        ((g, u, d),) = _slices(mlp, [experts * width], shared.down_proj.weight.shape[-1])
        shared.gate_proj.weight.copy_(g)
        shared.up_proj.weight.copy_(u)
        shared.down_proj.weight.copy_(d * 2.0)  # its gate: sigmoid(0) = 1/2
        moe_mlp.shared_expert_gate.weight.zero_()


@torch.no_grad()
def fit_routers(
    dense: nn.Module, windows: torch.Tensor, experts: int, width: int, temperature: float
) -> list[torch.Tensor]:
    """Per layer, ``[E, hidden]`` router weights: ridge regression (λ = 1e-3 of the mean
    diagonal) from the MLP's input ``x`` to ``log ‖expert_e(x)‖`` over the calibration
    tokens, times ``temperature``."""
    sums: list[list[torch.Tensor]] = []

    def hook(i: int) -> Any:
        def capture(mlp: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            norms = []
            for g, u, d in _slices(mlp, [e * width for e in range(experts)], width):
                h = mlp.act_fn(x.float() @ g.T) * (x.float() @ u.T)
                norms.append((h @ d.T).norm(dim=-1).double())
            target = torch.stack(norms, -1).clamp_min(1e-12).log()
            target = target - target.mean(-1, keepdim=True)
            xtx, xty = x.T @ x, x.T @ target
            if len(sums) <= i:
                sums.append([xtx, xty])
            else:
                sums[i][0] += xtx
                sums[i][1] += xty

        return capture

    layers = dense.model.layers
    handles = [layer.mlp.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for w in windows:
            dense(input_ids=w.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    routers = []
    for xtx, xty in sums:
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
    """The MoE model made from ``dense`` (module doc); ``top_k`` ``None``: the exact variant,
    else the sparse one, its routers fitted on the token windows ``calib``."""
    from transformers import AutoModelForCausalLM

    k = experts if top_k is None else top_k
    config = moe_config(dense.config, experts, k)
    moe = AutoModelForCausalLM.from_config(config, dtype=dense.dtype)
    width = moe.model.layers[0].mlp.experts.down_proj.shape[-1]
    routers = None
    if top_k is not None:
        if calib is None:
            raise ValueError("the sparse variant fits its routers on calibration windows")
        routers = fit_routers(dense, calib, experts, width, temperature)
    missing = set(moe.state_dict())
    with torch.no_grad():
        for name, tensor in dense.state_dict().items():
            if name in missing and ".mlp." not in name:
                moe.state_dict()[name].copy_(tensor)
                missing.discard(name)
        pairs = zip(dense.model.layers, moe.model.layers, strict=True)
        for i, (layer, moe_layer) in enumerate(pairs):
            router = None if routers is None else routers[i]
            fill_layer(moe_layer.mlp, layer.mlp, experts, k, router)
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
