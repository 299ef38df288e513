"""GPTAQ's asymmetry ``α`` (the weight of the float model's output in its target) with a
run's transform: ``torq run``'s options, then ``+gptaq``'s fixed ``α = 0.25`` replaced.

    python benchmarks/diagnostics/gptaq_asymmetry.py 0.5 --out results/default-alpha05.json \\
        -- --model smollm2-135m --methods torq-had32+gptaq --fold-balance --scale-mode nearest \\
        --calib-samples 32 --max-windows 16 --threads 1

``+gptaq`` is 0.25 (GPTAQ's code) and ``+qronos`` 1 (the loss in full); values between are
not methods of torq, so this script registers, in its own process, each ``+gptaq`` method
given as ``<transform>-gptaq-a<α·1000>`` (``torq-had32-gptaq-a500``): the same method
with its asymmetry replaced, under its own name and settings key. Writes ``torq run``'s
record (JSON and markdown) to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from torq.api import compare
from torq.cli import capture_from_args, torq_settings_from_args
from torq.cli.arguments import build_parser
from torq.methods.registry import get_method, method_spec, register
from torq.surgery.gptq import GPTQConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("alpha", type=float, help="GPTAQ's asymmetry, in [0, 1]")
    ap.add_argument("--out", required=True)
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        ap.error("give torq run's options after --")
    split = argv.index("--")
    args = ap.parse_args(argv[:split])
    run_args = build_parser().parse_args(["run", *argv[split + 1 :]])
    if run_args.threads:
        torch.set_num_threads(run_args.threads)
    torq = torq_settings_from_args(run_args)
    gptq = GPTQConfig(
        damp=run_args.gptq_damp, act_order=run_args.act_order, scale_search=run_args.gptq_scales
    )
    specs = []
    for name in run_args.methods.split(","):
        method = get_method(name.strip())
        if not name.strip().endswith("+gptaq"):
            raise SystemExit(f"{name}: not a method with GPTAQ's weights (+gptaq)")
        variant = replace(
            method,
            name=f"{name.strip().removesuffix('+gptaq')}-gptaq-a{round(args.alpha * 1000):03d}",
            description=f"{method.description} (asymmetry {args.alpha})",
            gptq_settings=(("asymmetry", args.alpha),),
        )
        register(variant)
        specs.append(method_spec(variant.name, torq, gptq))
    result = compare(
        run_args.model,
        specs,
        (torq, gptq),
        capture=capture_from_args(run_args),
        out=args.out,
        progress=not run_args.no_progress,
        seqlen=run_args.seqlen,
        max_windows=run_args.max_windows,
        data_dir=run_args.data_dir,
        seed=run_args.seed,
        scale_mode=run_args.scale_mode,
        device=run_args.device,
    )
    print(result["table"])


if __name__ == "__main__":
    main()
