"""GPTAQ's asymmetry ``α`` (the weight of the float model's output in its target) with a
run's transform: ``torq run``'s options, then ``+gptaq``'s fixed ``α = 0.25`` replaced.

    python -m benchmarks.diagnostics.gptaq_asymmetry 0.5 --out results/default-alpha05.json \\
        -- --model smollm2-135m --methods torq-had32+gptaq --fold-balance --scale-mode nearest \\
        --calib-samples 32 --max-windows 16 --threads 1

``+gptaq`` is 0.25 (GPTAQ's code) and ``+qronos`` 1 (the loss in full); values between are
not methods of torq, so this script registers, in its own process, each ``+gptaq`` method
given as ``<transform>-gptaq-a<α·1000>`` (``torq-had32-gptaq-a500``): the same method
with its asymmetry replaced, under its own name and settings key. Writes ``torq run``'s
record (JSON and markdown) to ``--out``. ``alpha`` 1 is Qronos's loss with GPTQ's damping
(1 % of H's mean diagonal), which ``+qronos`` was before it took its reference's;
``--qronos-damping`` gives the variant Qronos's damping instead (10⁻³ of H's largest
eigenvalue; name suffix ``-ld``); ``--input-noise`` raises the Hessian's diagonal by the
activation quantizer's error power (``GPTQConfig.input_noise``; suffix ``-an``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from torq.experimental import QRONOS_SETTINGS, get_method, register
from torq.experimental import main as torq_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("alpha", type=float, help="GPTAQ's asymmetry, in [0, 1]")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--qronos-damping", action="store_true", help="damp by 10⁻³ λmax(H), as +qronos does"
    )
    ap.add_argument(
        "--input-noise",
        action="store_true",
        help="H of the quantized inputs: its diagonal raised by the activations' error power",
    )
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or "--methods" not in argv:
        ap.error("give torq run's options after --, --methods among them")
    split = argv.index("--")
    args = ap.parse_args(argv[:split])
    run = list(argv[split + 1 :])
    at = run.index("--methods") + 1
    names = []
    for name in (n.strip() for n in run[at].split(",")):
        if not name.endswith("+gptaq"):
            ap.error(f"{name}: not a method with GPTAQ's weights (+gptaq)")
        method = get_method(name)
        # only the asymmetry (and with --qronos-damping the damping) changes; the method's
        # other GPTQ settings stay
        settings = {**dict(method.gptq_settings), "asymmetry": args.alpha}
        if args.qronos_damping:
            damping = {k: v for k, v in QRONOS_SETTINGS if k in ("damp", "damp_scale")}
            settings.update(damping)
        if args.input_noise:
            settings["input_noise"] = True
        suffix = ("-ld" if args.qronos_damping else "") + ("-an" if args.input_noise else "")
        what = (", Qronos's damping" if args.qronos_damping else "") + (
            ", the activations' error power on H's diagonal" if args.input_noise else ""
        )
        variant = replace(
            method,
            name=f"{name.removesuffix('+gptaq')}-gptaq-a{round(args.alpha * 1000):03d}{suffix}",
            description=f"{method.description} (asymmetry {args.alpha}{what})",
            gptq_settings=tuple(settings.items()),
        )
        names.append(register(variant).name)
    run[at] = ",".join(names)
    return torq_main(["run", *run, "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())
