"""Best-of-two-exponents MXFP4 (``fq_mse``), patched into torq's fake quantization for the
phases named by ``MSEMODE`` (``w``, ``a``, ``wa``); run directly, it compares the rules on a
Gaussian tensor."""

import os

import torch

from torq.experimental import qlinear as ql
from torq.experimental import round_to_e2m1

_orig = ql.fake_quantize
MODE = os.environ.get("MSEMODE", "")  # "", "w", "a", "wa"
PHASE = ["w"]


def fq_mse(x):
    shp = x.shape
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    _, ex = torch.frexp(amax)
    X0 = torch.ldexp(torch.ones_like(amax), ex - 1 - 2)
    best = besterr = None
    for X in (X0, X0 * 2):
        q = round_to_e2m1(b / X) * X
        err = (q - b).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, besterr = q, err
        else:
            pick = err < besterr
            best = torch.where(pick, q, best)
            besterr = torch.where(pick, err, besterr)
    return best.reshape(shp).to(x.dtype)


def patched(x, fmt):
    if PHASE[0] in MODE and fmt.name == "mxfp4" and x.shape[-1] % 32 == 0:
        return fq_mse(x)
    return _orig(x, fmt)


ql.fake_quantize = patched


if __name__ == "__main__":
    from torq.experimental import fake_quantize, get_format

    torch.manual_seed(0)
    x = torch.randn(4096, 576)
    for sm in ("ocp", "nearest"):
        q = fake_quantize(x, get_format("mxfp4", sm))
        print(sm, float((q - x).pow(2).mean() / x.pow(2).mean()))
    print("best-of-two", float((fq_mse(x) - x).pow(2).mean() / x.pow(2).mean()))
