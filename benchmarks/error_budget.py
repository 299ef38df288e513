"""Where the W4A4 error comes from: weight-only, activation-only and per-group splits.

For each method, the transforms are built once in float (``QuantConfig(None, None)``: the
model then computes the same function as the original), and the copies are quantized after
the fact: weights only, activations only, both, and — with ``--per-group`` — activations of
one input group at a time (q/k/v, o_proj, gate/up, down_proj) with everything else in
float. All rows use the same perplexity windows.

Usage::

    python benchmarks/error_budget.py --methods rtn,had32,torq --max-windows 4 \\
        --calib-samples 8 --per-group --out results/error_budget.json
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import asdict

import torch

from common import save
from torq.calibration.data import CalibrationConfig, CaptureSettings
from torq.driver import apply_method
from torq.eval import load_wikitext2_test, perplexity, windows_from_text
from torq.formats import fake_quantize, get_format
from torq.methods import TorqSettings
from torq.methods.registry import method_spec
from torq.models import load
from torq.results import machine_info, now_iso, versions
from torq.rotations.intra_block import IntraBlockConfig
from torq.surgery import QuantConfig, QuantLinear

GROUPS = {
    "q/k/v": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate/up": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@torch.no_grad()
def quantize_after(
    model: torch.nn.Module,
    fmt_name: str,
    weights: bool,
    acts: tuple[str, ...] | None,
    scale_mode: str = "ocp",
):
    """Quantize the float-held QuantLinears of ``model`` in place.

    ``acts=None`` quantizes no activation; an empty tuple quantizes all of them; otherwise
    only the inputs of layers whose name ends with one of ``acts``.
    """
    fmt = get_format(fmt_name, scale_mode if fmt_name == "mxfp4" else "ocp")
    for name, mod in model.named_modules():
        if not isinstance(mod, QuantLinear):
            continue
        if weights:
            mod.weight.copy_(fake_quantize(mod.weight, fmt))
        if acts is not None and (not acts or name.rsplit(".", 1)[-1] in acts):
            mod.input_quantizer.fmt = fmt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="rtn,had32,torq")
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--max-iter", type=int, default=10)
    ap.add_argument("--k-top", type=int, default=32)
    ap.add_argument("--intra-init", default="hadamard", choices=("identity", "hadamard"))
    ap.add_argument(
        "--balance", default="0.5", help="TORQ channel balancing α, or 'none' (the paper)"
    )
    ap.add_argument("--scale-mode", default="ocp", help="MXFP4 scale rule")
    ap.add_argument("--per-group", action="store_true")
    ap.add_argument("--out", default="results/error_budget.json")
    args = ap.parse_args()

    lm = load(args.model)
    windows = windows_from_text(
        load_wikitext2_test(args.data_dir), lm.tokenizer, 2048, args.max_windows
    )
    capture = CaptureSettings(CalibrationConfig(n_samples=args.calib_samples))
    settings = TorqSettings(
        intra=IntraBlockConfig(
            max_iter=args.max_iter,
            k_top=args.k_top,
            init=args.intra_init,
            scale_mode=args.scale_mode,
        ),
        balance=None if args.balance.lower() == "none" else float(args.balance),
    )
    rows = []
    fp = perplexity(lm.model, windows, progress=False).ppl
    rows.append({"method": "fp", "setting": "float", "ppl": fp})
    print(f"fp {fp:.2f}", flush=True)
    for method_name in args.methods.split(","):
        base = copy.deepcopy(lm.model)
        spec = method_spec(method_name, settings)
        method = spec.method
        ctx = spec.context(capture, lm.tokenizer, data_dir=args.data_dir, progress=False)
        t0 = time.perf_counter()
        apply_method(method, base, QuantConfig(None, None), ctx)
        build = time.perf_counter() - t0
        settings_list: list[tuple[str, bool, tuple[str, ...] | None]] = [
            ("W only", True, None),
            ("A only", False, ()),
            ("W4A4", True, ()),
        ]
        if args.per_group:
            settings_list += [(f"A only: {g}", False, names) for g, names in GROUPS.items()]
        for label, w, a in settings_list:
            model = copy.deepcopy(base)
            quantize_after(model, args.format, w, a, args.scale_mode)
            ppl = perplexity(model, windows, progress=False).ppl
            rows.append({"method": method_name, "setting": label, "ppl": ppl, "build_s": build})
            print(f"{method_name} {label}: {ppl:.2f}", flush=True)
        del base

    table = ["| method | setting | PPL | ×FP |", "| --- | --- | ---: | ---: |"]
    table += [
        f"| {r['method']} | {r['setting']} | {r['ppl']:.2f} | {r['ppl'] / fp:.2f} |" for r in rows
    ]
    record = {
        "benchmark": "W4A4 error budget",
        "date": now_iso(),
        "args": vars(args),
        "windows": int(windows.shape[0]),
        "torq_settings": settings.to_dict(),
        "capture": asdict(capture),
        "rows": rows,
        "versions": versions(),
        "machine": machine_info(),
    }
    save(args.out, record, "\n".join(table))


if __name__ == "__main__":
    main()
