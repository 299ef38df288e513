"""MXFP4 quantize-dequantize throughput on CPU, against torchao and a plain copy.

Throughput is GB/s of float32 input (bytes of ``x`` / seconds), the median of several
runs on the same tensors, once with torch's default intra-op threads and once with one
thread (on small VMs a sleeping second vCPU can take milliseconds to wake, which makes
multi-threaded timings of every row swing; the one-thread table is the stable one).
Rows:

* ``copy_``: ``y.copy_(x)`` into a preallocated tensor (the bandwidth yardstick).
* ``clone``: ``x.clone()``, a copy into a fresh tensor: it pays for page faults on new
  memory, as ``fake_quantize`` does for its output.
* ``torq fake_quantize``: the public API (allocates its output).
* ``torq compiled kernel (out=)`` / ``torq chunked torch (out=)``: the two fast
  back-ends writing into a preallocated tensor.
* ``torq reference``: the device-agnostic reference path.
* ``torchao to_mx+to_dtype``: torchao's emulated MXFP4 (FLOOR scale mode).

Usage: ``python -m benchmarks.formats [--out results/bench_formats.json]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import time_runs
from torq.experimental import cpu_kernel, fake_quantize_reference, kernels, write_record
from torq.experimental import formats as tf

SHAPES = ((4096, 4096), (2048, 576), (2048, 1536))


def torchao_mxfp4() -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        logging.getLogger("torchao").setLevel(logging.ERROR)
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except ImportError:
        return None
    fp4 = torch.float4_e2m1fn_x2

    def run(x: torch.Tensor) -> torch.Tensor:
        scale, data = to_mx(x, fp4, 32, ScaleCalculationMode.FLOOR)
        return to_dtype(data, scale, fp4, 32, torch.float32)

    return run


def bench_shape(shape: tuple[int, int], repeats: int, slow_repeats: int) -> dict[str, float | None]:
    spec = tf.get_format("mxfp4")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    y = torch.empty_like(x)
    gigabytes = x.numel() * x.element_size() / 1e9
    expected = tf.fake_quantize(x, spec)
    cases: dict[str, tuple[Callable[[], object] | None, int]] = {
        "copy_": (lambda: y.copy_(x), repeats),
        "clone": (lambda: x.clone(), repeats),
        "torq fake_quantize": (lambda: tf.fake_quantize(x, spec), repeats),
        "torq compiled kernel (out=)": (
            (lambda: cpu_kernel.mxfp4_fake_quantize_compiled(x, spec, y))
            if cpu_kernel.load_kernel() is not None
            else None,
            repeats,
        ),
        "torq chunked torch (out=)": (
            lambda: kernels.mxfp4_fake_quantize_chunked(x, spec, y),
            repeats,
        ),
        "torq reference": (lambda: fake_quantize_reference(x, spec), slow_repeats),
    }
    torchao = torchao_mxfp4()
    if torchao is not None:
        same_bits = torch.equal(torchao(x).view(torch.int32), expected.view(torch.int32))
        if not same_bits:
            raise AssertionError("torq and torchao disagree on the benchmark tensor")
        cases["torchao to_mx+to_dtype"] = (lambda: torchao(x), slow_repeats)
    else:
        cases["torchao to_mx+to_dtype"] = (None, 0)
    results: dict[str, dict[str, float] | None] = {}
    for name, (fn, n) in cases.items():
        if fn is None:
            results[name] = None
            continue
        times = time_runs(fn, n)
        results[name] = {
            "median_gbps": gigabytes / statistics.median(times),
            "best_gbps": gigabytes / min(times),
            "runs": n,
        }
    return results


def markdown(results: dict[str, dict[str, dict[str, float] | None]]) -> str:
    """Median (and best) GB/s per path and shape, and the median as a % of ``copy_``."""
    shapes = list(results)
    header = "| path | " + " | ".join(f"{s} GB/s median (best) | % copy_" for s in shapes)
    lines = [header + " |", "|---|" + "---:|---:|" * len(shapes)]
    for name in next(iter(results.values())):
        cells = []
        for shape in shapes:
            value, copy = results[shape][name], results[shape]["copy_"]
            if value is None or copy is None:
                cells += ["n/a", "n/a"]
                continue
            ratio = value["median_gbps"] / copy["median_gbps"]
            cells += [
                f"{value['median_gbps']:.3g} ({value['best_gbps']:.3g})",
                f"{100 * ratio:.1f}%",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/bench_formats.json")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--slow-repeats", type=int, default=3, help="for torchao and reference")
    args = parser.parse_args()

    load_before = os.getloadavg()
    start = time.time()
    default_threads = torch.get_num_threads()
    results = {}
    tables = {}
    for threads in dict.fromkeys((default_threads, 1)):
        torch.set_num_threads(threads)
        results[f"threads={threads}"] = by_shape = {
            "x".join(map(str, shape)): bench_shape(shape, args.repeats, args.slow_repeats)
            for shape in SHAPES
        }
        tables[f"threads={threads}"] = table = markdown(by_shape)
        print(f"\nMXFP4 fake quantization, float32 CPU, {threads} thread(s), median GB/s\n")
        print(table)
    torch.set_num_threads(default_threads)
    record = {
        "benchmark": "mxfp4 fake quantization throughput, GB/s of float32 input (median)",
        "command": "python -m benchmarks.formats " + f"--out {args.out} --repeats {args.repeats} "
        f"--slow-repeats {args.slow_repeats}",
        "results": results,
        "markdown": tables,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "compiled_kernel": cpu_kernel.load_kernel() is not None,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "seconds": time.time() - start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, record)
    md = "\n\n".join(f"### {k}\n\n{v}" for k, v in tables.items())
    out.with_suffix(".md").write_text(f"`{record['command']}`\n\n{md}\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
