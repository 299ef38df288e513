"""Where the residual-stream block Hadamard loses against the online one: the relative
output error of each norm-reading group (q/k/v, gate/up) with its activations alone, its
weights alone and both in MXFP4, on calibration tokens, for the two ways of putting the
32-block Hadamard before it.

- online (``had32``): the reader's input ``x = n·diag(γ)`` (``n`` the normalized stream,
  ``γ`` the norm's weight) is rotated online, ``(x H)(W H)ᵀ``;
- residual (``had32 --residual-hadamard``): ``γ`` is folded into the weight and the
  normalized stream arrives rotated, ``(n H)(W diag(γ) H)ᵀ``.

Both compute ``x Wᵀ`` in float; the errors are squared, relative to ``‖x Wᵀ‖²``, mean over
the layers. Also printed: how ``γ`` meets the stream's channel energy, the spread
``‖n‖·‖W diag(γ)‖ / (‖x‖·‖W‖)``; an error spread evenly over the rotated channels, on either
side, grows in the output by about its square when ``γ`` moves from the activations into
the weights (above 1 where ``γ`` damps the stream's largest channels).
"""

import collections
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.diagnostics.diag_common import calib_windows, setup
from torq.experimental import (
    BlockStatistics,
    LinearGroup,
    block_hadamard,
    calibrate_layerwise,
    fake_quantize,
    get_format,
)

lm = setup(default_threads=2)
win = calib_windows(lm, default=4)
fmt = get_format("mxfp4", "nearest")
out: dict[str, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
NORM = {"self_attn": "input_layernorm", "mlp": "post_attention_layernorm"}


def errors(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Relative output errors (activations, weights, both) of ``x wᵀ`` against ``y``."""
    qx, qw = fake_quantize(x, fmt), fake_quantize(w, fmt)
    n = y.pow(2).sum()
    return [float((p @ q.T - y).pow(2).sum() / n) for p, q in ((qx, w), (x, qw), (qx, qw))]


def solver(
    index: int, layer: nn.Module, groups: list[LinearGroup], stats: dict[str, BlockStatistics]
) -> dict[str, Any]:
    """Record each norm-reading group's errors and spread; quantize nothing."""
    mods = dict(layer.named_modules())
    for g in groups:
        parent, kind = g.members[0].rsplit(".", 1)
        if parent not in NORM or kind in ("o_proj", "down_proj"):
            continue
        gamma = mods[NORM[parent]].weight.detach().float()
        w = torch.cat([mods[m].weight.detach().float() for m in g.members])
        x = stats[g.name].sample[:512].float()
        y = x @ w.T
        n = x / gamma
        h = block_hadamard(g.width, 32)
        out[kind]["online A/W/WA"].append(errors(h(x), h.fuse_inverse(w), y))
        out[kind]["residual A/W/WA"].append(errors(h(n), h.fuse_inverse(w * gamma), y))
        spread = (n.norm() * (w * gamma).norm()) / (x.norm() * w.norm())
        out[kind]["gamma spread"].append(float(spread))
    return {}


calibrate_layerwise(lm.model, win, solver, progress=False)
for kind, d in out.items():
    print(kind)
    for k, v in d.items():
        m = np.mean(np.array(v), 0)
        print(f"   {k}: " + (" ".join(f"{z:.4f}" for z in m) if m.ndim else f"{m:.2f}"))
