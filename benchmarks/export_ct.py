"""A torq model exported to compressed-tensors and loaded back through transformers: its
WikiText-2 perplexity beside torq's own for the same quantized model, and the folder's size.

    python -m benchmarks.export_ct --model smollm2-135m --methods rtn,had32 --max-windows 4 \\
        --out results/export/smollm2-ct.json
    python -m benchmarks.export_ct --methods torq-had32 --calib-samples 8 --max-windows 4 \\
        --out results/export/smollm2-ct-torq-had32.json

Calibrated methods (``torq-had32``, ``+gptq``) calibrate on ``--calib-samples`` WikiText-2
validation windows, with torq's balancing folded (``--fold-balance``, so that the 32-block
Hadamard alone runs online); torq's own rows are the same folded model.

With ``--format nvfp4`` the weights are NVFP4 and the activations stay in float (W4A16); there
is no activation rule to compare. With ``--format nvfp4-w4a4`` both are NVFP4: what is exported
is torq's model with static activation tensor scales calibrated on the ``--calib-samples``
windows (``act_scale="static"``, compressed-tensors' ``input_global_scale``), set beside
torq's default, each tensor's own scale at every call (``dynamic``).

For each method the model is quantized by torq (W4A4 MXFP4, activations with the ``nearest``
scale rule, the rule transformers' compressed-tensors loader quantizes activations with),
exported (:func:`torq.export.compressed_tensors.export_compressed_tensors`), loaded through
transformers in bf16 with the online transforms attached again
(:func:`~torq.export.compressed_tensors.load_compressed_tensors`), and both models are
evaluated on the same windows; torq's model also with its default ``ocp`` rule. Writes JSON
and a markdown table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common import save
from torq.experimental import (
    CalibrationConfig,
    CaptureSettings,
    QuantConfig,
    TorqSettings,
    apply_method,
    command_line,
    export_compressed_tensors,
    load,
    load_compressed_tensors,
    load_wikitext2_test,
    machine_info,
    method_spec,
    now_iso,
    perplexity,
    resolve_device,
    windows_from_text,
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="rtn,had32")
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--device",
        default="cpu",
        help="where both models are quantized and evaluated (cpu, cuda); the export is "
        "written from the CPU",
    )
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument(
        "--format",
        choices=("mxfp4", "nvfp4", "nvfp4-w4a4"),
        default="mxfp4",
        help="mxfp4: W4A4; nvfp4: NVFP4 weights, float activations (W4A16); nvfp4-w4a4: "
        "NVFP4 W4A4 with static activation scales (exported) and dynamic ones (torq's)",
    )
    ap.add_argument(
        "--exported-rule-only",
        action="store_true",
        help="skip torq's default-rule row (one quantization and evaluation less: full-test runs)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    base = load(args.model)
    text = load_wikitext2_test(args.data_dir)
    windows = windows_from_text(text, base.tokenizer, 2048, args.max_windows)
    settings = TorqSettings(fold=True)
    capture = CaptureSettings(CalibrationConfig(n_samples=args.calib_samples))
    rows = []
    for method in args.methods.split(","):
        row: dict = {"method": method}
        # the rule the exported model is quantized with first, then torq's default
        modes = {
            "mxfp4": ("nearest", "ocp"),
            "nvfp4": ("nearest",),  # (NVFP4 weights alone: no activation rule to compare)
            "nvfp4-w4a4": ("static", "dynamic"),
        }[args.format]
        row["torq_ocp"] = None
        for mode in modes[:1] if args.exported_rule_only else modes:
            model = load(args.model).model.to(device)
            if args.format == "nvfp4":
                qconfig = QuantConfig.from_names("nvfp4", None)
            elif args.format == "nvfp4-w4a4":
                qconfig = QuantConfig.from_names("nvfp4", "nvfp4", act_scale=mode)
            else:
                qconfig = QuantConfig.from_names("mxfp4", "mxfp4", scale_mode=mode)
            spec = method_spec(method, settings)
            context = spec.context(capture, base.tokenizer, progress=False, data_dir=args.data_dir)
            apply_method(spec.method, model, qconfig, context)
            row[f"torq_{mode}"] = perplexity(model, windows, progress=False).ppl
            if mode == modes[0]:
                with tempfile.TemporaryDirectory() as tmp:
                    t0 = time.perf_counter()
                    out = export_compressed_tensors(model.cpu(), Path(tmp) / "ct", base.tokenizer)
                    row["export_seconds"] = time.perf_counter() - t0
                    row["export_bytes"] = sum(f.stat().st_size for f in out.iterdir())
                    del model
                    loaded = load_compressed_tensors(out).to(device)
                    row["transformers"] = perplexity(loaded, windows, progress=False).ppl
                    del loaded
            else:
                del model
        rows.append(row)
        print(row, flush=True)
    record = {
        "model": args.model,
        "format": args.format,
        "windows": int(windows.shape[0]),
        "torq_settings": settings.to_dict(),
        "capture": asdict(capture),
        "rows": rows,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    what = {"mxfp4": "W4A4 MXFP4", "nvfp4": "W4A16 NVFP4", "nvfp4-w4a4": "W4A4 NVFP4"}
    exported, default = ("static", "dynamic") if args.format == "nvfp4-w4a4" else ("nearest", "ocp")
    heads = {
        "nearest": "torq (`nearest` activations)",
        "ocp": "torq (`ocp`, its default)",
        "static": "torq (static activation tensor scales, exported)",
        "dynamic": "torq (dynamic tensor scales, its default)",
    }
    lines = [
        f"{args.model}, first {windows.shape[0]} WikiText-2 windows of 2048 tokens, "
        + what[args.format],
        "",
        f"| method | {heads[exported]} | through transformers (compressed-tensors, bf16) "
        f"| {heads[default]} | export MB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        other = r.get(f"torq_{default}")
        lines.append(
            f"| {r['method']} | {r[f'torq_{exported}']:.3f} | {r['transformers']:.3f} "
            f"| {'–' if other is None else format(other, '.3f')} "
            f"| {r['export_bytes'] / 1e6:.1f} |"
        )
    save(args.out, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
