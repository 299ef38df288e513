"""Block-energy alignment and W / A / W4A4 layer-output errors on calibration tokens, for
raw, ``had32``, inter-block + ``had32`` and inter-block alone."""

import collections

import numpy as np
import torch

from benchmarks.diagnostics.diag_common import calib_windows, setup
from torq.experimental import (
    BlockRotation,
    InterBlockConfig,
    block_hadamard,
    calibrate_layerwise,
    fake_quantize,
    get_format,
    inter_block_rotations,
)

lm = setup(default_threads=2)
win = calib_windows(lm, default=4)
fmt = get_format("mxfp4")
out = collections.defaultdict(lambda: collections.defaultdict(list))


def relerr(x, W, T):
    y = x @ W.T
    xt = T(x) if T is not None else x
    Wt = T.fuse_inverse(W) if T is not None else W
    qx, qw = fake_quantize(xt, fmt), fake_quantize(Wt, fmt)
    n = y.pow(2).sum()
    return [
        float((qx @ Wt.T - y).pow(2).sum() / n),
        float((xt @ qw.T - y).pow(2).sum() / n),
        float((qx @ qw.T - y).pow(2).sum() / n),
    ]


def solver(li, layer, groups, stats):
    mods = dict(layer.named_modules())
    for g in groups:
        s = stats[g.name]
        kind = g.members[0].rsplit(".", 1)[-1]
        W = torch.cat([mods[m].weight.detach().float() for m in g.members])
        B = s.n_blocks
        a = s.covariance().diagonal(dim1=1, dim2=2).sum(0)  # [B]
        w = W.pow(2).reshape(W.shape[0], B, 32).sum((0, 2)).double()
        out[kind]["C_raw/C_eq"].append(float((a * w).sum() / (a.sum() / B * w.sum())))
        x = s.sample[:512]
        H = block_hadamard(g.width, 32)
        R, _ = inter_block_rotations(s.covariance(), InterBlockConfig())
        IH = BlockRotation(32, R, H.r_intra)
        for tag, T in (
            ("raw", None),
            ("had32", H),
            ("inter+had", IH),
            ("inter", BlockRotation(32, R, None)),
        ):
            e = relerr(x, W, T)
            out[kind][tag + " A/W/WA"].append(e)
    return {}


calibrate_layerwise(lm.model, win, solver, progress=False)
for kind, d in out.items():
    print(kind)
    for k, v in d.items():
        if isinstance(v[0], list):
            m = np.mean(np.array(v), 0)
            print(f"   {k}: " + " ".join(f"{z:.4f}" for z in m))
        else:
            print(f"   {k}: mean {sum(v) / len(v):.3f} min {min(v):.3f} max {max(v):.3f}")
