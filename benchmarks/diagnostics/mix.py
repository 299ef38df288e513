"""had32 on some groups, identity on others; W4A4 and W-only/A-only."""

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msepatch

from torq.eval import load_wikitext2_test, perplexity, windows_from_text
from torq.methods.hadamard import _block_hadamard
from torq.models import load
from torq.rotations.transform import fuse_inverse_into_weight
from torq.surgery.apply import quantize_model
from torq.surgery.qlinear import QuantConfig

torch.set_num_threads(int(os.environ.get("T", "1")))
nw = int(os.environ.get("NW", "4"))
sm = os.environ.get("SM", "ocp")
lm = load("smollm2-135m")
win = windows_from_text(
    load_wikitext2_test(os.environ.get("TORQ_DATA_DIR", "../shared/data")), lm.tokenizer, 2048, nw
)
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
            t = _block_hadamard(lin.in_features, 32)
            lin.weight.data = fuse_inverse_into_weight(lin.weight, t)
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
