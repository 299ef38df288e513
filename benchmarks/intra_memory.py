"""Peak memory and time of the intra-block solver (Algorithm 2, exact angle search) on a
sample the size of an 8B model's widest group: 2048 reservoir tokens × 448 blocks of 32
(Llama-3-8B's down_proj input, 14336 wide) = 917 504 blocks.

    python -m benchmarks.intra_memory --out results/intra_memory.json
    python -m benchmarks.intra_memory --recipe torq --out results/intra_memory-torq.json

``--recipe paper`` (the default, what the record of 2026-11-25 measured) runs Algorithm 2 as
the paper sets it: from the identity, the K/2 columns of largest occupancy;
``--recipe torq`` as ``torq run`` does: from the 32-point Hadamard, all 32 columns
(:data:`torq.methods.torq_rotation.TORQ_INTRA_DEFAULTS`).

The sample is synthetic (Gaussian rows with log-normal row scales and one outlier column,
a fixed seed); what is measured is the resident set above the start (a sampler thread,
``torq.models.streaming.ResidentPeak``), the seconds on one thread, and a hash of the
rotation found, so that two versions of the solver can be checked to give the same result
bit for bit. Writes JSON and a markdown line (``<out>.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from dataclasses import asdict
from pathlib import Path

import torch

from torq.experimental import (
    TORQ_INTRA_DEFAULTS,
    IntraBlockConfig,
    ResidentPeak,
    fit_intra_block_rotation,
    write_record,
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2048 * 448)
    ap.add_argument("--max-iter", type=int, default=3)
    ap.add_argument(
        "--recipe",
        choices=("paper", "torq"),
        default="paper",
        help="Algorithm 2's start and columns: the paper's, or torq run's (module doc)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.blocks, 32, generator=gen)
    x *= torch.exp(torch.randn(args.blocks, 1, generator=gen))
    x[:, 3] *= 8
    rss = ResidentPeak(interval=0.002)
    rss.restart()
    start = rss.peak()
    t0 = time.perf_counter()
    recipe = TORQ_INTRA_DEFAULTS if args.recipe == "torq" else {}
    config = IntraBlockConfig(**{**recipe, "max_iter": args.max_iter})
    result = fit_intra_block_rotation(x, config)
    seconds = time.perf_counter() - t0
    peak = rss.peak()
    rss.close()
    record = {
        "blocks": args.blocks,
        "max_iter": args.max_iter,
        "recipe": args.recipe,
        "intra_config": asdict(config),
        "peak_above_start_bytes": None if peak is None else peak - start,
        "seconds": seconds,
        "loss_history": result.loss_history,
        "rotation_sha256": hashlib.sha256(result.rotation.numpy().tobytes()).hexdigest(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, record)
    gib = "n/a" if peak is None else f"{(peak - start) / 2**30:.2f}"
    line = (
        f"| {args.blocks} blocks × 32, {args.max_iter} iterations, {args.recipe}'s start "
        f"| {gib} GiB | "
        f"{seconds:.0f} s | `{record['rotation_sha256'][:16]}` |"
    )
    out.with_suffix(".md").write_text(
        "| sample | peak above start | time (1 thread) | rotation sha256 |\n"
        "| --- | ---: | ---: | --- |\n" + line + "\n"
    )
    print(line)


if __name__ == "__main__":
    main()
