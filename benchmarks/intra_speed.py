"""Seconds of the intra-block solver (Algorithm 2 with the exact angle search of Appendix
A.4) on samples the size of real input groups, against the solver of an earlier commit
(``--before``, read from git) measured in the same run.

    python -m benchmarks.intra_speed --before 3886ca0 --threads 1 2 --out results/intra_speed.json

The samples are synthetic (Gaussian rows with log-normal column scales and one outlier
column, a fixed seed; then the 32-block Hadamard, as torq's solver starts from it), sized as
torq's reservoir of 1024 tokens makes them: SmolLM2-135M's 576- and 1536-wide inputs
(18 432 and 49 152 blocks of 32) and, with ``--large``, Llama-3-8B's 4096- and 14336-wide
ones (131 072 and 458 752). Each row gives the median of ``--repeats`` fits with each solver,
their ratio, and whether the two found the same rotation bit for bit (they must).

    python -m benchmarks.intra_speed --cuda --threads 16 --large --out results/gpu/intra-cuda.json

(``--cuda``, on a GPU machine) times this tree's solver on the CPU against the same solver
on the GPU (the largest difference of the two rotations is reported, since a GPU may sum in
another order). On the GPU the angle search prepares all pairs' sweeps as one padded table
(``exact_angle_search``'s ``batched`` path; on the CPU each pair is prepared alone, which is
faster there). Writes JSON and a markdown table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.common import save
from torq.experimental import intra_block as ib
from torq.experimental import machine_info

SHAPES = {"smollm2 576": 18432, "smollm2 1536": 49152}
LARGE = {"8b 4096": 131072, "8b 14336": 458752}


def _solver_at(commit: str) -> ModuleType:
    """``torq.rotations.intra_block`` as it was at ``commit``."""
    rel = "src/torq/rotations/intra_block.py"
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(
        ["git", "show", f"{commit}:{rel}"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "intra_block_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("intra_block_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _sample(blocks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks, 32, generator=gen, dtype=torch.float64)
    x *= torch.exp(torch.randn(1, 32, generator=gen, dtype=torch.float64))
    x[:, 3] *= 4
    return x


def _fit(
    solver: ModuleType, x: torch.Tensor, max_iter: int, device: str = "cpu"
) -> tuple[float, torch.Tensor, int]:
    cfg = solver.IntraBlockConfig(init="hadamard", k_top=32, max_iter=max_iter)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = solver.fit_intra_block_rotation(x.to(device), cfg)
    rotation = result.rotation.cpu()  # (waits for the device)
    return time.perf_counter() - t0, rotation, len(result.loss_history) - 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="the commit whose solver is the reference")
    ap.add_argument(
        "--cuda",
        action="store_true",
        help="instead of --before: this tree's solver on the CPU against the same on the GPU",
    )
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-iter", type=int, default=10)
    ap.add_argument("--large", action="store_true", help="also the 8B shape's two widths")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if (args.before is None) == (not args.cuda):
        ap.error("give one of --before COMMIT and --cuda")
    shapes = {**SHAPES, **(LARGE if args.large else {})}
    if args.cuda:  # "before": the CPU, "after": the GPU
        solvers = {"before": ib, "after": ib}
        devices = {"before": "cpu", "after": "cuda"}
        args.before = "CPU"
    else:
        solvers = {"before": _solver_at(args.before), "after": ib}
        devices = {"before": "cpu", "after": "cpu"}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, blocks in shapes.items():
            x = _sample(blocks)
            times: dict[str, list[float]] = {"before": [], "after": []}
            rotations: dict[str, torch.Tensor] = {}
            iterations = 0
            for _ in range(args.repeats):
                # alternated, so a change in the machine's load falls on both alike
                for label, solver in solvers.items():
                    seconds, rotation, iterations = _fit(solver, x, args.max_iter, devices[label])
                    times[label].append(seconds)
                    rotations[label] = rotation
            before = statistics.median(times["before"])
            after = statistics.median(times["after"])
            rows.append(
                {
                    "group": name,
                    "blocks": blocks,
                    "threads": threads,
                    "iterations": iterations,
                    "seconds_before": before,
                    "seconds_after": after,
                    "speedup": before / after,
                    "same_rotation": torch.equal(rotations["before"], rotations["after"]),
                    "max_rotation_difference": float(
                        (rotations["before"] - rotations["after"]).abs().max()
                    ),
                    "times": times,
                }
            )
            print(rows[-1])
    lines = [
        f"| group | blocks | threads | iterations | s, {args.before} "
        f"| s, {'GPU' if args.cuda else 'this tree'} "
        "| speed-up | rotations' largest difference |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        # bit for bit, or (another device's summation order) the largest entry difference
        same = "0 (bit for bit)" if r["same_rotation"] else f"{r['max_rotation_difference']:.1e}"
        lines.append(
            f"| {r['group']} | {r['blocks']} | {r['threads']} | {r['iterations']} "
            f"| {r['seconds_before']:.2f} | {r['seconds_after']:.2f} | {r['speedup']:.2f}x "
            f"| {same} |"
        )
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "torch": torch.__version__,
        "before": args.before,
        "rows": rows,
    }
    save(args.out, record, "\n".join(lines))


if __name__ == "__main__":
    main()
