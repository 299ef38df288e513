"""had32 on some groups, identity on others; W4A4 and W-only/A-only."""

import copy
import os
import sys

from benchmarks.diagnostics import msepatch
from benchmarks.diagnostics.diag_common import eval_windows, setup
from torq.experimental import QuantConfig, block_hadamard, perplexity, quantize_model

sm = os.environ.get("SM", "ocp")
lm = setup(default_threads=1)
win = eval_windows(lm)
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gu": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def run(rot_groups, w="mxfp4", a="mxfp4"):
    m = copy.deepcopy(lm.model)
    names = tuple(n for g in rot_groups for n in GROUPS[g])

    def f(name, lin):
        if name.rsplit(".", 1)[-1] in names:
            t = block_hadamard(lin.in_features, 32)
            lin.weight.data = t.fuse_inverse(lin.weight)
            return t
        return None

    cfg = QuantConfig.from_names(w, a, sm)
    msepatch.PHASE[0] = "w"
    quantize_model(m, cfg, f)
    msepatch.PHASE[0] = "a"
    return perplexity(m, win, progress=False).ppl


for spec in sys.argv[1:]:
    rg, w, a = spec.split(":")
    rgs = [] if rg == "none" else rg.split("+")
    print(spec, f"{run(rgs, None if w == 'fp' else w, None if a == 'fp' else a):.2f}", flush=True)
