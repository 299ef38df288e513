"""Peak memory of converting a GGUF model to safetensors: transformers' whole-model GGUF
loading (``from_pretrained(gguf_file=...)`` then ``save_pretrained``, torq's conversion
before issue 26) against torq's tensor-by-tensor conversion
(:func:`torq.models.gguf.convert_gguf_tensorwise`), each in a fresh process.

    python -m benchmarks.gguf_convert --model qwen2.5-coder-0.5b --out results/gguf_convert.json

Writes JSON and a markdown table (``<out>.md``). The peak is the process's resident-set
high-water mark, after the imports (reset through /proc/self/clear_refs, Linux).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torq.experimental import write_record

_SCRIPT = r"""
import json, sys, time, torch
from pathlib import Path
from torq.experimental import GGUF_DTYPES, convert_gguf_tensorwise, resolve_embedded_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

how, name, out, dtype = sys.argv[1:5]
torch.set_num_threads(int(sys.argv[5]))
gguf = resolve_embedded_gguf(name) if not name.endswith(".gguf") else Path(name)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
t0 = time.perf_counter()
if how == "transformers":
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=GGUF_DTYPES[dtype]
    )
    if hasattr(model.config, "quantization_config"):  # as torq's old conversion did
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
else:
    convert_gguf_tensorwise(gguf, Path(out), GGUF_DTYPES[dtype], progress=False)
seconds = time.perf_counter() - t0
disk = sum(p.stat().st_size for p in Path(out).glob("*.safetensors"))
print(json.dumps({"base": base, "peak": status("VmHWM"), "seconds": seconds, "disk": disk,
                  "gguf_bytes": gguf.stat().st_size}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="embedded name or .gguf path")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--conversions", default="transformers,tensorwise")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        for how in args.conversions.split(","):
            with tempfile.TemporaryDirectory(prefix="torq-gguf-") as out:
                proc = subprocess.run(
                    [sys.executable, "-c", _SCRIPT, how, args.model, out, dtype,
                     str(args.threads)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"conversion": how, "dtype": dtype, **r})
            print(rows[-1], flush=True)
    result = {
        "model": args.model,
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, result)
    lines = [
        f"GGUF conversion of {args.model} ({rows[0]['gguf_bytes'] / 2**20:.0f} MiB GGUF)",
        "",
        "| conversion | dtype | peak RSS GiB (above imports) | written GiB | seconds |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['conversion']} | {r['dtype']} | {(r['peak'] - r['base']) / 2**30:.2f} | "
            f"{r['disk'] / 2**30:.2f} | {r['seconds']:.0f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
