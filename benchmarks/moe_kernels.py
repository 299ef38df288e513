"""One MoE layer of a Qwen3-30B-A3B shape in MXFP4 W4A4 (``torq.kernels``) against bf16: the
speed part of the paper's Tables 7–8, on random weights.

Run on a CUDA machine:
``python -m benchmarks.moe_kernels --out results/gpu/moe-kernels.json``.

The layer is Qwen3-30B-A3B's sparse block (hidden 2048, 128 experts of intermediate 768,
8 chosen per token, SiLU), weights random (no MoE checkpoint exists on torq's machines; the
speed of a layer does not depend on the values of its weights, its accuracy does, and none
is claimed here). Rows: bf16 (the model's own loop over the chosen experts, ``F.linear``),
MXFP4 with no transform, with the 32-block Hadamard on both expert inputs (inside the
kernels), and with a calibrated TORQ transform on the expert input (channel scale,
inter- and intra-block rotation, a torch module before the kernels) and the Hadamard on the
``down_proj`` inputs. For each number of tokens, routings are drawn at random (uniform top-8,
one per step), each step's loop over its experts is captured in a CUDA graph (the same for
bf16 and MXFP4, so Python's launch overhead is out of both) and the median replay is the
time per step; ``--eager`` adds the steps run as the model runs them, routing included.
Before timing, each MXFP4 row is checked against torq's fake-quant reference on the GPU
(float32 inputs).
Every speed figure is a ratio against bf16 measured in the same run. Writes JSON and a
markdown table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import save
from benchmarks.kernel_speed import device_info, graph_time
from torq.experimental import GROUPED_MAX_SLOTS, BlockRotation, PackedMXFP4Experts, hadamard_matrix

# Qwen3-30B-A3B (config.json): hidden 2048, moe_intermediate 768, 128 experts, 8 per token,
# 48 layers, all sparse.
QWEN3_30B_A3B = {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8, "layers": 48}
VARIANTS = ("mxfp4", "mxfp4+h32", "mxfp4+torq")


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q


def torq_transform(width: int, gen: torch.Generator) -> BlockRotation:
    """A transform of TORQ's full form (values random: its cost does not depend on them)."""
    b = width // 32
    return BlockRotation(
        32,
        r_inter=torch.stack([_orthogonal(b, gen) for _ in range(32)]),
        r_intra=_orthogonal(32, gen),
        channel_scale=torch.rand(width, generator=gen) + 0.5,
    )


def h32() -> BlockRotation:
    return BlockRotation(32, r_intra=hadamard_matrix(32, dtype=torch.float64))


