"""had32 W4A4 everywhere; layer L float (mode skip) or layer L raw-RTN (mode raw)."""

import copy
import os
import sys

import torch

from torq.eval import load_wikitext2_test, perplexity, windows_from_text
from torq.methods.hadamard import _block_hadamard
from torq.models import load
from torq.rotations.transform import fuse_inverse_into_weight
from torq.surgery.apply import quantize_model
from torq.surgery.qlinear import QuantConfig

torch.set_num_threads(int(os.environ.get("T", "2")))
lm = load("smollm2-135m")
win = windows_from_text(
    load_wikitext2_test(os.environ.get("TORQ_DATA_DIR", "../shared/data")),
    lm.tokenizer,
    2048,
    int(os.environ.get("NW", "4")),
)
mode = sys.argv[1]
for L in [int(v) for v in sys.argv[2].split(",")]:
    m = copy.deepcopy(lm.model)

    def f(name, lin, L=L):
        if mode == "raw" and name.startswith(f"layers.{L}."):
            return None
        t = _block_hadamard(lin.in_features, 32)
        lin.weight.data = fuse_inverse_into_weight(lin.weight, t)
        return t

    quantize_model(m, QuantConfig.from_names("mxfp4", "mxfp4"), f)
    if mode == "skip":
        from torq.models.architecture import decoder_layers

        decoder_layers(m)[L] = copy.deepcopy(decoder_layers(lm.model)[L])
    print(mode, L, f"{perplexity(m, win, progress=False).ppl:.2f}", flush=True)
