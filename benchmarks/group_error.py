"""Each input group's W4A4 output error on held-out calibration tokens under alternative
transforms, all after torq's channel balancing: the question of issue 27, asked group by
group instead of through the whole model's perplexity.

    python -m benchmarks.group_error --model smollm2-135m --layers 0 5 15 29 \\
        --out results/method-value/group-error.json

For every group of linear layers that read one tensor (q/k/v, o, gate/up, down) in the
chosen decoder layers, the group's inputs are sampled from ``--windows`` calibration windows
of WikiText-2 validation; the balancing scales and the calibrated rotations are fitted on the
first half of the sampled tokens and the error
``‖X Wᵀ − Q_a(T x) Q_w(W T⁻¹)ᵀ‖² / ‖X Wᵀ‖²`` (RTN weights, MXFP4, torq's
:func:`torq.methods.torq_rotation.output_error`) is measured on the second half, for:

- ``h32``: the balancing and the 32-block Hadamard (``torq-had32``);
- ``perm``: the same with a channel permutation before the blocks that evens out the blocks'
  shares of ``Σ_j rms(x_j)·‖w_j‖`` (after balancing the proxy of the balancing module
  docstring is ``Σ_b (Σ_{j∈b} rms(x_j)‖w_j‖)²``, smallest when every block carries the same
  share; MixQuant's block balancing for INT4, tried for MXFP4);
- ``torq``: TORQ's calibrated rotations (inter-block, then intra-block from ``H₃₂``) as the
  ``torq`` method fits them;
- ``torq-s4096``: the same with the intra-block solver on 4096 sampled blocks
  (``--intra-samples 4096``), the speed item's shortcut;
- ``torq-w``: TORQ's calibrated rotations with the group's weights in the intra-block fit
  (issue 27's "weights included"): the rotation also turns every 32-wide block of the
  balanced, inter-rotated weight rows (``W T⁻¹`` is rotated as ``T x`` is), so the
  occupancy loss is fitted on both operands of the product instead of the activations alone.

``--labels`` picks the transforms (``h32`` always).

Writes JSON and a markdown table (``<out>.md``), with the solve seconds of each TORQ fit.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import save
from torq.experimental import (
    BlockRotation,
    CalibrationConfig,
    InterBlockConfig,
    IntraBlockConfig,
    balance_scales,
    block_mass_permutation,
    calibration_windows,
    command_line,
    decoder_layers,
    fit_intra_block_rotation,
    get_format,
    hadamard_matrix,
    inter_block_rotations,
    load,
    machine_info,
    now_iso,
    output_error,
    read_record,
    versions,
)

K = 32


def _permuted_error(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, perm: torch.Tensor, fmt: Any
) -> float:
    """``output_error`` for ``T x = H_blk((x ⊘ s)[perm])`` (``W T⁻¹ = H_blk((W·s)[:, perm])``):
    gathering the channels of both first gives the same products."""
    t = BlockRotation(K, None, hadamard_matrix(K, dtype=torch.float64), channel_scale=s[perm])
    return output_error(x[:, perm].float(), w[:, perm].float(), t, fmt, fmt)


def _covariance(x: torch.Tensor) -> torch.Tensor:
    """``Σ_k`` ``[K, B, B]`` of tokens ``x [n, B·K]``."""
    xb = x.reshape(x.shape[0], -1, K).permute(2, 0, 1)
    return xb.transpose(1, 2) @ xb / x.shape[0]


def sample_group_inputs(
    model: nn.Module, windows: torch.Tensor, layers: list[int], tokens: int, seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"<layer>.<linear>": (inputs [n, d], stacked weights [out, d])}``: each group's input
    (the linears reading one tensor, found by the tensor's identity as
    :func:`torq.calibration.capture.discover_groups` does), ``tokens`` random rows a window."""
    gen = torch.Generator().manual_seed(seed)
    found: dict[str, list[torch.Tensor]] = {}
    members: dict[str, list[nn.Linear]] = {}
    # tensor identity → (tensor, group) for one window's forward; the tensor is kept so that
    # its identity is not reused by a later tensor of the same forward
    seen: dict[int, tuple[torch.Tensor, str]] = {}

    def hook(mod: nn.Module, args: tuple, name: str) -> None:
        x = args[0]
        key = seen[id(x)][1] if id(x) in seen else None
        if key is None:
            seen[id(x)] = (x, name)
            key = name
            flat = x.detach().reshape(-1, x.shape[-1])
            rows = torch.randperm(flat.shape[0], generator=gen)[:tokens]
            found.setdefault(key, []).append(flat[rows].to(torch.float64))
        if mod not in members.setdefault(key, []):
            members[key].append(mod)

    handles = []
    for i in layers:
        for name, mod in decoder_layers(model)[i].named_modules():
            if isinstance(mod, nn.Linear):
                label = f"{i}.{name.rsplit('.', 1)[-1]}"
                handles.append(mod.register_forward_pre_hook(lambda m, a, n=label: hook(m, a, n)))
    try:
        with torch.no_grad():
            for w in windows:
                seen.clear()  # a freed tensor's identity may be reused in the next window
                model(w[None])
    finally:
        for h in handles:
            h.remove()
    return {
        k: (torch.cat(v), torch.cat([m.weight.detach().to(torch.float64) for m in members[k]]))
        for k, v in found.items()
    }


LABELS = ("h32", "perm", "torq", "torq-s4096", "torq-w")


def _change(rows: list[dict[str, Any]], key: str) -> str:
    return f"{sum(r[key] for r in rows) / sum(r['h32'] for r in rows) - 1:+.1%}"