class Bf16Experts:
    """The model's experts loop in bf16 (transformers' ``Qwen3MoeExperts``), on fixed routes."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down

    def run(self, x: torch.Tensor, routes: list, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, token_idx, k_pos in routes:
            gate, up = F.linear(x[token_idx], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def routing(tokens: int, shape: dict[str, int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    e, k = shape["experts"], shape["top_k"]
    index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen).softmax(-1)
    return index.cuda(), weights.cuda()


def eager_time(fn: Any, steps: list[tuple], repeats: int) -> float:
    """Median seconds of ``fn(x, index, weights)`` run as the model runs it (routing read
    on the host, each kernel launched from Python)."""
    for args in steps[:2]:
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        for args in steps:
            t0 = time.perf_counter()
            fn(*args)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    shape: dict[str, int], tokens_list: list[int], steps: int, eager: bool, grouped_max: int
) -> dict:
    gen = torch.Generator().manual_seed(0)
    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * 0.02
    down = torch.randn(e, h, i, generator=gen) * 0.02
    bf16 = Bf16Experts(gate_up.bfloat16().cuda(), down.bfloat16().cuda())
    gate_up, down = gate_up.cuda(), down.cuda()  # (packed on the GPU: faster)
    transforms = {
        "mxfp4": (None, None),
        "mxfp4+h32": (h32(), h32()),
        "mxfp4+torq": (torq_transform(h, gen), h32()),
    }
    variants = {
        k: PackedMXFP4Experts(gate_up, down, torch.nn.SiLU(), t_in, [t_down]).cuda()
        for k, (t_in, t_down) in transforms.items()
    }
    rec: dict[str, Any] = {
        "shape": shape,
        "bytes_bf16": (gate_up.numel() + down.numel()) * 2,
        "bytes_mxfp4": variants["mxfp4"].nbytes,
        "rows": [],
    }
    del gate_up, down
    for tokens in tokens_list:
        drawn = [routing(tokens, shape, gen) for _ in range(steps)]
        xs = [torch.randn(tokens, h, generator=gen).bfloat16().cuda() for _ in range(steps)]
        routes = [PackedMXFP4Experts.routes(index) for index, _ in drawn]
        row: dict[str, Any] = {"tokens": tokens}
        row["experts_per_step"] = statistics.mean(len(r) for r in routes)
        calls = [
            (lambda x=x, r=r, w=w: bf16.run(x, r, w))
            for x, r, (_, w) in zip(xs, routes, drawn, strict=True)
        ]
        row["bf16_us"] = graph_time(calls, replays=30) * 1e6
        if eager:
            row["bf16_eager_us"] = (
                eager_time(
                    lambda x, idx, w: bf16.run(x, PackedMXFP4Experts.routes(idx), w),
                    [(x, idx, w) for x, (idx, w) in zip(xs, drawn, strict=True)],
                    3,
                )
                * 1e6
            )
        for name, module in variants.items():
            x, (idx, w) = xs[0], drawn[0]
            # float32 inputs for the check: a bf16 input rounds the down_proj input before
            # its quantization, which moves a few codes by a step in either path
            module.backend = "reference"  # the fake-quant definition
            ref = module(x.float(), idx, w)
            module.backend = "auto"
            y = module.run(x.float(), PackedMXFP4Experts.routes(idx), w)
            res: dict[str, Any] = {"rel_err": float((y - ref).norm() / ref.norm())}
            calls = [
                (lambda x=x, r=r, w=w, m=module: m.run(x, r, w))
                for x, r, (_, w) in zip(xs, routes, drawn, strict=True)
            ]
            t = graph_time(calls, replays=30)
            res.update(us=t * 1e6, speedup=row["bf16_us"] / (t * 1e6))
            if tokens * shape["top_k"] <= grouped_max:
                y = module.grouped(x.float(), idx, w)
                res["grouped_rel_err"] = float((y - ref).norm() / ref.norm())
                calls = [
                    (lambda x=x, i=i, w=w, m=module: m.grouped(x, i, w))
                    for x, (i, w) in zip(xs, drawn, strict=True)
                ]
                t = graph_time(calls, replays=30)
                res.update(grouped_us=t * 1e6, grouped_speedup=row["bf16_us"] / (t * 1e6))
            if eager:
                te = eager_time(
                    module, [(x, idx, w) for x, (idx, w) in zip(xs, drawn, strict=True)], 3
                )
                res.update(eager_us=te * 1e6, eager_speedup=row["bf16_eager_us"] / (te * 1e6))
            row[name] = res
        print(row, flush=True)
        rec["rows"].append(row)
    return rec


def markdown(rec: dict[str, Any]) -> str:
    dev = rec["device"]
    s = rec["moe"]["shape"]
    lines = [
        f"One MoE layer, Qwen3-30B-A3B shape (hidden {s['hidden']}, {s['experts']} experts of "
        f"{s['intermediate']}, top-{s['top_k']}), random weights; {dev['name']}, torch "
        f"{dev['torch']}, triton {dev['triton']}; {rec['date']}.",
        "",
        f"Weights of one layer: bf16 {rec['moe']['bytes_bf16'] / 2**20:.0f} MiB, MXFP4 "
        f"{rec['moe']['bytes_mxfp4'] / 2**20:.0f} MiB; all {s['layers']} layers: "
        f"{s['layers'] * rec['moe']['bytes_bf16'] / 2**30:.1f} GiB and "
        f"{s['layers'] * rec['moe']['bytes_mxfp4'] / 2**30:.1f} GiB.",
        "",
        "Captured in CUDA graphs; each MXFP4 cell: one launch per expert and projection "
        "(`run`) / the grouped integer GEMV, every (token, expert) pair in one launch "
        "(`grouped`), µs and speed-up over bf16:",
        "",
        "| tokens | experts run | bf16 µs | MXFP4 | + H32 | + TORQ | max rel. err vs reference "
        "(fp32 input) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cell(r: dict[str, Any]) -> str:
        text = f"{r['us']:.1f} ({r['speedup']:.2f}×)"
        if "grouped_us" in r:
            text += f" / {r['grouped_us']:.1f} ({r['grouped_speedup']:.2f}×)"
        return text

    for r in rec["moe"]["rows"]:
        err = max(max(r[k]["rel_err"], r[k].get("grouped_rel_err", 0.0)) for k in VARIANTS)
        lines.append(
            f"| {r['tokens']} | {r['experts_per_step']:.1f} | {r['bf16_us']:.1f} | "
            + " | ".join(cell(r[k]) for k in VARIANTS)
            + f" | {err:.1e} |"
        )
    if rec["moe"]["rows"] and "bf16_eager_us" in rec["moe"]["rows"][0]:
        lines += [
            "",
            "Eager (as the model runs it: routing read on the host, each launch from Python; "
            f"MXFP4 takes the grouped GEMV up to {GROUPED_MAX_SLOTS} pairs):",
            "",
            "| tokens | bf16 µs | MXFP4 µs (×) | + H32 µs (×) | + TORQ µs (×) |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rec["moe"]["rows"]:
            cells = [
                f"{r[k]['eager_us']:.0f} ({r[k]['eager_speedup']:.2f}×)"
                for k in ("mxfp4", "mxfp4+h32", "mxfp4+torq")
            ]
            lines.append(
                f"| {r['tokens']} | {r['bf16_eager_us']:.0f} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/gpu/moe-kernels.json")
    p.add_argument("--tokens", default="1,4,16,256,2048", help="tokens per step")
    p.add_argument("--steps", type=int, default=8, help="routings drawn per token count")
    p.add_argument("--eager", action="store_true", help="also time the model's eager loop")
    p.add_argument(
        "--grouped-max",
        type=int,
        default=512,
        help="time the grouped decode GEMV up to this many (token, expert) pairs",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe_kernels.py needs a CUDA GPU")
    t0 = time.time()
    rec: dict[str, Any] = {
        "kind": "torq.bench.moe_kernels",
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "device": device_info(),
    }
    tokens = [int(t) for t in args.tokens.split(",") if t]
    rec["moe"] = measure(QWEN3_30B_A3B, tokens, args.steps, args.eager, args.grouped_max)
    rec["wall_seconds"] = time.time() - t0
    save(args.out, rec, markdown(rec))


if __name__ == "__main__":
    main()
