"""Calibration and W4A4 decoding on a CUDA GPU, each against its reference in the same run.

    python -m benchmarks.gpu --out results/gpu            # on a machine with a CUDA GPU
    python -m benchmarks.gpu --shape tiny --device cpu --out /tmp/gpu-check   # a CPU check

Parts (``--parts``, run in the order given; by default decode, calibration, anatomy,
steps, torq+gptq), each written to ``<out>/gpu.json`` and ``<out>/gpu.md`` as soon as it is
done (no part starts after ``--budget-s``; a run stopped keeps what finished):

1. ``calibration``: the default recipe (``torq-had32+gptaq``, balancing folded, the
   ``nearest`` activation rule) through ``--layers`` decoder layers of the Llama-3-8B shape
   with random weights, on ``--windows`` calibration windows of 2048 random tokens, streamed
   by torq's driver on the GPU: seconds per layer (capture forwards; transform and GPTAQ),
   peak GPU memory, and the whole model's time estimated as the embedding step plus 32
   times the mean of the layers after the first (the first compiles and warms the kernels).
2. ``steps``: one layer of the same shape on ``--step-windows`` windows, the same recipe on
   the machine's CPU and on the GPU: each step's seconds both ways.
3. ``decode``: the 8B shape with random bf16 weights through transformers' ``generate``:
   tokens per second of batch 1 and 16 in bf16, then the same model quantized (``had32``,
   MXFP4 W4A4, OCP rule) and swapped onto torq's kernels by :func:`torq.accelerate`; the
   mean token NLL of the fake-quant model and of the accelerated one on the same windows.
   Each model decodes through eager ``generate`` and with one step captured as a CUDA
   graph; with ``--compiled`` also, at batch 1, with the step through ``torch.compile``
   as one graph (norms, rotary embeddings and attention fused around torq's products, each
   one operator) and then captured: transformers' eager code is most of a graphed step's
   kernels besides the products.
4. ``anatomy``: one layer's capture step taken apart: a float forward pass over the
   windows, and the statistics of one input group of each width, each timed alone.
1b. ``calibration-tf32``: the same with the capture's products in TF32
   (``CaptureSettings(arithmetic="tf32")``: the float32 forwards and the statistics, each
   batch's products summed in float64), beside ``calibration``'s exact arithmetic; both
   rows give GPTQ's summed proxy loss, the agreement of the two calibrations.
5. ``torq+gptq``: the paper's TORQ rotations with GPTQ on one layer of the 8B shape
   (``--windows`` windows): its solvers run on the CPU.
5b. ``torq+gptq-device-solvers``: the same with both TORQ solvers on the GPU
   (``TorqSettings(solver_device="calibration")``, the angle search's batched sweeps); its
   ``solve_seconds`` against ``torq+gptq``'s is the solvers' GPU-against-CPU ratio, and
   GPTQ's summed proxy loss the two runs' agreement.
6. ``checkpoint`` (with ``--model``, a real model, and ``--data-dir``): the model quantized
   with the default recipe on the device (``--calib-samples`` windows), saved as
   compressed-tensors and loaded back through transformers, then on torq's kernels
   (``packed=True``): the perplexity of the first ``--eval-windows`` windows of WikiText-2's
   test for torq's own model, the served one and the packed one, and decoding tokens per
   second of the float model in bf16 against the packed one, as part 3 measures them and
   through ``torq generate --cuda-graph``'s loop (real weights: these perplexities mean
   something).
7. ``arithmetic`` (with ``--model`` and ``--data-dir``): the real model through ``torq
   quantize``'s path (:func:`torq.quantize_checkpoint`, the default recipe,
   ``--calib-samples`` windows of ``--seqlen`` tokens, on the device) once with exact and
   once with TF32 calibration arithmetic (``--arithmetics``: one of them, or both in another
   order); each one's seconds, and the perplexity of the saved folder loaded through
   transformers on the first ``--eval-windows`` windows of WikiText-2's test: what TF32
   costs in accuracy on real weights.

Random weights and random tokens: perplexities mean nothing here; seconds, memory and the
agreement of two computations of the same model are what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.scale import SHAPES
from torq.experimental import write_record

TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
FULL_LAYERS = {"llama3-8b": 32, "tiny": 4}


def dims_of(shape: str) -> dict[str, Any]:
    return dict(TINY) if shape == "tiny" else dict(SHAPES[shape])


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def write_random(folder: Path, dims: dict[str, Any], layers: int, seed: int = 0) -> Path:
    """A Llama checkpoint of ``layers`` decoder layers with random bf16 weights (normal,
    σ = 0.02; norms 1), one shard per layer; no tokenizer (the windows are token ids)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = AutoConfig.for_model("llama", **{**dims, "num_hidden_layers": layers})
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = h // config.num_attention_heads
    kv = config.num_key_value_heads * hd
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    shard("outer.safetensors", {
        "model.embed_tokens.weight": rnd(v, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rnd(v, h),
    })  # fmt: skip
    for li in range(layers):
        p = f"model.layers.{li}."
        shard(f"layer-{li:03d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(h, h),
            p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h),
            p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(i, h),
            p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
        })  # fmt: skip
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config.save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def _summed(record: Any, key: str) -> float:
    """The sum of every ``key`` entry anywhere in a run's nested record."""
    if isinstance(record, dict):
        return sum(
            float(v) if k == key and isinstance(v, (int, float)) else _summed(v, key)
            for k, v in record.items()
        )
    if isinstance(record, list):
        return sum(_summed(v, key) for v in record)
    return 0.0


