"""Cost of TORQ's online transform against the linear layer's own matmul, on CPU.

For each input group of a model's decoder layer (q/k/v, o_proj, gate/up, down_proj) and a
batch of tokens, times, in one run on the same tensors:

* ``matmul``: ``F.linear`` of the group's layers (the float work the layer does anyway);
* ``quantize``: MXFP4 fake quantization of the input (what RTN adds);
* ``transform``: the structured TORQ transform ``T x`` (a batched ``B×B`` per position,
  then a ``K×K``), with random orthogonal factors of the real shapes;
* ``dense``: a dense ``d×d`` rotation, for comparison.

Reported as ratios to ``matmul`` (medians of repeated runs), because the machines are
shared and noisy. Shapes default to SmolLM2-135M's; ``--hidden/--ffn/--heads`` change them.

Usage: ``python -m benchmarks.transform_overhead [--tokens 2048] [--out results/...json]``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import save, time_runs
from torq.experimental import BlockRotation, fake_quantize, get_format, machine_info, versions


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(time_runs(fn, repeats))


def _orthogonal(*shape: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(*shape, shape[-1], generator=gen))
    return q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--kv-dim", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/bench_transform_overhead.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    fmt = get_format("mxfp4")
    k = 32
    h, f, kv = args.hidden, args.ffn, args.kv_dim
    groups = {
        "q/k/v": (h, [h, kv, kv]),
        "o_proj": (h, [h]),
        "gate/up": (h, [f, f]),
        "down_proj": (f, [h]),
    }
    rows = []
    for name, (d, outs) in groups.items():
        x = torch.randn(args.tokens, d, generator=gen)
        weights = [torch.randn(o, d, generator=gen) / d**0.5 for o in outs]
        t = BlockRotation(k, _orthogonal(k, d // k, gen=gen), _orthogonal(k, gen=gen))
        dense = _orthogonal(d, gen=gen)
        matmul = _median_seconds(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], args.repeats)
        quant = _median_seconds(lambda x=x: fake_quantize(x, fmt), args.repeats)
        trans = _median_seconds(lambda x=x, t=t: t(x), args.repeats)
        dense_t = _median_seconds(lambda x=x, m=dense: x @ m, args.repeats)
        rows.append(
            {
                "group": name,
                "width": d,
                "outputs": outs,
                "matmul_ms": 1e3 * matmul,
                "quantize_vs_matmul": quant / matmul,
                "transform_vs_matmul": trans / matmul,
                "dense_rotation_vs_matmul": dense_t / matmul,
            }
        )
    table = [
        "| group | d | matmul ms | quantize / matmul | TORQ transform / matmul "
        "| dense d×d / matmul |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        table.append(
            f"| {r['group']} | {r['width']} | {r['matmul_ms']:.2f} | {r['quantize_vs_matmul']:.3f} "
            f"| {r['transform_vs_matmul']:.3f} | {r['dense_rotation_vs_matmul']:.3f} |"
        )
    record = {
        "benchmark": "TORQ online transform overhead vs the layer matmul (CPU)",
        "args": vars(args),
        "rows": rows,
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "machine": machine_info(),
    }
    save(args.out, record, "\n".join(table))


if __name__ == "__main__":
    main()
