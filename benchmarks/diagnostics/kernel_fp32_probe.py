"""Whether the MXFP4 kernels ran, and how far they are from the fake-quant reference, on
one Qwen3-30B-A3B expert's gate_up shape (1536×2048, random weights), float32 and bf16 input,
1–2048 tokens: prints the relative difference, whether it is bit-equal, and the kernels the
profiler saw (docs/research/paper-tables.md §12.3). Needs a CUDA GPU:
``PYTHONPATH=src python -m benchmarks.diagnostics.kernel_fp32_probe``.
"""

import torch

from torq.experimental import MXFP4Weight, mxfp4_linear

torch.manual_seed(0)
w = MXFP4Weight.from_float(torch.randn(1536, 2048, device="cuda"))
for m in (1, 3, 16, 128, 2048):
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(m, 2048, device="cuda").to(dt)
        a = mxfp4_linear(x, w).float()
        b = mxfp4_linear(x.float(), w, backend="reference").float()
        with torch.profiler.profile() as p:
            mxfp4_linear(x, w)
            torch.cuda.synchronize()
        names = [e.key for e in p.key_averages() if "mx" in e.key or "gemm" in e.key.lower()]
        print(m, dt, f"{float((a - b).norm() / b.norm()):.2e}", torch.equal(a, b), names[:3])