def streamed_calibration(
    folder: Path,
    method: str,
    windows: torch.Tensor,
    device: torch.device,
    arithmetic: str = "exact",
    solver_device: str = "cpu",
) -> dict[str, Any]:
    """``method`` (a recipe name or a method name) through every layer of ``folder`` on
    ``device`` with torq's streaming driver: the driver's own per-layer seconds
    (``solver_device``: where a TORQ method's solvers run)."""
    from torq.experimental import (
        RECIPES,
        CalibrationConfig,
        CaptureSettings,
        LayerStream,
        QuantConfig,
        TorqSettings,
        layer_plan,
        method_spec,
        run_layerwise,
    )

    if method in RECIPES:
        recipe = RECIPES[method]
        spec, qconfig = recipe.spec(), recipe.quant_config("mxfp4")
    else:
        torq = TorqSettings(solver_device=solver_device)
        spec, qconfig = method_spec(method, torq), QuantConfig.from_names("mxfp4", "mxfp4")
    n, seqlen = windows.shape
    capture = CaptureSettings(CalibrationConfig(n_samples=n, seqlen=seqlen), arithmetic=arithmetic)
    source = LayerStream(folder, device)
    ctx = spec.context(capture, None, source.model.config, progress=False, seed=0)
    plan = layer_plan(spec.method, qconfig, ctx)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = sync(device)
    run = run_layerwise(source, plan, windows, None, progress=False, hidden_states="memory")
    wall = sync(device) - t0
    layers = run.per_layer
    steps = ("load_seconds", "forward_seconds", "solve_seconds")
    in_layers = sum(p[k] for p in layers for k in steps)
    out: dict[str, Any] = {
        "method": spec.method.name,
        "arithmetic": arithmetic,
        "solver_device": solver_device,
        "proxy_loss": _summed(run.details.get("layers"), "proxy_loss"),
        "device": device.type,
        "windows": int(n),
        "seqlen": int(seqlen),
        "layers": len(layers),
        "wall_seconds": wall,
        "outside_layers_seconds": wall - in_layers,
        "per_layer": [{k: p[k] for k in steps} for p in layers],
        "peak_gpu_bytes": None,
    }
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def next_layer_load(folder: Path, device: torch.device) -> float:
    """Seconds to load the second decoder layer of ``folder`` once the first is loaded, as
    the driver does: on a GPU the stream reads it in the background meanwhile (waited for
    here, where a calibration's layer would take seconds), so this is the copy alone."""
    from torq.experimental import LayerStream

    source = LayerStream(folder, device)
    source.load_layer(0)
    ahead = source._pending.get(1)
    if ahead is not None:
        ahead.result()
    t0 = sync(device)
    source.load_layer(1)
    return sync(device) - t0


