"""Peak memory and time per layer of the streamed driver (``torq run``) against
the model's size: a Llama-3-8B-shaped and a 0.92B Llama-shaped checkpoint with random
weights, written layer by layer in bf16 shards, and SmolLM2-135M (real weights); with
``--layers N`` a shape's widths with N layers (``llama3-70b --layers 2``: a 70B model's
layer, embedding and head on this machine's disk).

    python -m benchmarks.scale --shape llama3-8b --methods rtn,torq-had32 \\
        --calib-samples 8 --eval-windows 2 --dir /tmp/torq-scale --out results/scale/8b.json

``--resume-dir DIR`` lets a long run (TORQ through the 8B shape's 32 layers: hours here)
continue after a stop: the wall time is then the last process's, the per-layer seconds and
step peaks cover every layer.

``--reload packed,unpacked`` also saves each quantized model as it streams and evaluates the
saved checkpoint again, whole, with its weights unpacked to float32 or kept packed: the
memory a zero-shot run from the checkpoint needs; ``offload`` and ``packed-offload`` do the
same with its decoder layers kept on disk (``--offload-dir``, accelerate's offload), read
back one at a time: the memory for a checkpoint larger than this machine's.

Each method runs in its own ``torq run`` process (so each peak resident set is
its own, read by the process itself); the random checkpoints use SmolLM2's tokenizer
(its ids are valid in any vocabulary at least as large). Random weights: the perplexity
of those rows means nothing; memory and time are what is measured. Writes JSON and a
markdown table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from torq.experimental import read_record, write_record

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3-8B: 32 layers, hidden 4096, FFN 14336, 32 query / 8 KV heads, vocab 128256
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    # Llama-3-70B: 80 layers, hidden 8192, FFN 28672, 64 query / 8 KV heads, vocab 128256
    # (140 GB of bf16: for its layer size, with --layers)
    "llama3-70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    # a 0.41B Llama shape: hidden 1024, 24 layers, FFN 4096, 16/4 heads, SmolLM2's vocab,
    # tied embeddings (the memory of a small model run with no memory flag)
    "llama-0.4b": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    # a 0.92B shape: hidden 2048, 16 layers, FFN 5632, 16/4 heads, SmolLM2's vocab
    "llama-0.9b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}


def smollm2_folder() -> Path:
    from torq.experimental import convert_gguf, resolve_embedded_gguf

    return convert_gguf(resolve_embedded_gguf("smollm2-135m"))


def write_random_checkpoint(
    shape: str, out: Path, seed: int = 0, layers: int | None = None
) -> Path:
    """A Llama-shaped checkpoint of random bf16 weights, written one decoder layer per shard
    (never more than one layer in memory), with SmolLM2's tokenizer; ``layers`` keeps the
    shape's widths with fewer (or more) decoder layers."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    marker = out / "torq_random_checkpoint.json"
    if marker.is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dims = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    config = AutoConfig.for_model("llama", **dims, torch_dtype="bfloat16")
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, list[str]] = {}
    layers = config.num_hidden_layers
    for name, _ in skeleton.named_parameters():
        parts = name.split(".")
        key = f"layer-{int(parts[2]):03d}" if name.startswith("model.layers.") else "outer"
        shards.setdefault(key, []).append(name)
    weight_map: dict[str, str] = {}
    params = dict(skeleton.named_parameters())
    for i, (key, names) in enumerate(sorted(shards.items())):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape_ = params[name].shape
            if name.endswith("norm.weight"):
                t = torch.ones(shape_, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shape_, generator=gen) * 0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = file
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
        print(f"  wrote {key} ({i + 1}/{len(shards)})", file=sys.stderr, flush=True)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    config.save_pretrained(str(tmp))
    tok = smollm2_folder()
    for f in tok.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",):
            shutil.copy(f, tmp / f.name)
    n_params = sum(p.numel() for p in params.values())
    (tmp / "torq_random_checkpoint.json").write_text(
        json.dumps({"shape": shape, "seed": seed, "parameters": n_params, "layers": layers})
    )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


