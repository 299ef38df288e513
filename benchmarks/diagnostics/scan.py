"""had32 W4A4 everywhere; layer L float (mode skip) or layer L raw-RTN (mode raw)."""

import copy
import sys

from benchmarks.diagnostics.diag_common import eval_windows, setup
from torq.experimental import (
    QuantConfig,
    block_hadamard,
    decoder_layers,
    perplexity,
    quantize_model,
)

lm = setup(default_threads=2)
win = eval_windows(lm)
mode = sys.argv[1]
for L in [int(v) for v in sys.argv[2].split(",")]:
    m = copy.deepcopy(lm.model)

    def f(name, lin, L=L):
        if mode == "raw" and name.startswith(f"layers.{L}."):
            return None
        t = block_hadamard(lin.in_features, 32)
        lin.weight.data = t.fuse_inverse(lin.weight)
        return t

    quantize_model(m, QuantConfig.from_names("mxfp4", "mxfp4"), f)
    if mode == "skip":
        decoder_layers(m)[L] = copy.deepcopy(decoder_layers(lm.model)[L])
    print(mode, L, f"{perplexity(m, win, progress=False).ppl:.2f}", flush=True)