@torch.no_grad()
def anatomy(folder: Path, windows: int, device: torch.device) -> dict[str, Any]:
    """What one layer's capture step is made of, each timed alone over ``windows`` windows
    (one window's states repeated): a forward pass of the float layer, and the statistics
    of one input group of each width (the block covariances, ``Σ x xᵀ`` and GPTAQ's cross
    term, in float64, and the reservoir)."""
    from torq.experimental import BlockStatistics, LayerStream, embed_windows

    source = LayerStream(folder, device)
    ids = random_windows(1, 2048, source.model.config.vocab_size)
    hidden, kwargs = embed_windows(source, ids)
    layer = source.load_layer(0)
    h = hidden[0]
    layer(h, **kwargs[0])  # warm
    t0 = sync(device)
    for _ in range(windows):
        layer(h, **kwargs[0])
    out: dict[str, Any] = {"windows": windows, "float_forward_s": sync(device) - t0}
    widths = {"hidden": source.model.config.hidden_size}
    widths["intermediate"] = source.model.config.intermediate_size
    gen = torch.Generator(device=device).manual_seed(0)
    for name, width in widths.items():
        x = torch.randn(2048, width, device=device, generator=gen)
        ref = x + 0.01 * torch.randn(2048, width, device=device, generator=gen)
        stats = BlockStatistics(width, 32, 2048, seed=0, hessian=True, cross=True)
        stats.update(x, ref)  # warm
        t0 = sync(device)
        for _ in range(windows):
            stats.update(x, ref)
        out[f"statistics_{name}_{width}_s"] = sync(device) - t0
    return out


def estimate(rec: dict[str, Any], full_layers: int) -> dict[str, float]:
    """The whole model's calibration time from a run of fewer layers: the steps outside the
    layers plus ``full_layers`` times the mean layer after the first (warm)."""
    warm = rec["per_layer"][1:] or rec["per_layer"]
    mean = {k: sum(p[k] for p in warm) / len(warm) for k in warm[0]}
    per_layer = sum(mean.values())
    return {
        "mean_layer_seconds": per_layer,
        "mean_step_seconds": mean,
        "step_share": {k: v / per_layer for k, v in mean.items()},
        "full_model_seconds": rec["outside_layers_seconds"] + full_layers * per_layer,
    }


def random_windows(n: int, seqlen: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seqlen), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode_speed(model: Any, batch: int, new_tokens: int, device: torch.device) -> float:
    """Tokens per second of ``generate``'s decode steps: the time of ``new_tokens`` tokens
    less that of one (the prefill and the first token), each after a warm-up call."""
    prompt = random_windows(batch, 64, model.config.vocab_size, seed=batch).to(device)

    def gen(n: int) -> float:
        t0 = sync(device)
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return sync(device) - t0

    gen(4)  # compiles the kernels for these shapes
    one, many = gen(1), gen(new_tokens)
    return batch * (new_tokens - 1) / (many - one)


@torch.no_grad()
def graphed_decode_speed(
    model: Any, batch: int, new_tokens: int, device: torch.device, compiled: bool = False
) -> float:
    """Tokens per second of greedy decoding with one decode step captured as a CUDA graph
    (:func:`torq.models.decoding.greedy_decode`, ``torq generate --cuda-graph``'s loop, over
    transformers' static cache; what a serving engine does): the GPU's time per token
    without Python's launch overhead. ``compiled``: the step through ``torch.compile``
    first, as one graph (``fullgraph``: its norms, rotary embeddings and attention fused
    around torq's products, each one operator, :mod:`torq.kernels.ops`), then captured.
    Raises where the step cannot be compiled or captured."""
    from torq.experimental import greedy_decode

    forward = None
    if compiled:
        torch._dynamo.reset()  # each model and batch compiled afresh
        forward = torch.compile(model, dynamic=False, fullgraph=True)

    prompt = random_windows(batch, 64, model.config.vocab_size, seed=batch).to(device)
    start: list[float] = []

    def first_token() -> None:  # the clock starts once the step is captured
        if not start:
            start.append(sync(device))

    greedy_decode(
        model, prompt, new_tokens + 1, cuda_graph=True, on_token=first_token, step_forward=forward
    )
    return batch * new_tokens / (sync(device) - start[0])