def markdown(rows: list[dict[str, Any]], labels: tuple[str, ...] = LABELS) -> str:
    """Per group: ``h32``'s error and the others' change from it; then per kind of group
    (the first linear's name): the change of the summed error, the median change, and in how
    many groups each lowers the error."""
    labels = tuple(k for k in labels if all(k in r for r in rows))
    solved = tuple(k for k in labels if all(f"{k}_solve_s" in r for r in rows))
    lines = [
        "| group | width | "
        + " | ".join(labels)
        + "".join(f" | {k} solve s" for k in solved)
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in labels + solved) + " |",
    ]
    for r in rows:
        rel = [f"{r[k]:.3%}" if k == "h32" else f"{r[k] / r['h32'] - 1:+.1%}" for k in labels]
        lines.append(
            f"| {r['group']} | {r['width']} | "
            + " | ".join(rel)
            + "".join(f" | {r[f'{k}_solve_s']:.1f}" for k in solved)
            + " |"
        )
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        kinds.setdefault(r["group"].split(".", 1)[1], []).append(r)
    kinds["all"] = rows
    others = tuple(k for k in labels if k != "h32")
    lines += [
        "",
        "| groups | n | "
        + " | ".join(f"{k}: sum / median / lower in" for k in others)
        + " | solve s, "
        + " / ".join(solved)
        + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in others) + " | ---: |",
    ]
    for kind, rs in kinds.items():
        cells = []
        for k in others:
            rel = sorted(r[k] / r["h32"] - 1 for r in rs)
            median = statistics.median(rel)
            better = sum(x < 0 for x in rel)
            cells.append(f"{_change(rs, k)} / {median:+.1%} / {better} of {len(rs)}")
        solve = " / ".join(f"{sum(r[f'{k}_solve_s'] for r in rs):.0f}" for k in solved)
        lines.append(f"| {kind} | {len(rs)} | " + " | ".join(cells) + f" | {solve} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 5, 15, 29])
    p.add_argument("--windows", type=int, default=2, help="calibration windows")
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1024, help="token rows sampled per window")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="results/method-value/group-error.json")
    p.add_argument(
        "--labels",
        default=",".join(LABELS[:4]),
        help=f"transforms to measure besides h32, of {','.join(LABELS)}",
    )
    p.add_argument("--render", default=None, metavar="JSON", help="print a record's tables again")
    args = p.parse_args(argv)
    labels = ("h32", *(k for k in args.labels.split(",") if k and k != "h32"))
    unknown = set(labels) - set(LABELS)
    if unknown:
        p.error(f"unknown --labels {sorted(unknown)}; known: {', '.join(LABELS)}")
    if args.render:
        print(markdown(read_record(Path(args.render))["rows"]))
        return 0
    torch.set_num_threads(args.threads)
    fmt = get_format("mxfp4")
    lm = load(args.model)
    model = lm.model.eval()
    windows = calibration_windows(
        lm.tokenizer, CalibrationConfig(n_samples=args.windows, seqlen=args.seqlen), args.data_dir
    )
    groups = sample_group_inputs(model, windows, args.layers, args.tokens, seed=0)
    rows = []
    for name, (x, w) in groups.items():
        n = x.shape[0]
        fit, held = x[: n // 2], x[n // 2 :]
        s = balance_scales(fit.pow(2).mean(0), w)
        row: dict[str, Any] = {"group": name, "width": x.shape[1], "held_tokens": held.shape[0]}
        h32 = BlockRotation(K, None, hadamard_matrix(K, dtype=torch.float64), channel_scale=s)
        row["h32"] = output_error(held.float(), w.float(), h32, fmt, fmt)
        xs, ws = fit / s, w * s
        mass = xs.pow(2).mean(0).sqrt() * ws.pow(2).sum(0).sqrt()
        if "perm" in labels:
            perm = block_mass_permutation(mass)
            row["perm"] = _permuted_error(held, w, s, perm, fmt)
            row["proxy_h32"] = float(mass.reshape(-1, K).sum(1).pow(2).sum())
            row["proxy_perm"] = float(mass[perm].reshape(-1, K).sum(1).pow(2).sum())
        r_inter, _ = inter_block_rotations(_covariance(xs), InterBlockConfig())
        inter = BlockRotation(K, r_inter, None, dtype=torch.float64)
        blocks = inter(xs).reshape(-1, K)
        fits = {
            "torq": (blocks, None),
            "torq-s4096": (blocks, 4096),
            # the fused weight W T⁻¹ = W Tᵀ: its rows' blocks turn as the activations' do
            "torq-w": (torch.cat([blocks, inter(ws).reshape(-1, K)]), None),
        }
        for label in labels:
            if label not in fits:
                continue
            sample, cap = fits[label]
            start = time.perf_counter()
            cfg = IntraBlockConfig(init="hadamard", k_top=32, max_samples=cap)
            fitted = fit_intra_block_rotation(sample, cfg)
            row[f"{label}_solve_s"] = time.perf_counter() - start
            t = BlockRotation(K, r_inter, fitted.rotation, channel_scale=s)
            row[label] = output_error(held.float(), w.float(), t, fmt, fmt)
        rows.append(row)
        print(
            f"{name}: " + ", ".join(f"{k} {row[k]:.4%}" for k in labels),
            flush=True,
        )
    total = {k: sum(r[k] for r in rows) for k in labels}
    record = {
        "kind": "group-error",
        "date": now_iso(),
        "command": command_line(),
        "config": vars(args),
        "machine": machine_info(),
        "versions": versions(),
        "rows": rows,
        "total": total,
    }
    save(args.out, record, markdown(rows, labels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