RELOADS = ("unpacked", "packed", "offload", "packed-offload")


def reload_saved(saved: Path, method: str, how: str, args: argparse.Namespace, out: Path) -> dict:
    """The saved checkpoint evaluated whole (not streamed) in a fresh process, its weights
    unpacked to float32 or kept packed (``--packed``), its layers in memory or on disk
    (``--offload-dir``): what a zero-shot run from it holds."""
    if how not in RELOADS:
        raise SystemExit(f"--reload: unknown '{how}' (one of {', '.join(RELOADS)})")
    packed = ["--packed"] if how.startswith("packed") else []
    offload = ["--offload-dir", str(Path(args.dir) / "offload")] if "offload" in how else []
    cmd = [
        sys.executable, "-m", "torq.cli", "run", "--model", str(saved), "--methods", method,
        "--max-windows", str(args.eval_windows), "--threads", str(args.threads),
        "--no-progress", "--out", str(out), *packed, *offload,
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    record = read_record(out)
    return {
        "how": how,
        "ppl": record["rows"][0]["ppl"],
        "peak_rss_bytes": record["peak_memory"]["host_rss_bytes"],
        "wall_seconds": time.perf_counter() - t0,
        "command": " ".join(cmd),
    }


def step_peaks(details: dict[str, Any]) -> dict[str, int]:
    """The largest resident set of each step of a streamed run: over the layers for the
    layer steps (load, capture, quantize, evaluate), and the embedding and head steps."""
    peaks: dict[str, int] = {}
    for p in details["streamed"]["per_layer"]:
        for step, v in (p.get("peak_rss_bytes") or {}).items():
            if v:
                peaks[step] = max(peaks.get(step, 0), v)
    for step, v in (details.get("peak_rss_bytes") or {}).items():
        if v:
            peaks[step] = v
    return peaks


def run_method(folder: Path, spec: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``torq run`` of ``spec``: a method, then any of its flags (``torq-had32+gptq
    --fold-balance --act-order``)."""
    method, *flags = shlex.split(spec)
    save = ["--save-dir", str(Path(args.dir) / "saved")] if args.reload else []
    # a run stopped (a session's end) continues after its last kept layer
    save += ["--resume-dir", args.resume_dir] if args.resume_dir else []
    cmd = [
        sys.executable, "-m", "torq.cli", "run", "--model", str(folder), "--methods", method,
        "--max-windows", str(args.eval_windows), "--calib-samples",
        str(args.calib_samples), "--threads", str(args.threads), "--no-progress",
        "--out", str(out), *save, *flags,
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    record = read_record(out)
    row = record["rows"][0]
    reloads = []
    if args.reload:
        saved = Path(row["details"]["saved"]["path"])
        for how in args.reload.split(","):
            again = out.with_name(f"{out.stem}-reload-{how}.json")
            reloads.append(reload_saved(saved, method, how, args, again))
    per_layer = row["details"]["streamed"]["per_layer"]
    n = len(per_layer)
    steps = step_peaks(row["details"])
    resumed = row["details"].get("resumed_at_layer")
    return {
        "method": spec,
        "ppl": row["ppl"],
        # a run continued from kept progress: its own peak, and each earlier layer's steps
        "peak_rss_bytes": max([record["peak_memory"]["host_rss_bytes"], *steps.values()]),
        "resumed_at_layer": resumed,
        "wall_seconds": wall,
        "quantize_seconds": row["quantize_seconds"],
        "calibration_seconds": row["details"].get("calibration_seconds"),
        "eval_seconds": row["eval_seconds"],
        "seconds_per_layer": {
            k: sum(p[k] for p in per_layer) / n
            for k in ("load_seconds", "forward_seconds", "solve_seconds", "eval_seconds")
        },
        "layers": n,
        "step_peak_rss_bytes": steps,
        "command": " ".join(cmd),
        "record": str(out),
        "saved": row["details"].get("saved"),
        "reloads": reloads,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*SHAPES, "smollm2-135m"], required=True)
    ap.add_argument(
        "--layers",
        type=int,
        help="the shape's widths with this many decoder layers (a layer step's memory and "
        "time do not depend on the depth)",
    )
    ap.add_argument(
        "--methods",
        default="rtn,torq-had32",
        help="comma-separated, each a method and any of its torq run flags "
        "('torq-had32+gptq --fold-balance --act-order')",
    )
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/torq-scale", help="where the checkpoints are written")
    ap.add_argument(
        "--reload",
        default="",
        help="also save each quantized model as it streams (--save-dir DIR/saved) and "
        "evaluate it again whole, comma-separated: 'unpacked', 'packed' (weights in memory), "
        "'offload', 'packed-offload' (layers on disk, read back one at a time)",
    )
    ap.add_argument(
        "--resume-dir",
        default=None,
        help="keep each streamed run's progress between layers here (torq run --resume-dir): "
        "the same command again continues after the last layer kept (not with --reload)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.resume_dir and args.reload:
        ap.error("--resume-dir keeps a streamed run's progress only without --reload")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.shape == "smollm2-135m":
        folder, info = smollm2_folder(), {"real_weights": True}
    else:
        name = args.shape + (f"-{args.layers}l" if args.layers else "")
        folder = write_random_checkpoint(args.shape, Path(args.dir) / name, layers=args.layers)
        info = json.loads((folder / "torq_random_checkpoint.json").read_text())
    write_seconds = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")
    rows = []
    for method in args.methods.split(","):
        tag = re.sub(r"[^A-Za-z0-9.]+", "-", method).strip("-")
        rec = out.with_name(f"{out.stem}-{tag}.run.json")
        rows.append(run_method(folder, method, args, rec))
        result = {
            "shape": args.shape,
            "layers_override": args.layers,
            "checkpoint": {**info, "folder": str(folder), "bytes_on_disk": disk},
            "write_seconds": write_seconds,
            "calib_samples": args.calib_samples,
            "eval_windows": args.eval_windows,
            "threads": args.threads,
            "rows": rows,
            "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cpu_count": os.cpu_count(),
        }
        write_record(out, result)
    lines = [
        f"{args.shape}: {disk / 1e9:.2f} GB on disk, {args.calib_samples} calibration windows, "
        f"{args.eval_windows} evaluation windows of 2048 tokens, {args.threads} threads",
        "",
        "| method | peak RSS GiB | s/layer load | s/layer capture | s/layer solve "
        "| s/layer eval | quantize s | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        s = r["seconds_per_layer"]
        lines.append(
            f"| {r['method']} | {r['peak_rss_bytes'] / 2**30:.2f} | {s['load_seconds']:.1f} | "
            f"{s['forward_seconds']:.1f} | {s['solve_seconds']:.1f} | {s['eval_seconds']:.1f} "
            f"| {r['quantize_seconds']:.0f} | {r['wall_seconds']:.0f} |"
        )
    if any(r["step_peak_rss_bytes"] for r in rows):
        lines += [
            "",
            "Peak resident set of each step (GiB; layer steps: the largest over layers):",
            "",
        ]
        for r in rows:
            steps = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in r["step_peak_rss_bytes"].items())
            lines.append(f"- {r['method']}: {steps}")
    reloads = [(r["method"], x) for r in rows for x in r["reloads"]]
    if reloads:
        lines += [
            "",
            "| saved method, evaluated whole | weights | peak RSS GiB | PPL | wall s |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for method, x in reloads:
            lines.append(
                f"| {method} | {x['how']} | {x['peak_rss_bytes'] / 2**30:.2f} | {x['ppl']:.6g} "
                f"| {x['wall_seconds']:.0f} |"
            )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