def all_speeds(
    model: Any,
    new_tokens: int,
    device: torch.device,
    label: str,
    out: dict,
    compiled: bool = False,
    save: Callable[[], None] = lambda: None,
) -> None:
    """Eager ``generate`` and the graphed step, batch 1 and 16 (``compiled``: also the
    compiled graphed step at batch 1, whose speed is the goal; a compilation takes a while),
    into ``out``, calling ``save`` after each row (a run cut short keeps the rows it has)."""
    for b in (1, 16):
        out["tokens_per_s"][f"{label} batch {b}"] = decode_speed(model, b, new_tokens, device)
        save()
        if device.type != "cuda":
            continue
        for how in ("graphed", "compiled graphed") if compiled and b == 1 else ("graphed",):
            t0 = time.perf_counter()
            try:
                tps = graphed_decode_speed(model, b, new_tokens, device, how != "graphed")
            except Exception as exc:  # recorded: the eager rows still stand
                out.setdefault("graph_errors", {})[f"{label} {how} batch {b}"] = repr(exc)[:300]
                save()
                continue
            out["tokens_per_s"][f"{label} {how} batch {b}"] = tps
            # a compiled row's seconds are mostly its compilation
            out.setdefault("row_seconds", {})[f"{label} {how} batch {b}"] = time.perf_counter() - t0
            save()


@torch.no_grad()
def mean_nll(model: Any, windows: torch.Tensor, device: torch.device) -> float:
    total = 0.0
    for w in windows:
        ids = w[None].to(device)
        total += float(model(input_ids=ids, labels=ids).loss)
    return total / windows.shape[0]


