import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msepatch

from torq.calibration.capture import calibrate_layerwise
from torq.calibration.data import CalibrationConfig, calibration_windows
from torq.eval import load_wikitext2_test, perplexity, windows_from_text
from torq.methods.gptq import GroupSolver
from torq.models import load
from torq.rotations.hadamard import hadamard_matrix
from torq.rotations.transform import BlockRotation
from torq.surgery.qlinear import QuantConfig

torch.set_num_threads(int(os.environ.get("T", "2")))
lm = load("smollm2-135m")
win = windows_from_text(
    load_wikitext2_test(os.environ.get("TORQ_DATA_DIR", "../shared/data")),
    lm.tokenizer,
    2048,
    int(os.environ.get("NW", "4")),
)
cal = calibration_windows(
    lm.tokenizer,
    CalibrationConfig(n_samples=int(os.environ.get("NC", "8"))),
    os.environ.get("TORQ_DATA_DIR", "../shared/data"),
)
H = hadamard_matrix(32)


class S(GroupSolver):
    def __init__(self, alpha, stat, cfg):
        super().__init__(cfg)
        self.alpha = alpha
        self.stat = stat

    def transform(self, group, stats):
        if self.alpha is None:
            return BlockRotation(32, None, H), {}
        mods = self.layer_mods
        W = torch.cat([mods[m].weight.detach().double() for m in group.members])
        cov = stats.covariance()  # [K,B,B]
        xr = cov.diagonal(dim1=1, dim2=2).T.reshape(-1).clamp_min(1e-12).sqrt()  # channel b*K+k
        if self.stat == "max":
            xr = stats.sample.double().abs().amax(0).clamp_min(1e-12)
            wr = W.abs().amax(0).clamp_min(1e-12)
        else:
            wr = W.pow(2).mean(0).sqrt().clamp_min(1e-12)
        s = xr.pow(self.alpha) / wr.pow(1 - self.alpha)
        s = s / s.log().mean().exp()
        return BlockRotation(32, None, H, channel_scale=s.float()), {}

    def __call__(self, index, layer, groups, stats):
        self.layer_mods = dict(layer.named_modules())
        return super().__call__(index, layer, groups, stats)


for spec in sys.argv[1:]:
    a, stat = spec.split(":")
    alpha = None if a == "none" else float(a)
    m = copy.deepcopy(lm.model)
    msepatch.PHASE[0] = "w"
    calibrate_layerwise(
        m,
        cal,
        S(alpha, stat, QuantConfig.from_names("mxfp4", "mxfp4", os.environ.get("SM", "ocp"))),
        progress=False,
    )
    msepatch.PHASE[0] = "a"
    print(
        spec,
        os.environ.get("SM", "ocp"),
        os.environ.get("MSEMODE", ""),
        f"{perplexity(m, win, progress=False).ppl:.2f}",
        flush=True,
    )
