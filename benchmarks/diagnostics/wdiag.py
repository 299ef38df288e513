"""Relative MXFP4 weight MSE per projection, raw and ``had32``, for each scale rule and the
best of two exponents per block."""

import collections

import torch

from torq.experimental import fake_quantize, get_format, hadamard_matrix, load

torch.set_num_threads(1)
lm = load("smollm2-135m")
H = hadamard_matrix(32).float()
H = H / H[0].norm()


def rel(w, q):
    return float((w - q).double().pow(2).sum() / w.double().pow(2).sum())


def mse_search(w):
    fo = get_format("mxfp4", "ocp")
    q0 = fake_quantize(w, fo)
    q1 = fake_quantize(w * 0.5, fo) * 2  # exponent+1 relative? scale halves value → scale ×2
    b = w.shape[-1] // 32
    e0 = (w - q0).reshape(w.shape[0], b, 32).pow(2).sum(-1)
    e1 = (w - q1).reshape(w.shape[0], b, 32).pow(2).sum(-1)
    pick = (e1 < e0).unsqueeze(-1)
    return torch.where(
        pick, q1.reshape(w.shape[0], b, 32), q0.reshape(w.shape[0], b, 32)
    ).reshape_as(w)


acc = collections.defaultdict(lambda: collections.defaultdict(list))
for n, m in lm.model.named_modules():
    if isinstance(m, torch.nn.Linear) and "layers" in n:
        w = m.weight.detach().float()
        kind = n.rsplit(".", 1)[-1]
        wr = (w.reshape(w.shape[0], -1, 32) @ H.T).reshape_as(w)
        for tag, ww in (("raw", w), ("had32", wr)):
            for sm in ("ocp", "nearest", "rceil"):
                acc[kind][f"{tag}/{sm}"].append(rel(ww, fake_quantize(ww, get_format("mxfp4", sm))))
            acc[kind][f"{tag}/mse"].append(rel(ww, mse_search(ww)))
for kind, d in acc.items():
    print(kind, "  ".join(f"{k}={sum(v) / len(v):.4f}" for k, v in d.items()))