def decode(
    dims: dict[str, Any],
    layers: int,
    device: torch.device,
    new_tokens: int,
    share: bool,
    compiled: bool,
    out: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """bf16 against torq's kernels on one random model (module doc, part 3), into ``out``
    (``save`` called after each row)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import torq
    from torq.experimental import MethodContext, QuantConfig, apply_method, get_method

    config = AutoConfig.for_model("llama", **{**dims, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    out.update({"layers": layers, "new_tokens": new_tokens, "tokens_per_s": {}})
    all_speeds(model, new_tokens, device, "bf16", out, compiled, save)
    t0 = sync(device)
    qconfig = QuantConfig.from_names("mxfp4", "mxfp4")
    apply_method(get_method("had32"), model, qconfig, MethodContext(options={"progress": False}))
    out["quantize_seconds"] = sync(device) - t0
    windows = random_windows(2, 512, config.vocab_size, seed=7)
    out["nll_fake_quant"] = mean_nll(model, windows, device)
    t0 = sync(device)
    report = torq.accelerate(model, share=share)
    out["accelerate_seconds"] = sync(device) - t0
    out["accelerate"] = report.summary()
    out["nll_accelerated"] = mean_nll(model, windows, device)
    out["nll_relative_difference"] = abs(out["nll_accelerated"] - out["nll_fake_quant"]) / abs(
        out["nll_fake_quant"]
    )
    save()
    all_speeds(model, new_tokens, device, "torq W4A4", out, compiled, save)
    tps = out["tokens_per_s"]
    for b in (1, 16):
        for how in ("", "graphed ", "compiled graphed "):
            if f"torq W4A4 {how}batch {b}" in tps and f"bf16 {how}batch {b}" in tps:
                ratio = tps[f"torq W4A4 {how}batch {b}"] / tps[f"bf16 {how}batch {b}"]
                tps[f"ratio {how}batch {b}"] = ratio


def checkpoint(args: argparse.Namespace, out: dict[str, Any], save: Callable[[], None]) -> None:
    """A real model through the product's path, on ``--device`` (module doc, part 6), into
    ``out`` (``save`` called after each step)."""
    import torq
    from torq.experimental import load_model

    device, root = torch.device(args.device), Path(args.dir)

    if not args.model:
        raise SystemExit("the checkpoint part needs --model (and --data-dir for WikiText-2)")
    loaded = load_model(args.model)
    model, tokenizer = loaded.model.to(device).eval(), loaded.tokenizer
    out.update({"model": args.model, "calib_samples": args.calib_samples})
    t0 = sync(device)
    torq.quantize(
        model,
        "default",
        calib_samples=args.calib_samples,
        tokenizer=tokenizer,
        data_dir=args.data_dir,
        progress=False,
    )
    out["quantize_seconds"] = sync(device) - t0

    def ppl(m: Any) -> float:
        return torq.evaluate(
            m, tokenizer, max_windows=args.eval_windows, data_dir=args.data_dir, progress=False
        )["ppl"]

    out["ppl_torq"] = ppl(model)
    save()
    folder = root / "checkpoint-ct"
    torq.save(model, folder, overwrite=True)
    del model
    served = torq.load(folder).to(device)
    out["ppl_served"] = ppl(served)
    save()
    del served
    packed = torq.load(folder, packed=True).to(device)
    out["ppl_packed"] = ppl(packed)
    out["tokens_per_s"] = {}
    save()
    all_speeds(packed, args.new_tokens, device, "torq W4A4", out, save=save)
    product_speed(packed, tokenizer, args.new_tokens, device, "torq W4A4", out, save)
    del packed
    float_model = load_model(args.model).model.to(device, torch.bfloat16).eval()
    all_speeds(float_model, args.new_tokens, device, "bf16", out, save=save)
    product_speed(float_model, tokenizer, args.new_tokens, device, "bf16", out, save)


def product_speed(
    model: Any,
    tokenizer: Any,
    new_tokens: int,
    device: torch.device,
    label: str,
    out: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """The decoding speed a user gets from ``torq generate --cuda-graph`` (a GPU only): one
    step captured as a CUDA graph and replayed per token, checked for the end of text."""
    import torq

    if device.type != "cuda":
        return
    key = f"{label} torq generate --cuda-graph batch 1"
    try:
        prompt = "The capital of France is"
        torq.generate(model, prompt, max_new_tokens=4, tokenizer=tokenizer, cuda_graph=True)
        done = torq.generate(
            model, prompt, max_new_tokens=new_tokens, tokenizer=tokenizer, cuda_graph=True
        )
    except Exception as exc:  # recorded: the other rows still stand
        out.setdefault("graph_errors", {})[key] = repr(exc)[:300]
    else:
        if done["decode_tokens_per_s"] is not None:
            out["tokens_per_s"][key] = done["decode_tokens_per_s"]
    save()


def arithmetic(args: argparse.Namespace, out: dict[str, Any], save: Callable[[], None]) -> None:
    """The default recipe on a real model with exact and TF32 calibration (module doc, 7),
    on ``--device``, into ``out`` (``save`` called after each)."""
    import torq

    device, root = torch.device(args.device), Path(args.dir)

    if not args.model or not args.data_dir:
        raise SystemExit("the arithmetic part needs --model and --data-dir")
    out.update(
        {
            "model": args.model,
            "calib_samples": args.calib_samples,
            "eval_windows": args.eval_windows,
        }
    )
    for how in args.arithmetics.split(","):
        folder = root / f"arithmetic-{how}"
        t0 = sync(device)
        torq.quantize_checkpoint(
            args.model,
            folder,
            calib_samples=args.calib_samples,
            calib_seqlen=args.seqlen,
            data_dir=args.data_dir,
            overwrite=True,
            progress=False,
            device=str(device),
            calib_arithmetic=how,
        )
        seconds = sync(device) - t0
        model = torq.load(folder).to(device)
        score = torq.evaluate(
            model,
            max_windows=args.eval_windows,
            seqlen=args.seqlen,
            data_dir=args.data_dir,
            progress=False,
        )
        out[how] = {"seconds": seconds, "ppl": score["ppl"], "windows": score["windows"]}
        del model
        save()
    if "exact" in out and "tf32" in out:
        out["ppl_ratio_tf32_to_exact"] = out["tf32"]["ppl"] / out["exact"]["ppl"]
        out["speedup_tf32"] = out["exact"]["seconds"] / out["tf32"]["seconds"]


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device.type,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def speed_rows(tps: dict[str, float]) -> list[str]:
    """The decode table: bf16 against torq's kernels, eager and graphed, batch 1 and 16."""
    rows = [
        "| decode | bf16 tokens/s | torq W4A4 tokens/s | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for how in ("", "graphed ", "compiled graphed ", "torq generate --cuda-graph "):
        for b in (1, 16):
            bf16, fast = tps.get(f"bf16 {how}batch {b}"), tps.get(f"torq W4A4 {how}batch {b}")
            if bf16 and fast:
                rows.append(
                    f"| {how or 'generate, '}batch {b} | {bf16:.1f} | {fast:.1f} | "
                    f"{fast / bf16:.2f}× |"
                )
    return rows


def markdown(rec: dict[str, Any]) -> str:
    info = rec["machine"]
    shaped = any(rec.get(k) for k in ("calibration", "steps", "decode", "anatomy"))
    lines = [
        f"{info.get('gpu', info['device'])}, torch {info['torch']}, {info['cpu_threads']} CPU "
        f"threads, {info['date']}"
        + (f"; the {rec['shape']} shape with random weights and tokens" if shaped else ""),
        "",
        f"Command: `{rec['command']}`",
        "",
    ]
    cal = rec.get("calibration")
    if cal:
        lines += [
            "| method | arithmetic | TORQ solvers on | windows × tokens | layers run | "
            "s / layer (warm) | capture fwd | transform + GPTQ | est. whole model s | "
            "peak GPU GiB | GPTQ proxy loss |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in cal:
            e = r["estimate"]
            share = e["step_share"]
            peak = r["peak_gpu_bytes"]
            lines.append(
                f"| {r['method']} | {r.get('arithmetic', 'exact')} | "
                f"{'the GPU' if r.get('solver_device') == 'calibration' else 'the CPU'} | "
                f"{r['windows']} × "
                f"{r['seqlen']} | {r['layers']} | "
                f"{e['mean_layer_seconds']:.1f} | {share['forward_seconds']:.0%} | "
                f"{share['solve_seconds']:.0%} | {e['full_model_seconds']:.0f} | "
                f"{'' if peak is None else f'{peak / 2**30:.1f}'} | "
                f"{r.get('proxy_loss', 0.0):.6g} |"
            )
        lines.append("")
    steps = rec.get("steps")
    if steps:
        lines += [
            f"One layer, {steps['windows']} windows, the same recipe on the CPU and the GPU:",
            "",
            "| step | CPU s | GPU s | GPU speed-up |",
            "| --- | ---: | ---: | ---: |",
        ]
        for k in ("load_seconds", "forward_seconds", "solve_seconds"):
            c, g = steps["cpu"]["per_layer"][0][k], steps["gpu"]["per_layer"][0][k]
            lines.append(f"| {k.removesuffix('_seconds')} | {c:.2f} | {g:.2f} | {c / g:.1f}× |")
        nxt = steps.get("next_layer_load_seconds")
        if nxt:
            c, g = nxt["cpu"], nxt["gpu"]
            lines.append(
                f"| load, a layer after the first (on the GPU read ahead) | {c:.2f} | {g:.2f} "
                f"| {c / g:.1f}× |"
            )
        lines.append("")
    dec = rec.get("decode")
    if dec:
        tps = dec["tokens_per_s"]
        lines += [
            f"Decode through transformers' generate ({dec['layers']} layers, "
            f"{dec['new_tokens']} new tokens): "
            + dec.get("accelerate", "the W4A4 model not reached (the run was cut short)"),
            "",
            *speed_rows(tps),
        ]
        for k, v in (dec.get("graph_errors") or {}).items():
            lines.append(f"\nNo CUDA graph for {k}: {v}")
        if "nll_accelerated" in dec:
            lines += [
                "",
                f"Mean token NLL on 2 windows of 512: fake-quant {dec['nll_fake_quant']:.6f}, "
                f"accelerated {dec['nll_accelerated']:.6f} "
                f"(relative difference {dec['nll_relative_difference']:.2e})",
            ]
        lines.append("")
    ana = rec.get("anatomy")
    if ana:
        lines.append(
            f"One layer's capture, its parts alone over {ana['windows']} windows: "
            + ", ".join(
                f"{k.removesuffix('_s')} {v:.1f} s" for k, v in ana.items() if k != "windows"
            )
        )
        lines.append("")
    ck = rec.get("checkpoint")
    if ck:

        def num(key: str, spec: str) -> str:
            return format(ck[key], spec) if key in ck else "(not reached)"

        lines += [
            f"{ck['model']}, the default recipe on {ck['calib_samples']} calibration windows "
            f"({num('quantize_seconds', '.0f')} s): perplexity torq {num('ppl_torq', '.3f')}, "
            f"through transformers {num('ppl_served', '.3f')}, on torq's kernels "
            f"{num('ppl_packed', '.3f')}",
            "",
            *speed_rows(ck.get("tokens_per_s", {})),
            "",
        ]
    ar = rec.get("arithmetic")
    done = [how for how in ("exact", "tf32") if ar and how in ar]
    if ar and done:
        lines += [
            f"{ar['model']}, the default recipe through `torq quantize`'s path on "
            f"{ar['calib_samples']} calibration windows, the saved folder loaded through "
            f"transformers and scored on {ar[done[0]]['windows']} windows of WikiText-2's test:",
            "",
            "| calibration arithmetic | quantize s | perplexity |",
            "| --- | ---: | ---: |",
            *(f"| {how} | {ar[how]['seconds']:.1f} | {ar[how]['ppl']:.3f} |" for how in done),
            "",
        ]
        if "speedup_tf32" in ar:
            lines += [
                f"TF32 against exact: {ar['speedup_tf32']:.2f}× the speed, perplexity "
                f"×{ar['ppl_ratio_tf32_to_exact']:.4f}",
                "",
            ]
    if rec.get("skipped"):
        lines.append("Not run (the time budget): " + ", ".join(rec["skipped"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["llama3-8b", "tiny"], default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=3, help="layers of the calibration run")
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--step-windows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-layers", type=int, default=None, help="default: the shape's")
    ap.add_argument(
        "--no-share",
        action="store_true",
        help="decode with each layer alone (q/k/v and gate/up not one product each)",
    )
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="decode also with the step through torch.compile, then graphed (both models)",
    )
    ap.add_argument("--parts", default="decode,calibration,anatomy,steps,torq+gptq")
    ap.add_argument("--budget-s", type=float, default=480.0, help="no part starts after this")
    ap.add_argument("--dir", default="/tmp/torq-gpu", help="where the checkpoints are written")
    ap.add_argument("--model", default=None, help="the checkpoint part's real model")
    ap.add_argument("--data-dir", default=None, help="WikiText-2 for the checkpoint part")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument(
        "--arithmetics",
        default="exact,tf32",
        help="the arithmetic part's calibrations, in this order (exact, tf32 or both)",
    )
    ap.add_argument("--out", required=True, help="a folder: gpu.json and gpu.md")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    device = torch.device(args.device)
    dims = dims_of(args.shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {
        "shape": args.shape,
        "command": "python -m benchmarks.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": device_info(device),
        "skipped": [],
    }

    def save() -> None:
        write_record(out / "gpu.json", rec)
        (out / "gpu.md").write_text(markdown(rec))

    parts = args.parts.split(",")
    full = FULL_LAYERS[args.shape]
    root = Path(args.dir)
    for part in parts:
        if time.perf_counter() - start > args.budget_s:
            rec["skipped"].append(part)
            save()
            continue
        print(f"[{time.perf_counter() - start:6.0f} s] {part}", flush=True)
        if part in ("calibration", "calibration-tf32", "torq+gptq", "torq+gptq-device-solvers"):
            torq = part.startswith("torq+gptq")
            layers = 1 if torq else args.layers
            folder = write_random(root / f"{args.shape}-{layers}l", dims, layers)
            windows = random_windows(args.windows, args.seqlen, dims["vocab_size"])
            r = streamed_calibration(
                folder,
                "torq+gptq" if torq else "default",
                windows,
                device,
                "tf32" if part == "calibration-tf32" else "exact",
                "calibration" if part == "torq+gptq-device-solvers" else "cpu",
            )
            r["estimate"] = estimate(r, full)
            rec.setdefault("calibration", []).append(r)
        elif part == "steps":
            folder = write_random(root / f"{args.shape}-1l", dims, 1)
            windows = random_windows(args.step_windows, args.seqlen, dims["vocab_size"])
            two = write_random(root / f"{args.shape}-2l", dims, 2)
            rec["steps"] = {
                "windows": args.step_windows,
                "gpu": streamed_calibration(folder, "default", windows, device),
                "cpu": streamed_calibration(folder, "default", windows, torch.device("cpu")),
                "next_layer_load_seconds": {
                    "gpu": next_layer_load(two, device),
                    "cpu": next_layer_load(two, torch.device("cpu")),
                },
            }
        elif part == "anatomy":
            folder = write_random(root / f"{args.shape}-1l", dims, 1)
            rec["anatomy"] = anatomy(folder, args.windows, device)
        elif part == "checkpoint":
            rec["checkpoint"] = {}
            checkpoint(args, rec["checkpoint"], save)
        elif part == "arithmetic":
            rec["arithmetic"] = {}
            arithmetic(args, rec["arithmetic"], save)
        elif part == "decode":
            rec["decode"] = {}
            decode(
                dims,
                args.decode_layers or full,
                device,
                args.new_tokens,
                not args.no_share,
                args.compiled,
                rec["decode"],
                save,
            )
        else:
            raise SystemExit(f"unknown part '{part}'")
        rec["elapsed_seconds"] = time.perf_counter() - start
        save()
        print(f"[{rec['elapsed_seconds']:6.0f} s] {part} done", flush=True)
    print(markdown(rec))


if __name__ == "__main__":
    main()
