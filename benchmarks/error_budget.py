"""Where the W4A4 error comes from: weight-only, activation-only and per-group splits.

For each method, the transforms are built once in float (``QuantConfig(None, None)``: the
model then computes the same function as the original), and the copies are quantized after
the fact: weights only, activations only, both, and — with ``--per-group`` — activations of
one input group at a time (q/k/v, o_proj, gate/up, down_proj) with everything else in
float. All rows use the same perplexity windows. With ``--per-group`` each group's row also
gives the relative MXFP4 error of its transformed inputs ``Σ‖Tx − Q(Tx)‖² / Σ‖Tx‖²`` on the
first window, beside the same error for Gaussian blocks (the floor an orthogonal transform
tends to: mixing many channels makes each block's entries near-Gaussian).

Usage::

    python -m benchmarks.error_budget --methods rtn,had32,torq --max-windows 4 \\
        --calib-samples 8 --per-group --out results/error_budget.json

``--acts-only`` leaves out the rows that quantize weights.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import asdict

import torch

from benchmarks.common import save
from torq.experimental import (
    CalibrationConfig,
    CaptureSettings,
    FormatSpec,
    IntraBlockConfig,
    QuantConfig,
    QuantLinear,
    TorqSettings,
    apply_method,
    command_line,
    fake_quantize,
    get_format,
    load,
    load_wikitext2_test,
    machine_info,
    method_spec,
    now_iso,
    perplexity,
    versions,
    windows_from_text,
)

GROUPS = {
    "q/k/v": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate/up": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def block_format(fmt_name: str, scale_mode: str) -> FormatSpec:
    """``fmt_name``'s spec, with ``scale_mode`` where the format has a choice (MXFP4)."""
    return get_format(fmt_name, scale_mode if fmt_name == "mxfp4" else "ocp")


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
    fmt = block_format(fmt_name, scale_mode)
    for name, mod in model.named_modules():
        if not isinstance(mod, QuantLinear):
            continue
        if weights:
            mod.weight.copy_(fake_quantize(mod.weight, fmt))
        if acts is not None and (not acts or name.rsplit(".", 1)[-1] in acts):
            mod.input_quantizer.fmt = fmt


def gaussian_error(fmt_name: str, scale_mode: str) -> float:
    """The relative MXFP4 error ``‖x − Q(x)‖² / ‖x‖²`` of standard Gaussian entries."""
    fmt = block_format(fmt_name, scale_mode)
    x = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
    return float((x - fake_quantize(x, fmt)).pow(2).sum() / x.pow(2).sum())


@torch.no_grad()
def input_errors(
    model: torch.nn.Module, window: torch.Tensor, fmt_name: str, scale_mode: str
) -> dict[str, float]:
    """Per input group, ``Σ‖Tx − Q(Tx)‖² / Σ‖Tx‖²`` over ``window``'s tokens, ``T`` each
    layer's online transform (the float-held model computes the original function)."""
    fmt = block_format(fmt_name, scale_mode)
    sums = {g: [0.0, 0.0] for g in GROUPS}
    group_of = {n: g for g, names in GROUPS.items() for n in names}
    handles = []
    for name, mod in model.named_modules():
        group = group_of.get(name.rsplit(".", 1)[-1])
        if not isinstance(mod, QuantLinear) or group is None:
            continue

        def hook(m: QuantLinear, args: tuple[torch.Tensor, ...], group: str = group) -> None:
            t = m.input_transform
            x = (t(args[0]) if t is not None else args[0]).float()
            sums[group][0] += float((x - fake_quantize(x, fmt)).pow(2).sum())
            sums[group][1] += float(x.pow(2).sum())

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        model(window.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    return {g: err / energy for g, (err, energy) in sums.items() if energy > 0}


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
    ap.add_argument("--acts-only", action="store_true", help="no rows with quantized weights")
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
    floor = gaussian_error(args.format, args.scale_mode) if args.per_group else None
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
        if args.acts_only:
            settings_list = settings_list[1:2]
        errors: dict[str, float] = {}
        if args.per_group:
            settings_list += [(f"A only: {g}", False, names) for g, names in GROUPS.items()]
            errors = input_errors(base, windows[0], args.format, args.scale_mode)
        for label, w, a in settings_list:
            model = copy.deepcopy(base)
            quantize_after(model, args.format, w, a, args.scale_mode)
            ppl = perplexity(model, windows, progress=False).ppl
            row = {"method": method_name, "setting": label, "ppl": ppl, "build_s": build}
            group = label.removeprefix("A only: ")
            if group in errors:
                row["input_error"] = errors[group]
            rows.append(row)
            print(f"{method_name} {label}: {ppl:.2f}", flush=True)
        del base

    table = [
        "| method | setting | PPL | ×FP | input error ÷ Gaussian's |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    table += [
        f"| {r['method']} | {r['setting']} | {r['ppl']:.2f} | {r['ppl'] / fp:.2f} | "
        + (f"{r['input_error'] / floor:.2f} |" if floor and "input_error" in r else "|")
        for r in rows
    ]
    if floor is not None:
        table.append(f"\nGaussian entries' relative error ({args.scale_mode} scales): {floor:.5f}")
    record = {
        "benchmark": "W4A4 error budget",
        "date": now_iso(),
        "command": command_line(),
        "args": vars(args),
        "windows": int(windows.shape[0]),
        "gaussian_input_error": floor,
        "torq_settings": settings.to_dict(),
        "capture": asdict(capture),
        "rows": rows,
        "versions": versions(),
        "machine": machine_info(),
    }
    save(args.out, record, "\n".join(table))


if __name__ == "__main__":
    main()
